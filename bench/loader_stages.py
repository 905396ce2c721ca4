"""Where a loader worker's time goes under `train.read_window`, stage by stage, in one process; and the
library's way of filling a window's batches beside reading into buffers and padding after.

    python bench/loader_stages.py --dir DIR [--size-gb 6] [--windows 40] [--window 8] [--rounds 3]
                                  [--workers 2] [--seconds 10]
    python bench/loader_stages.py --cache CACHE [...]

Writes an hdf5 float16 cache of --size-gb (bench/cache_at_scale.py's synthetic BERT-base-width features
over the Bible's MiniLM lengths) into DIR, or reads CACHE as it is, and measures the raw sequential read
rate of its shard files (8 MiB reads, pages dropped). Then, --rounds times, each lane in turn (order
alternating between rounds, the cache's pages dropped before each lane) does what a DataLoader worker does
for the first --windows groups of StorageWindowBatchSampler(window --window):
  library  PairDataset.padded over each group's batches: every batch's padded tensor made first, then
           CacheReader.features_into reads each stretch of neighbouring sentences straight into the
           sentences' rows (one scatter read per stretch and layer), and the token tensors are built
  copy     the same batches with the features read into buffers first (CacheReader.features_many: one
           read per stretch) and then copied into zeroed padded tensors
and then, for either lane, the hand-over: each batch pickled by multiprocessing's ForkingPickler with
torch's reductions, as a worker's result queue does (its tensors' storages moved into shared memory: this
process is no DataLoader worker, so data.batch_tensors makes the library's tensors in private memory too).
Reported per lane: seconds and GB/s of delivered feature bytes for reading and padding, for the hand-over
and for both (median over rounds), both over the raw sequential read, and the median over rounds of
library's speed over copy's.
Then the trainer's loader itself (bench/cache_at_scale.py's time_loader: make_loader with --workers forkserver
workers, read_window --window, --seconds after the first group of windows), --rounds times with the pages
dropped before and behind each batch (cold: the disk serves every read), then --rounds times with the
whole cache in the page cache (warm: the rate the loader's CPU allows), two lanes in alternating order:
  library  a worker makes all the tensors of a work item (a window's batches) as views of one block of
           shared memory (data.batch_tensors): handing them to the trainer moves no bytes and passes
           one file descriptor
  private  the same, each tensor made on its own in the worker's own memory: copied into shared memory
           as it is sent, with a descriptor each
Reported per lane: the median feature GB/s, over the raw read, and the CPU seconds of the trainer and the
workers per second and per GB delivered; and for cold and warm the rounds' ratios of library's rate over
private's, and their median. --workers 0 skips these lanes.
DIR's cache is deleted at the end. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import time
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cache_at_scale  # noqa: E402

import torch.multiprocessing.reductions  # noqa: E402,F401  (registers the tensor reductions a worker's queue uses)

GB = 1e9


def copy_lane(dataset, branch, batches: list[list[int]]) -> list:
    """The window's features read into buffers, then copied into zeroed padded tensors (one branch, no pooled)."""
    from prlmfuse.train_fused.modeling import PrLMFeatures

    reader = branch.reader
    per_sentence = reader.features_many([i for batch in batches for i in batch], list(branch.layer_rows), widen=False)
    out, first = [], 0
    for batch in batches:
        features = per_sentence[first : first + len(batch)]
        first += len(batch)
        longest = max(f.shape[1] for f in features)
        states = torch.zeros(len(batch), len(branch.layer_rows), longest, reader.hidden_size, dtype=reader.transfer_dtype)
        mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for row, f in enumerate(features):
            states[row, :, : f.shape[1]] = f
            mask[row, : f.shape[1]] = True
        out.append(dataset.batch(batch, [PrLMFeatures(states=states, mask=mask, pooled=None)]))
    return out


