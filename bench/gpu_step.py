"""bench/gpu.py's `step` section: the fused training step as the GPU path runs it against today's eager step.

For each (preset, max_tokens) of the sizes (on a GPU: `base` at 16k-token batches, `small` at 1,200 and
4,096), the fused step from features already on the device, three systems over the batches of one epoch's
first stretch, each system its own batches (their shapes are what tells the systems apart):

  eager            today's step: token-budget batches padded to their longest sentence, only the scored
                   positions reach the output projection (boolean mask, `nonzero`)
  static_eager     static_shapes batches (train_fused.buckets), the loss over the padded batch with padding masked
  static_compiled  the same, `compile: true`: forward and loss compiled (on CUDA in reduce-overhead mode, each
                   shape captured once as a CUDA graph and replayed)

The warm-up is a "first epoch": one step on a batch of every shape the timed steps will see (so compiling
and capturing happen there); the timed steps then go over the batches again. Per system: median step time,
real target tokens/s, MFU over the real tokens (6 x parameters x the tokens they act on, against the matmul
peak measured in the same process), torch._dynamo's graphs compiled during the timed steps (a recompile),
and for one more step under torch.profiler: the ops it dispatched (`aten::` events: the CPU-side proxy for
kernel launches), the host's time to issue the step, and on CUDA the kernels' own time on the GPU.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def profile_step(trainer, batch, device: torch.device) -> dict:
    """One more step under torch.profiler: ops dispatched, the host's seconds to issue it, the GPU's kernel time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.train_step([batch])
        issued = time.perf_counter() - start  # on CUDA the kernels may still run: this is the host's part
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    aten = sum(1 for e in events if e.name.startswith("aten::"))
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    graph_launches = sum(1 for e in events if e.name == "cudaGraphLaunch")
    gpu_us = sum(e.self_device_time_total for e in events if getattr(e, "device_type", None) is not None
                 and "CUDA" in str(e.device_type)) if device.type == "cuda" else None
    return {"aten_ops": aten, "kernel_launches": launches if device.type == "cuda" else None,
            "graph_launches": graph_launches if device.type == "cuda" else None, "host_ms": issued * 1000,
            "gpu_kernel_ms": None if gpu_us is None else gpu_us / 1000}


def time_one(trainer, warm, timed, flops, device: torch.device, peak_flops: float) -> dict:
    """Warm-up steps (every shape once), then the timed ones, each synchronised; dynamo's graphs counted around them."""
    for batch in warm:
        trainer.train_step([batch])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    graphs = _graphs()
    seconds = []
    for batch in timed:
        start = time.perf_counter()
        trainer.train_step([batch])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    total = float(np.sum(seconds))
    out = {"warmup_steps": len(warm), "steps": len(timed), "step_ms_median": float(np.median(seconds)) * 1000,
           "timed_s": total, "target_tokens_per_s": sum(b.ntokens for b in timed) / total,
           "mfu": sum(flops) / total / peak_flops, "graphs_compiled_while_timed": _graphs() - graphs,
           "shapes": len({(tuple(b.src_tokens.shape), tuple(b.tgt_in.shape)) for b in timed})}
    out["profiled"] = profile_step(trainer, timed[0], device)
    return out


