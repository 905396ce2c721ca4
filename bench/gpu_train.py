"""bench/gpu.py's training sections: `train` (the step's systems, the loader), `shapes` (attention over new
batch shapes) and `compile` (the fused step compiled against eager)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import numpy as np
import torch

from gpu_inputs import PRLM_LAYER, cache_dir
from gpu_report import Report, free_memory, sync

ROUND_FIELDS = ("timed_s", "step_ms_median", "data_wait_fraction", "mfu")  # kept for every training round


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
    from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler

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
    from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler
    from prlmfuse.train_fused.bpe import train_bpe
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.config import PrLMSpec, PrLMUse, RunConfig
    from prlmfuse.train_fused.data import PairDataset, make_loader
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.trainer import Trainer, loader_workers

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
        # The paper's fused setting (encoder side, after the FFN), which docs/performance.md's GPU figures measure.
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

    # The shipped default (num_workers: auto) on this device, and more workers beside it.
    default_workers = loader_workers("auto", device) if not sizes.workers else sizes.workers
    systems = {
        "baseline": lambda: ([], plain, default_workers, None),
        "fused_disk": lambda: ([spec], cached, default_workers, None),
        "fused_disk_more_workers": lambda: ([spec], cached, sizes.more_workers, None),
        "fused_gpu_memory": lambda: ([spec], cached, 0, gpu_batches()),
        "fused_live_prlm": lambda: ([spec], plain, default_workers, None),
    }
    result = {"preset": sizes.preset, "max_tokens": sizes.max_tokens, "bpe_vocab": bpe.vocab_size,
              "warmup": sizes.warmup, "steps": sizes.steps, "workers": default_workers, "more_workers": sizes.more_workers,
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
    shared["step_inputs"] = {"dataset": PairDataset(src_ids, tgt_ids, [PrLMBranch(CacheReader(path, in_memory=True),
                                                                                   layer_rows=(0,), pooled_rows=None)]),
                             "spec": spec, "checkpoint": info.path, "vocab_size": bpe.vocab_size, "run_dir": run_dir}
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


def compile_with(trainer, backend: str | None) -> None:
    """The trainer's compiled forward and loss under another torch.compile backend (None: its own, inductor);
    --tiny traces with `eager`, since inductor's C++ builds take minutes on a CPU."""
    if backend is not None:
        trainer.padded_sums = torch.compile(trainer._padded_sums, backend=backend)


def compile_section(report: Report, sizes: Sizes, device: torch.device, shared: dict, train: dict) -> dict:
    if "compile_system" not in shared:
        raise RuntimeError("the training section did not get far enough to build the fused system")
    trainer, batches, tokens = shared["compile_system"]()
    compile_with(trainer, sizes.compile_backend)
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