def release_handed_over() -> None:
    """Close the descriptors the hand-over registered for a receiver: in a DataLoader the trainer claims each
    one, here nothing does, and without this a run of more than a few rounds runs out of descriptors."""
    sharer = resource_sharer._resource_sharer
    with sharer._lock:
        for _, close in sharer._cache.values():
            close()
        sharer._cache.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", type=Path, help="a new or empty directory to write the cache into")
    where.add_argument("--cache", type=Path, help="an existing hdf5 float16 cache to read")
    parser.add_argument("--size-gb", type=float, default=6.0)
    parser.add_argument("--windows", type=int, default=40, help="groups of windows timed")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="the loader lanes' workers (0: no loader lanes)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each loader lane's time a round")
    args = parser.parse_args(argv)

    from prlmfuse.cache_features import CacheReader
    from prlmfuse.precision import machine_line
    from prlmfuse.train_fused.batch_samplers import StorageWindowBatchSampler
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.data import PairDataset

    cache = args.cache
    if cache is None:
        if args.dir.exists() and any(args.dir.iterdir()):
            print(f"loader_stages: {args.dir} is not empty; give a new or empty directory", file=sys.stderr)
            return 2
        cache = args.dir / "cache-hdf5"
        corpus = cache_at_scale.corpus_of(int(args.size_gb * GB), "float16", cache_at_scale.real_lengths())
        cache_at_scale.write_cache(cache, corpus, "hdf5", "float16")
    try:
        reader = CacheReader(cache)
        if reader.dtype != "float16" or reader.backend != "hdf5":
            print(f"loader_stages: {cache} is a {reader.backend} {reader.dtype} cache; give an hdf5 float16 one",
                  file=sys.stderr)
            return 2
        files = cache_at_scale.shard_files(cache)
        raw = cache_at_scale.raw_sequential_read(files, 16 << 30)
        zeros = np.zeros(int(reader.lengths.max()), dtype=np.int32)
        src = [zeros[: max(int(n) - 2, 1)] for n in reader.lengths]  # as cache_at_scale's loader lanes
        branch = PrLMBranch(reader, layer_rows=(0,), pooled_rows=None)
        dataset = PairDataset(src, src, [branch])
        sampler = StorageWindowBatchSampler(dataset.src_lens, dataset.tgt_lens, args.max_tokens, reader.stored_order(),
                                            window=args.window, seed=1)
        groups = [[[int(i) for i in batch] for batch in group] for _, group in zip(range(args.windows), sampler)]
        lanes = {"library": dataset.padded, "copy": lambda batches: copy_lane(dataset, branch, batches)}
        seconds = {lane: {"read_pad": [], "hand_over": []} for lane in lanes}
        delivered = 0
        for round_ in range(args.rounds):
            for lane in (list(lanes) if round_ % 2 == 0 else list(lanes)[::-1]):
                cache_at_scale.drop_tree(cache)
                read_pad = hand_over = 0.0
                delivered = 0
                for batches in groups:
                    started = time.perf_counter()
                    padded = lanes[lane](batches)
                    read_done = time.perf_counter()
                    for batch in padded:
                        ForkingPickler(io.BytesIO()).dump(batch)
                    read_pad += read_done - started
                    hand_over += time.perf_counter() - read_done
                    release_handed_over()
                    delivered += sum(int(b.prlm[0].mask.sum()) for b in padded) * reader.hidden_size * 2
                seconds[lane]["read_pad"].append(read_pad)
                seconds[lane]["hand_over"].append(hand_over)
        # cold: pages dropped before and behind, the disk serves every read; warm: the page cache holds the
        # whole cache, so the rate is what the loader's processes' CPU allows
        page_states = ("cold", "warm") if args.workers > 0 else ()
        loader_runs = {(pages, lane): [] for pages in page_states for lane in ("library", "private")}
        lengths = SimpleNamespace(lengths=reader.lengths)
        for pages in page_states:
            if pages == "warm":
                cache_at_scale.read_files(files)
            for round_ in range(args.rounds):
                for lane in ("library", "private") if round_ % 2 == 0 else ("private", "library"):
                    loader_runs[pages, lane].append(cache_at_scale.time_loader(
                        cache, lengths, args.workers, args.seconds, args.max_tokens, seed=1, lane=lane,
                        read_window=args.window, drop_pages=pages == "cold"))
        reader.close()
    finally:
        if args.cache is None:
            shutil.rmtree(args.dir / "cache-hdf5", ignore_errors=True)
    result = {"machine": machine_line(), "cache": str(cache), "windows": len(groups), "window": args.window,
              "rounds": args.rounds, "feature_GB": round(delivered / GB, 2), "raw_sequential_read_GBps": round(raw, 3)}
    print(f"machine: {machine_line()}; {result['feature_GB']} GB of features a lane and round; raw sequential read "
          f"{result['raw_sequential_read_GBps']} GB/s")
    for lane, stages in seconds.items():
        both = [a + b for a, b in zip(stages["read_pad"], stages["hand_over"])]
        row = {f"{stage}_s": round(statistics.median(times), 2) for stage, times in stages.items()}
        row.update({f"{stage}_GBps": round(delivered / statistics.median(times) / GB, 3) for stage, times in stages.items()})
        row["all_GBps"] = round(delivered / statistics.median(both) / GB, 3)
        row["all_over_raw_read"] = round(row["all_GBps"] / raw, 2)
        result[lane] = row
        print(f"{lane:8s} read and pad {row['read_pad_GBps']:.3f} GB/s, hand-over {row['hand_over_GBps']:.3f}, "
              f"both {row['all_GBps']:.3f} ({row['all_over_raw_read']}x the raw read)")
    library = [a + b for a, b in zip(seconds["library"]["read_pad"], seconds["library"]["hand_over"])]
    copy = [a + b for a, b in zip(seconds["copy"]["read_pad"], seconds["copy"]["hand_over"])]
    result["library_over_copy"] = round(statistics.median(c / l for l, c in zip(library, copy)), 2)
    result["library_over_copy_rounds"] = [round(c / l, 2) for l, c in zip(library, copy)]
    print(f"library over copy: {result['library_over_copy']}x (median of the rounds' ratios "
          f"{result['library_over_copy_rounds']})")
    for (pages, lane), runs in loader_runs.items():
        cpu = [sum(run["cpu_seconds"].values()) / max(run["seconds"], 0.01) for run in runs]
        row = {"feature_GBps": round(statistics.median(run["feature_GBps"] for run in runs), 3),
               "cpu_seconds_per_second": round(statistics.median(cpu), 2),
               "cpu_seconds_per_GB": round(statistics.median(c / run["feature_GBps"] for c, run in zip(cpu, runs)), 2),
               "read_amplification": round(statistics.median(run["read_amplification"] for run in runs), 3)}
        row["over_raw_read"] = round(row["feature_GBps"] / raw, 2)
        result[f"loader_{pages}_{lane}"] = row
        print(f"loader, {args.workers} workers, pages {pages}, {lane:8s} {row['feature_GBps']:.3f} GB/s "
              f"({row['over_raw_read']}x the raw read), {row['cpu_seconds_per_GB']} CPU-s a GB, read amplification "
              f"{row['read_amplification']}")
    for pages in page_states:
        library, private = loader_runs[pages, "library"], loader_runs[pages, "private"]
        ratios = [a["feature_GBps"] / b["feature_GBps"] for a, b in zip(library, private)]
        result[f"loader_{pages}_library_over_private"] = round(statistics.median(ratios), 2)
        result[f"loader_{pages}_library_over_private_rounds"] = [round(r, 2) for r in ratios]
        print(f"loader, pages {pages}: library over private {result[f'loader_{pages}_library_over_private']}x "
              f"(median of the rounds' ratios {result[f'loader_{pages}_library_over_private_rounds']})")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