def step_section(report, sizes, device: torch.device, shared: dict) -> dict:
    if "step_inputs" not in shared:
        raise RuntimeError("the training section did not get far enough to build the fused inputs")
    from gpu_report import free_memory
    from gpu_train import compile_with, step_flops
    from prlmfuse.distributed import DistContext
    from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler
    from prlmfuse.train_fused.bpe import PAD_ID
    from prlmfuse.train_fused.buckets import BatchShapes, BucketBatchSampler, prlm_lengths
    from prlmfuse.train_fused.config import PrLMUse, RunConfig
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer

    inputs = shared["step_inputs"]
    dataset, spec, vocab, run_dir = inputs["dataset"], inputs["spec"], inputs["vocab_size"], inputs["run_dir"]
    runtime, peak = shared["runtime"], shared["peak_flops"]
    result = {"configs": {}}
    for preset, max_tokens in sizes.step_configs:
        key = f"{preset}_{max_tokens}"
        shapes = BatchShapes.fit(dataset.src_lens, dataset.tgt_lens, prlm_lengths(dataset), max_tokens)
        orders = {
            "eager": TokenBudgetBatchSampler(dataset.src_lens, dataset.tgt_lens, max_tokens, seed=1),
            "static": BucketBatchSampler(dataset.src_lens, dataset.tgt_lens, shapes, prlm_lens=prlm_lengths(dataset),
                                         seed=1),
        }
        config = {"preset": preset, "max_tokens": max_tokens, "systems": {},
                  "static_shapes": {"target_ratio": shapes.target_ratio, "prlm_ratio": shapes.prlm_ratio}}
        for name, static, compiled in (("eager", False, False), ("static_eager", True, False),
                                       ("static_compiled", True, True)):
            trainer = None
            try:
                sampler = orders["static" if static else "eager"]
                picked = [sampler.batches[b] for b in sampler.epoch_order(0)][: sizes.step_steps]
                dataset.shapes = shapes if static else None
                timed = [dataset.__getitems__(b).to(device) for b in picked]
                first_of_shape = {}
                for batch in timed:
                    first_of_shape.setdefault((tuple(batch.src_tokens.shape), tuple(batch.tgt_in.shape)), batch)
                # Compiled: each shape twice (CUDA graph trees run a new shape once before capturing it).
                warm = list(first_of_shape.values()) * (2 if compiled else 1) if static else timed[: sizes.warmup]
                run = RunConfig(name="bench", preset=preset, prlms=[PrLMUse(inputs["checkpoint"], -2)], side="source",
                                position="ffn", max_tokens=max_tokens, max_updates=10**6, num_workers=0,
                                static_shapes=static, compile=compiled)
                torch.manual_seed(1)
                model = FusedTransformer(run.model_config(vocab, [spec]))
                trainer = Trainer(run, run_dir, model, dataset, dataset, DistContext(), progress=False, runtime=runtime)
                if compiled:
                    compile_with(trainer, sizes.compile_backend)
                flops = [step_flops(trainer.model, int((b.src_tokens != PAD_ID).sum()), b.ntokens) for b in timed]
                start = time.perf_counter()
                measured = time_one(trainer, warm, timed, flops, device, peak)
                measured["wall_s"] = time.perf_counter() - start
                config["systems"][name] = measured
                p = measured["profiled"]
                report.print(f"   {key:12s} {name:16s} {measured['step_ms_median']:8.1f} ms/step, "
                             f"MFU {measured['mfu']:6.1%}, {measured['shapes']} shapes, "
                             f"{p['aten_ops']} aten ops/step, host {p['host_ms']:.1f} ms"
                             + (f", GPU kernels {p['gpu_kernel_ms']:.1f} ms" if p["gpu_kernel_ms"] is not None else "")
                             + f", recompiled {measured['graphs_compiled_while_timed']}, {measured['wall_s']:.0f} s in all")
            except Exception as e:  # noqa: BLE001 - the other systems still run
                config["systems"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                report.print(f"   {key} {name} FAILED: {config['systems'][name]['error']}")
            finally:
                dataset.shapes = None
                del trainer
                free_memory(device)
        systems = config["systems"]
        if all("step_ms_median" in systems.get(n, {}) for n in ("eager", "static_compiled")):
            # The systems train other batches (their shapes are the difference): compared by real tokens/s.
            config["compiled_over_eager"] = (systems["static_compiled"]["target_tokens_per_s"]
                                             / systems["eager"]["target_tokens_per_s"])
            config["ops_eager_over_compiled"] = (systems["eager"]["profiled"]["aten_ops"]
                                                 / max(1, systems["static_compiled"]["profiled"]["aten_ops"]))
            report.print(f"   {key:12s} static_compiled / eager: {config['compiled_over_eager']:.2f}x target tokens/s, "
                         f"{config['ops_eager_over_compiled']:.1f}x fewer aten ops per step")
        result["configs"][key] = config
    return result
