"""bench/gpu.py's `cache` section: stage one's cache build against a naive loop, a bare forward pass and the raw write
rate of the disk it writes to.

Per PrLM: the naive loop once; then `cache_rounds` rounds of the bare forward and a build in the run's backend at
float16 (the rate the targets read, best round); then one build of every backend and storage dtype (VARIANTS), each
against the best bare forward and the raw write measured at the section's start. A build's rate is its marginal
rate: a small build first, whose time (model load, hashing, setup) is taken off the full build's.
"""

from __future__ import annotations

import shutil
import time
import traceback
from pathlib import Path

import torch

from gpu_inputs import PRLM_LAYER
from gpu_report import Report, free_memory, sync

VARIANTS = tuple((backend, dtype) for backend in ("hdf5", "zarr") for dtype in ("float16", "int8"))


def timed_build(checkpoint: str, small: Path, corpus: Path, out: Path, backend: str, dtype: str,
                device: torch.device) -> dict:
    """A small build, then the full one into `out` (kept): seconds, tokens and stored shard bytes of each, and the
    full build's marginal rates over the small one's."""
    from prlmfuse.cache_features import build_cache
    from prlmfuse.cache_features.location import Location

    timed = {}
    for label, file, target in (("small", small, out.with_name(out.name + "-small")), ("full", corpus, out)):
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        result = build_cache(checkpoint, file, target, backend=backend, dtype=dtype, device=str(device), progress=False)
        timed[label] = (time.perf_counter() - start, int(result.manifest["num_tokens"]), Location(target).size("shards"))
    shutil.rmtree(out.with_name(out.name + "-small"), ignore_errors=True)
    (t_small, n_small, b_small), (t_full, n_full, b_full) = timed["small"], timed["full"]
    marginal = t_full > t_small
    return {"build_s": t_full, "build_tokens": n_full, "stored_bytes": b_full, "small_build_s": t_small,
            "small_build_tokens": n_small,
            "build_marginal_tokens_per_s": (n_full - n_small) / (t_full - t_small) if marginal else None,
            # stored bytes a second at the margin (end to end where the small build took as long)
            "store_GBps": ((b_full - b_small) / (t_full - t_small) if marginal else b_full / t_full) / 1e9}


def cache_one(report: Report, sizes: Sizes, device: torch.device, scratch: Path, shared: dict, name: str) -> dict:
    from cache_throughput import bare_forward, naive_loop, write_corpus
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
        # (c) a small build, then the full one, in the run's backend at float16
        built = timed_build(checkpoint, small, corpus, work / f"round-{r}", shared["backend"], "float16", device)
        if r < sizes.cache_rounds - 1:
            shutil.rmtree(work / f"round-{r}", ignore_errors=True)
        marginal = built["build_marginal_tokens_per_s"]
        rounds.append({"bare_s": seconds_b, "bare_tokens": tokens_b, **built})
        report.print(f"   {name} round {r + 1}: (b) {tokens_b / seconds_b:,.0f} tokens/s; (c) "
                     f"{built['build_tokens'] / built['build_s']:,.0f} tokens/s end to end, {marginal or float('nan'):,.0f} "
                     f"at the margin (small build {built['small_build_s']:.2f} s)")

    rate_a = tokens_a / seconds_a
    rate_b = max(r["bare_tokens"] / r["bare_s"] for r in rounds)
    rate_c_e2e = max(r["build_tokens"] / r["build_s"] for r in rounds)
    marginal = [r["build_marginal_tokens_per_s"] for r in rounds if r["build_marginal_tokens_per_s"]]
    # Where the small build took as long as the full one (noise at toy sizes), the end-to-end rate stands in.
    rate_c = max(marginal) if marginal else rate_c_e2e
    report.print(f"   {name}: (a) naive {rate_a:,.0f}  (b) bare {rate_b:,.0f}  (c) build_cache {rate_c:,.0f} tokens/s "
                 f"-> c/a {rate_c / rate_a:.2f}, c/b {rate_c / rate_b:.3f}")
    variants = {}
    for backend, dtype in VARIANTS:  # every backend and storage dtype, one build each
        try:
            built = timed_build(checkpoint, small, corpus, work / f"{backend}-{dtype}", backend, dtype, device)
        except Exception as e:  # noqa: BLE001 - e.g. a node without zarr: the other builds and the rounds still count
            variants[f"{backend}-{dtype}"] = {"error": f"{type(e).__name__}: {e}"}
            report.print(f"   {name} {backend} {dtype} FAILED: {variants[f'{backend}-{dtype}']['error']}")
            report.log_file.write(traceback.format_exc() + "\n")
            continue
        finally:
            shutil.rmtree(work / f"{backend}-{dtype}", ignore_errors=True)
        rate = built["build_marginal_tokens_per_s"] or built["build_tokens"] / built["build_s"]
        variants[f"{backend}-{dtype}"] = {
            **built, "build_tokens_per_s": rate, "build_over_bare": rate / rate_b,
            "build_over_raw_write": built["store_GBps"] / shared["raw_write_GBps"] if shared.get("raw_write_GBps") else None,
        }
        report.print(f"   {name} {backend} {dtype}: {rate:,.0f} tokens/s, c/b {rate / rate_b:.3f}; "
                     f"{built['store_GBps']:.3f} GB/s stored")
    return {
        "checkpoint": checkpoint, "layers": info.num_layers, "hidden_size": info.hidden_size,
        "sentences": len(lines), "naive_sentences": len(lines[:: sizes.naive_every]),
        "naive_tokens_per_s": rate_a, "bare_tokens_per_s": rate_b,
        "build_tokens_per_s": rate_c, "build_rate_is_marginal": bool(marginal),
        "build_tokens_per_s_end_to_end": rate_c_e2e,
        "build_over_naive": rate_c / rate_a, "build_over_bare": rate_c / rate_b, "rounds": rounds,
        "variants": variants,
    }


def cache_section(report, sizes, device, scratch, shared) -> dict:
    from cache_at_scale import raw_write

    # the disk the caches go to, plain 8 MiB writes into 64 MiB files each fsynced, as cache_at_scale.py measures it
    shared["raw_write_GBps"] = raw_write(scratch / "raw-write", sizes.raw_write_bytes)
    report.print(f"   raw write: {shared['raw_write_GBps']:.3f} GB/s")
    result = {"backend": shared["backend"], "dtype": "float16", "layer": PRLM_LAYER,
              "raw_write_GBps": shared["raw_write_GBps"]}
    for name in shared["prlms"]:
        try:
            result[name] = cache_one(report, sizes, device, scratch, shared, name)
        except Exception as e:  # noqa: BLE001 - the other PrLM still runs
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            report.print(f"   {name} FAILED: {result[name]['error']}")
            report.log_file.write(traceback.format_exc() + "\n")
    return result
