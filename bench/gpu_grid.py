"""bench/gpu.py's `grid` section: K runs of the `small` fused model training at once on one device.

Several runs share a GPU as `train.jobs` trains them: one process each. Here K = 1, 8, 2, 4 (one and
eight first, so that a section stopped by the time budget still has the two ends) child processes each
train the fused `small` model on the same BPE'd pairs and in-memory features as the GPU path does
(static_shapes, compile), every child from its own seed. Each child first warms up (one step on every
batch shape, twice: compiling and capturing happen there; inductor's cache on disk is shared, so only
the first child compiles from scratch), says it is ready, waits until all K are, then times
`grid_updates` updates and prints its updates/s with the start and end of its timed window. A
reference child trains today's eager step (token-budget batches, no compile) alone.

Per K: the sum of the children's updates/s, the sum over the eager reference, and how much of the
timed windows overlapped (a sum means something only where the children ran at the same time).

Run as a child: python bench/gpu_grid.py --child INPUTS.npz --device D --seed S --updates N --go FILE [--eager]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def save_inputs(path: Path, inputs: dict) -> Path:
    """The BPE'd pairs and the cache a child reads, as one npz (the pairs) beside the cache's path."""
    dataset = inputs["dataset"]
    offsets = lambda ids: np.cumsum([0] + [len(x) for x in ids])  # noqa: E731
    np.savez(path, src=np.concatenate(dataset.src_ids), src_offsets=offsets(dataset.src_ids),
             tgt=np.concatenate(dataset.tgt_ids), tgt_offsets=offsets(dataset.tgt_ids),
             cache=str(dataset.branches[0].reader.path), checkpoint=inputs["checkpoint"],
             vocab_size=inputs["vocab_size"], spec=json.dumps(inputs["spec"].__dict__))
    return path


def child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--go", required=True)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--compile-backend")
    args = parser.parse_args(argv)

    import tempfile

    import torch

    from gpu_train import compile_with
    from prlmfuse.cache_features import CacheReader
    from prlmfuse.distributed import DistContext
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.config import PrLMSpec, PrLMUse, RunConfig
    from prlmfuse.train_fused.data import PairDataset
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer

    saved = np.load(args.child)
    split = lambda flat, offsets: [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]  # noqa: E731
    branch = PrLMBranch(CacheReader(str(saved["cache"]), in_memory=True), layer_rows=(0,), pooled_rows=None)
    dataset = PairDataset(split(saved["src"], saved["src_offsets"]), split(saved["tgt"], saved["tgt_offsets"]), [branch])
    spec = PrLMSpec(**json.loads(str(saved["spec"])))
    runtime = resolve_runtime(args.device)
    if runtime.device.type == "cpu":
        torch.set_num_threads(1)  # K runs on a CPU share its cores, as train.jobs gives each its share
    static = not args.eager
    run = RunConfig(name=f"grid-{args.seed}", preset=args.preset, prlms=[PrLMUse(str(saved["checkpoint"]), -2)],
                    max_tokens=args.max_tokens, max_updates=10**6, num_workers=0, seed=args.seed,
                    static_shapes=static, compile=static)
    torch.manual_seed(args.seed)
    model = FusedTransformer(run.model_config(int(saved["vocab_size"]), [spec]))
    with tempfile.TemporaryDirectory(prefix="gpu-grid-") as run_dir:
        trainer = Trainer(run, Path(run_dir), model, dataset, dataset, DistContext(), progress=False, runtime=runtime)
        if static:
            compile_with(trainer, args.compile_backend)
        sampler = trainer.train_sampler
        order = [sampler.batches[b] for b in sampler.epoch_order(0)]
        batches = [dataset.__getitems__(b).to(runtime.device) for b in order[: args.updates]]
        first_of_shape = {}
        for b in batches:
            first_of_shape.setdefault((tuple(b.src_tokens.shape), tuple(b.tgt_in.shape)), b)
        warm = list(first_of_shape.values()) * 2 if static else batches[:2]
        started = time.perf_counter()
        for b in warm:
            trainer.train_step([b])
        sync = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda *a: None)
        sync()
        warmup_s = time.perf_counter() - started
        print("READY", flush=True)
        while not Path(args.go).exists():
            time.sleep(0.005)
        start = time.time()
        for b in batches:
            trainer.train_step([b])
        sync()
        end = time.time()
    print("RESULT " + json.dumps({"updates": len(batches), "updates_per_s": len(batches) / (end - start),
                                  "start": start, "end": end, "warmup_s": warmup_s, "shapes": len(first_of_shape)}),
          flush=True)


def run_children(k: int, inputs: Path, sizes, device, scratch: Path, *, eager: bool = False) -> list[dict]:
    """K children started together; each times its updates once all K are warm. Returns their RESULTs."""
    go = scratch / f"go-{k}-{'eager' if eager else 'static'}"
    go.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(inputs), "--device", str(device),
           "--updates", str(sizes.grid_updates), "--max-tokens", str(sizes.grid_max_tokens),
           "--preset", sizes.grid_preset, "--go", str(go)]
    cmd += ["--eager"] if eager else []
    cmd += ["--compile-backend", sizes.compile_backend] if sizes.compile_backend and not eager else []
    children = [subprocess.Popen(cmd + ["--seed", str(i + 1)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for i in range(k)]
    try:
        for c in children:  # each says READY once warm (or ends, having failed)
            for line in c.stdout:
                if line.startswith("READY"):
                    break
        go.touch()
        results = []
        for c in children:
            output = c.stdout.read()
            c.wait(timeout=sizes.subprocess_timeout_s)
            found = [line for line in output.splitlines() if line.startswith("RESULT ")]
            if c.returncode != 0 or not found:
                raise RuntimeError(f"a grid child exited {c.returncode}: {output.strip().splitlines()[-1:]}")
            results.append(json.loads(found[-1].removeprefix("RESULT ")))
        return results
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()


def overlap(results: list[dict]) -> float:
    """The share of the children's timed windows during which all of them ran."""
    together = min(r["end"] for r in results) - max(r["start"] for r in results)
    longest = max(r["end"] - r["start"] for r in results)
    return max(0.0, together) / longest if longest > 0 else 0.0


