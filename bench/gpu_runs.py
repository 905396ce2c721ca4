"""bench/gpu.py's `decode` (beam search, fused against baseline) and `torchrun` (one rank's group) sections.

The torchrun child: python bench/gpu_runs.py --torchrun-child --device D
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from gpu_inputs import run_child
from gpu_report import Report, free_memory


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


def torchrun_section(report: Report, sizes: Sizes, device: torch.device, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve()), "--torchrun-child", "--device", str(device)]
    start = time.perf_counter()
    output, rc = run_child(cmd, sizes.subprocess_timeout_s)
    wall = time.perf_counter() - start
    report.log_file.write(output[-6000:] + "\n")
    child = next((json.loads(line.removeprefix("RESULT ")) for line in reversed(output.splitlines())
                  if line.startswith("RESULT ")), None)
    ok = rc == 0 and child is not None and child.get("updates") == 2
    report.print(f"   torchrun --nproc-per-node 1: {'ok' if ok else 'FAILED'} (exit {rc}, {wall:.1f} s"
                 + (f", {child['backend']} group, losses {child['losses']}" if child else "") + ")")
    return {"command": "torchrun --standalone --nproc-per-node 1 bench/gpu_runs.py --torchrun-child", "ok": ok,
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
            losses.append(round(float(loss) / ntokens, 4))
    dist.barrier()
    backend = dist.get_backend()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"backend": backend, "rank": ctx.rank, "world_size": ctx.world_size,
                                  "device": str(runtime.device), "updates": trainer.state.update, "losses": losses,
                                  "join_s": round(joined, 2), "seconds": round(time.perf_counter() - start, 2)}),
          flush=True)


if __name__ == "__main__":
    torchrun_child(sys.argv[sys.argv.index("--device") + 1])
