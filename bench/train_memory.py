"""Host memory of stage two: peak RSS of `prlmfuse train`, the training process and its loader worker apart.

Each measured run is a real `prlmfuse train --runs NAME --fresh` subprocess on a real pipeline:
the Bible English->Japanese corpus (`prlmfuse run --only data`), the `small` preset, a 4,000-id
BPE, batches of at most 1,200 tokens, a few hundred updates (the peak is reached in the first
ones), the first N training pairs (`max_train_pairs`) for each N of `--pairs`, for the baseline
and a run fusing minilm-l6's penultimate layer from its cache (`prlmfuse run --only cache`, built
once and not measured). While a run trains, its process tree is sampled from /proc every 50 ms:

  train    VmHWM of the `prlmfuse train` process (the kernel's own peak RSS of that process)
  worker   the largest VmHWM of its DataLoader workers (children of the forkserver it starts that live
           to the end of training)
  other    the largest VmHWM of the forkserver's children that ended earlier (the BPE trainer)
  tree     the largest sum of VmRSS over the whole tree at one sample (shared pages counted twice)

`--env KEY=VALUE` (repeatable) sets a variable in the trainer's environment, to measure a setting
without changing code (e.g. `--env ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024`).

`--phases` instead re-enacts train_run's phases in one child process (the bench itself, in its
own python) and prints RSS and the peak so far after each: imports, corpus and caches opened,
BPE training, encoding both splits, datasets, model, trainer (optimizer, loaders), then training
steps in blocks of `--phase-every` updates. It calls the same library functions train_run calls,
in the same order, so a jump names the phase that costs the memory.

    python bench/train_memory.py [--pairs 10000,30000] [--systems baseline,fused] [--updates 300]
    python bench/train_memory.py --phases [--pairs 30000] [--systems baseline]

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.05

PIPELINE = """\
# Written by bench/train_memory.py: the `small` preset on the Bible, one run per (system, pairs).
workdir: .
data: {{kind: bible, src: en, tgt: ja}}
cache:
  backend: zarr
  dtype: float16
  checkpoints:
    - {{name: {checkpoint}, layers: [{layer}]}}