def grid_section(report, sizes, device, scratch: Path, shared: dict) -> dict:
    if "step_inputs" not in shared:
        raise RuntimeError("the training section did not get far enough to build the fused inputs")
    inputs = save_inputs(scratch / "grid-inputs.npz", shared["step_inputs"])
    result = {"preset": sizes.grid_preset, "max_tokens": sizes.grid_max_tokens, "updates": sizes.grid_updates,
              "runs": {}}
    eager = run_children(1, inputs, sizes, device, scratch, eager=True)
    result["eager_one_updates_per_s"] = eager[0]["updates_per_s"]
    report.print(f"   eager, one run: {eager[0]['updates_per_s']:.1f} updates/s")
    for k in sizes.grid_ks:
        try:
            children = run_children(k, inputs, sizes, device, scratch)
        except Exception as e:  # noqa: BLE001 - the other K still run
            result["runs"][str(k)] = {"error": f"{type(e).__name__}: {e}"}
            report.print(f"   K={k} FAILED: {result['runs'][str(k)]['error']}")
            continue
        total = sum(c["updates_per_s"] for c in children)
        result["runs"][str(k)] = {"updates_per_s_sum": total, "over_eager_one": total / result["eager_one_updates_per_s"],
                                  "overlap": overlap(children), "children": children}
        report.print(f"   K={k}: {total:.1f} updates/s in all ({total / result['eager_one_updates_per_s']:.2f}x one eager "
                     f"run), timed windows overlapping {overlap(children):.0%}, warm-up "
                     f"{max(c['warmup_s'] for c in children):.0f} s")
    best = max((r for r in result["runs"].values() if "updates_per_s_sum" in r), default=None,
               key=lambda r: r["updates_per_s_sum"])
    result["best_over_eager_one"] = None if best is None else best["over_eager_one"]
    # The target's ratio: the most runs at once against one run of the same (compiled) kind, K=1.
    counts = sorted(int(k) for k, r in result["runs"].items() if "updates_per_s_sum" in r)
    if len(counts) > 1 and counts[0] == 1:
        result["most_over_one"] = {"k": counts[-1], "ratio": result["runs"][str(counts[-1])]["updates_per_s_sum"]
                                   / result["runs"]["1"]["updates_per_s_sum"]}
    return result


if __name__ == "__main__":
    child(sys.argv[1:])
