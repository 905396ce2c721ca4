"""Whether this machine trains a run exactly as the machine that trained it: replay the run's last stretch.

    python bench/replay_run.py RUN_DIR [--from UPDATE] [--threads 1]

Copies RUN_DIR's run.json, bpe.json and its checkpoints up to UPDATE (default: the second newest one
kept) to a scratch directory, resumes training there with the run's own settings, corpus and caches
up to the run's newest checkpoint, and compares the two checkpoints' weights tensor by tensor. Equal
weights say that this machine and this code reproduce the run's arithmetic, so runs trained here may
be compared with it (a Table 3 batch beside an earlier batch's baseline, say). --threads: torch's
intra-op threads, as `prlmfuse run` gives each of JOBS runs (cores / JOBS): thread counts can change
the order of a sum. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--from", dest="start", type=int, help="the checkpoint to resume from (default: second newest)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    from prlmfuse.corpora.corpus import load_corpus
    from prlmfuse.precision import machine_line
    from prlmfuse.train_fused import run_dir as rundir
    from prlmfuse.train_fused.config import RunConfig
    from prlmfuse.train_fused.run_setup import train_run

    info = rundir.read_run_info(args.run_dir)
    kept = rundir.complete_checkpoints(args.run_dir)
    if len(kept) < 2:
        print(f"replay_run: {args.run_dir} keeps {len(kept)} complete checkpoint(s); it needs two", file=sys.stderr)
        return 2
    end = kept[-1]
    start = args.start if args.start is not None else kept[-2]
    if start not in kept[:-1]:
        print(f"replay_run: no complete checkpoint at update {start} before {end} in {args.run_dir}; kept: {kept}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    run = RunConfig.from_dict(dict(info["train"], max_updates=end))
    corpus = load_corpus(info["corpus"]["root"])
    caches = [{split: record["path"] for split, record in prlm["caches"].items()} for prlm in info["prlms"]]
    with tempfile.TemporaryDirectory(prefix="prlmfuse-replay-") as scratch:
        replay = Path(scratch) / args.run_dir.name
        (replay / rundir.CHECKPOINT_DIR).mkdir(parents=True)
        for name in (rundir.RUN_JSON, rundir.BPE_JSON):
            shutil.copy2(args.run_dir / name, replay / name)
        for path in (rundir.weights_path, rundir.optimizer_path, rundir.state_path):
            shutil.copy2(path(args.run_dir, start), path(replay, start))
        shutil.copy2(rundir.state_path(args.run_dir, start), replay / rundir.TRAINER_STATE)
        started = time.perf_counter()
        train_run(run, corpus, caches, replay, resume=True, progress=False)
        seconds = time.perf_counter() - started
        ours = load_file(rundir.weights_path(replay, end))
    theirs = load_file(rundir.weights_path(args.run_dir, end))
    differing = sorted(name for name in theirs if name not in ours or not torch.equal(ours[name], theirs[name]))
    largest = max((float((ours[n] - theirs[n]).abs().max()) for n in differing if n in ours), default=0.0)
    result = {"run": str(args.run_dir), "from": start, "to": end, "threads": args.threads, "tensors": len(theirs),
              "differing": len(differing), "max_abs_difference": largest, "seconds": round(seconds, 1),
              "machine": machine_line()}
    verdict = "identical" if not differing else f"{len(differing)} of {len(theirs)} tensors differ (max {largest:.3g})"
    print(f"replayed updates {start}..{end} of {args.run_dir}: weights {verdict}")
    print("RESULT " + json.dumps(result))
    return 0 if not differing else 1


if __name__ == "__main__":
    sys.exit(main())