train:
  defaults:
    preset: small
    bpe_vocab: {bpe_vocab}
    max_tokens: {max_tokens}
    lr: 7e-4
    warmup: 300
    max_updates: {updates}
    max_epochs: null
    save_every: 1000000
    keep_last: 1
    seed: 1
    num_workers: {workers}
  runs:
{runs}
"""


def run_name(system: str, pairs: int) -> str:
    return f"{system}-{pairs}"


def pipeline_text(systems: list[str], pairs: list[int], *, checkpoint: str = "minilm-l6", layer: int = -2,
                  bpe_vocab: int = 4000, max_tokens: int = 1200, updates: int = 300, workers: int = 1) -> str:
    """The bench's pipeline.yaml: one run per (system, pairs); `fused` reads `checkpoint`'s `layer`."""
    runs = []
    for system in systems:
        for n in pairs:
            settings = f"max_train_pairs: {n}"
            if system == "fused":
                settings += f", prlms: [{{checkpoint: {checkpoint}, layer: {layer}}}]"
            elif system != "baseline":
                raise ValueError(f"unknown system {system!r}; use baseline or fused")
            runs.append(f"    {run_name(system, n)}: {{{settings}}}")
    return PIPELINE.format(checkpoint=checkpoint, layer=layer, bpe_vocab=bpe_vocab, max_tokens=max_tokens,
                           updates=updates, workers=workers, runs="\n".join(runs))


# ------------------------------------------------------------------------------------ /proc


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in KiB from /proc/PID/status; {} once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's children list)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                kids.extend(int(x) for x in f.read().split())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return kids


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def classify_tree(root: int) -> dict[str, list[int]]:
    """The process tree of a trainer: {"train": [root], "worker": [...], "helper": [...]}.

    Loader workers are forked by the multiprocessing forkserver, spawned with a
    `multiprocessing.spawn` command line, or forked from the trainer itself (its own command line,
    as fairseq's are); the forkserver and resource tracker are helpers.
    """
    tree = {"train": [root], "worker": [], "helper": []}
    root_line = cmdline(root)
    stack = [(root, False)]
    while stack:
        pid, under_forkserver = stack.pop()
        for kid in children(pid):
            line = cmdline(kid)
            if "forkserver" in line and not under_forkserver:
                tree["helper"].append(kid)
                stack.append((kid, True))
            elif under_forkserver or "multiprocessing.spawn" in line or "spawn_main" in line or line == root_line:
                tree["worker"].append(kid)
                stack.append((kid, under_forkserver))
            else:
                tree["helper"].append(kid)
                stack.append((kid, False))
    return tree


class TreePeak:
    """Peaks of a process tree, fed by repeated sample() calls while it runs.

    Forkserver children still alive at the last sample are the loader workers (persistent to the
    end of training); those gone earlier, such as the child that trains the BPE, count as `other`.
    """

    def __init__(self, root: int):
        self.root = root
        self.train_kib = 0
        self.tree_kib = 0
        self.child_hwm: dict[int, int] = {}
        self.last_children: set[int] = set()

    def sample(self) -> None:
        tree = classify_tree(self.root)
        total = 0
        alive = set()
        for role, pids in tree.items():
            for pid in pids:
                s = status_kib(pid)
                if not s:
                    continue
                total += s.get("VmRSS", 0)
                if role == "train":
                    self.train_kib = max(self.train_kib, s.get("VmHWM", 0))
                elif role == "worker":
                    alive.add(pid)
                    self.child_hwm[pid] = max(self.child_hwm.get(pid, 0), s.get("VmHWM", 0))
        if alive or not self.last_children:
            self.last_children = alive
        self.tree_kib = max(self.tree_kib, total)

    @property
    def workers_seen(self) -> set[int]:
        return set(self.last_children)

    @property
    def worker_kib(self) -> int:
        return max((self.child_hwm[p] for p in self.last_children), default=0)

    @property
    def other_kib(self) -> int:
        return max((v for p, v in self.child_hwm.items() if p not in self.last_children), default=0)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {item!r}: write KEY=VALUE")
        env[key] = value
    return env


def prlmfuse_command() -> list[str]:
    return [sys.executable, "-m", "prlmfuse.cli"]


def measure_train(workdir: Path, name: str, env: dict[str, str]) -> dict:
    """One fresh `prlmfuse train` of run `name`, sampled until it exits; peaks in MB (10^6 bytes)."""
    shutil.rmtree(workdir / "runs" / name, ignore_errors=True)
    cmd = [*prlmfuse_command(), "--quiet", "train", "-p", str(workdir / "pipeline.yaml"), "--runs", name,
           "--fresh", "--device", "cpu"]
    log = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        peak = TreePeak(proc.pid)
        while proc.poll() is None:
            peak.sample()
            time.sleep(SAMPLE_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); {log}: {' | '.join(tail)}")
    return {
        "run": name, "train_mb": peak.train_kib * 1.024e-3, "worker_mb": peak.worker_kib * 1.024e-3,
        "other_mb": peak.other_kib * 1.024e-3, "tree_mb": peak.tree_kib * 1.024e-3, "workers": len(peak.workers_seen),
        "wall_s": wall,
    }


def prepare(workdir: Path, text: str, need_cache: bool, env: dict[str, str]) -> None:
    """Write the pipeline and build its corpus (and caches); both are reused when already there."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "pipeline.yaml"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    stages = ["data", "cache"] if need_cache else ["data"]
    for stage in stages:
        subprocess.run([*prlmfuse_command(), "--quiet", "run", str(path), "--only", stage, "--device", "cpu"],
                       check=True, env=env)


# ------------------------------------------------------------------------------------ phases


def phases_child(workdir: Path, name: str, every: int, updates: int) -> None:
    """train_run's phases one by one in this process, a JSON line of RSS after each (run by --phases)."""

    def mark(phase: str) -> None:
        s = status_kib(os.getpid())
        print(json.dumps({"phase": phase, "rss_mb": s["VmRSS"] * 1.024e-3, "hwm_mb": s["VmHWM"] * 1.024e-3,
                          "t": time.perf_counter() - t0}), flush=True)

    t0 = time.perf_counter()
    import prlmfuse.cli  # noqa: F401  (first, as in the command: it sets the environment torch starts with)
    import torch

    from prlmfuse.config import load_pipeline
    from prlmfuse.distributed import init_distributed
    from prlmfuse.pipeline_inputs import cache_jobs, caches_for_run, ensure_data, run_path
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import run_setup
    from prlmfuse.train_fused.bpe import BPE
    from prlmfuse.train_fused.data import PairDataset
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer

    mark("imports")
    cfg = load_pipeline(workdir / "pipeline.yaml")
    run = cfg.run(name)
    runtime = resolve_runtime("cpu", cfg.precision)
    corpus = ensure_data(cfg, build=False)
    caches = caches_for_run(run, cache_jobs(cfg, corpus), cfg)
    ctx = init_distributed(runtime.device)
    branches = run_setup.open_run_branches(run, corpus, caches)
    out = run_path(cfg, name)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mark("corpus and caches opened")
    bpe_path = out / "bpe.json"
    run_setup.train_run_bpe(run, corpus, bpe_path)
    bpe = BPE.load(bpe_path)
    mark("BPE trained")
    torch.manual_seed(run.seed)
    train_src, train_tgt = run_setup._encode_split(bpe, corpus, "train", run.max_train_pairs)
    dev_src, dev_tgt = run_setup._encode_split(bpe, corpus, "dev", None)
    mark("splits encoded")
    train_set = PairDataset(train_src, train_tgt, branches["train"])
    dev_set = PairDataset(dev_src, dev_tgt, branches["dev"])
    mark("datasets built")
    model_config = run.model_config(bpe.vocab_size, [b.spec for b in branches["train"]])
    model = FusedTransformer(model_config).to(runtime.device)
    mark("model built")
    trainer = Trainer(run, out, model, train_set, dev_set, ctx, progress=False, runtime=runtime)
    mark("trainer built")
    done = 0
    while done < updates:
        trainer.train_sampler.set_epoch(trainer.state.epoch, 0)
        for batch in trainer._on_device(trainer.train_loader):
            trainer.train_step([batch])
            done += 1
            if done in (1, 10) or done % every == 0:
                mark(f"{done} updates")
            if done >= updates:
                break
        trainer.state.epoch += 1
    trainer.dev_loss()
    mark("dev loss")


def run_phases(args, env: dict[str, str]) -> list[dict]:
    rows = []
    for system in args.systems:
        for n in args.pairs:
            name = run_name(system, n)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--phase-child", name, "--workdir", str(args.workdir),
                   "--phase-every", str(args.phase_every), "--updates", str(args.updates)]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
            for line in proc.stdout:
                if line.startswith("{"):
                    rows.append({"run": name, **json.loads(line)})
                    r = rows[-1]
                    print(f"{name}: {r['phase']}: RSS {r['rss_mb']:.0f} MB, peak {r['hwm_mb']:.0f} MB", file=sys.stderr, flush=True)
            if proc.wait() != 0:
                raise SystemExit(f"phase child {name} failed ({proc.returncode})")
    return rows


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "work" / "bench-train-memory",
                        help="pipeline, corpus, cache and runs (default work/bench-train-memory)")
    parser.add_argument("--pairs", default="10000,30000", help="training pairs per run, comma-separated (default 10000,30000)")
    parser.add_argument("--systems", default="baseline,fused", help="baseline, fused or both (default both)")
    parser.add_argument("--updates", type=int, default=300, help="updates per run (default 300)")
    parser.add_argument("--checkpoint", default="minilm-l6")
    parser.add_argument("--layer", type=int, default=-2)
    parser.add_argument("--bpe-vocab", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=1200)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers of the runs (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the trainer (default 1)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set in the trainer's environment")
    parser.add_argument("--phases", action="store_true", help="RSS after each phase of train_run instead")
    parser.add_argument("--phase-every", type=int, default=50, help="--phases: a line every this many updates")
    parser.add_argument("--phase-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase_child:
        phases_child(args.workdir, args.phase_child, args.phase_every, args.updates)
        return 0
    args.pairs = [int(x) for x in args.pairs.split(",") if x]
    args.systems = [x for x in args.systems.split(",") if x]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1", **parse_env(args.env))
    text = pipeline_text(args.systems, args.pairs, checkpoint=args.checkpoint, layer=args.layer,
                         bpe_vocab=args.bpe_vocab, max_tokens=args.max_tokens, updates=args.updates, workers=args.workers)
    prepare(args.workdir, text, "fused" in args.systems, env)
    settings = {"threads": args.threads, "updates": args.updates, "workers": args.workers, "env": parse_env(args.env)}
    if args.phases:
        rows = run_phases(args, env)
        print(f"{'run':<16} {'phase':<26} {'RSS MB':>8} {'peak MB':>8} {'s':>7}")
        for r in rows:
            print(f"{r['run']:<16} {r['phase']:<26} {r['rss_mb']:>8.0f} {r['hwm_mb']:>8.0f} {r['t']:>7.1f}")
        print("RESULT " + json.dumps({"phases": rows, **settings}))
        return 0
    rows = []
    for system in args.systems:
        for n in args.pairs:
            rows.append({"system": system, "pairs": n, **measure_train(args.workdir, run_name(system, n), env)})
            r = rows[-1]
            print(f"{r['run']:<16} train {r['train_mb']:>6.0f} MB  worker {r['worker_mb']:>6.0f} MB  "
                  f"other {r['other_mb']:>6.0f} MB  tree {r['tree_mb']:>6.0f} MB  ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    print(f"{'run':<16} {'pairs':>6} {'train MB':>9} {'worker MB':>10} {'other MB':>9} {'tree MB':>8} {'wall s':>7}")
    for r in rows:
        print(f"{r['run']:<16} {r['pairs']:>6} {r['train_mb']:>9.0f} {r['worker_mb']:>10.0f} {r['other_mb']:>9.0f} "
              f"{r['tree_mb']:>8.0f} {r['wall_s']:>7.0f}")
    for system in args.systems:
        own = [r for r in rows if r["system"] == system]
        if len(own) > 1:
            print(f"{system}: train peak at {own[-1]['pairs']} pairs / at {own[0]['pairs']} = "
                  f"{own[-1]['train_mb'] / own[0]['train_mb']:.2f}")
    print("RESULT " + json.dumps({"rows": rows, **settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
