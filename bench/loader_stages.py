"""Where a loader worker's time goes under `train.read_window`, stage by stage, in one process.

    python bench/loader_stages.py --dir DIR [--size-gb 6] [--windows 40] [--window 8] [--max-tokens 4096]
    python bench/loader_stages.py --cache CACHE [...]

Writes an hdf5 float16 cache of --size-gb (bench/cache_at_scale.py's synthetic BERT-base-width features
over the Bible's MiniLM lengths) into DIR, or reads CACHE as it is; drops its pages from the page cache,
measures the raw sequential read rate of its shard files (8 MiB reads), drops them again, then does what a
DataLoader worker does for each of the first --windows groups of StorageWindowBatchSampler(window
--window), timing each stage:
  read       read_features over the group's sentences (CacheReader.features_many: a few large preadv)
  pad        PairDataset.padded for each batch of the group (features right-padded, token tensors built)
  hand_over  each batch pickled by multiprocessing's ForkingPickler with torch's reductions, as a worker's
             result queue does: its tensors' storages are moved into shared memory
Reported: seconds and GB/s of delivered feature bytes per stage and for all three, and their rate over
the raw sequential read. DIR's cache is deleted at the end. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cache_at_scale  # noqa: E402

import torch.multiprocessing.reductions  # noqa: E402,F401  (registers the tensor reductions a worker's queue uses)

GB = 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", type=Path, help="a new or empty directory to write the cache into")
    where.add_argument("--cache", type=Path, help="an existing hdf5 float16 cache to read")
    parser.add_argument("--size-gb", type=float, default=6.0)
    parser.add_argument("--windows", type=int, default=40, help="groups of windows timed")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args(argv)

    from prlmfuse.cache_features import CacheReader
    from prlmfuse.precision import machine_line
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.data import PairDataset, StorageWindowBatchSampler, read_features

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
        groups = [group for _, group in zip(range(args.windows), sampler)]
        cache_at_scale.drop_tree(cache)
        seconds = {"read": 0.0, "pad": 0.0, "hand_over": 0.0}
        delivered = 0
        for batches in groups:
            sentences = [int(i) for batch in batches for i in batch]
            started = time.perf_counter()
            per_sentence, _ = read_features(branch, sentences)
            read_done = time.perf_counter()
            padded, first = [], 0
            for batch in batches:
                padded.append(dataset.padded([int(i) for i in batch], [(per_sentence[first : first + len(batch)], None)]))
                first += len(batch)
            pad_done = time.perf_counter()
            for batch in padded:
                ForkingPickler(io.BytesIO()).dump(batch)
            seconds["read"] += read_done - started
            seconds["pad"] += pad_done - read_done
            seconds["hand_over"] += time.perf_counter() - pad_done
            delivered += sum(int(b.prlm[0].mask.sum()) for b in padded) * reader.hidden_size * 2
        reader.close()
    finally:
        if args.cache is None:
            shutil.rmtree(args.dir / "cache-hdf5", ignore_errors=True)
    total = sum(seconds.values())
    result = {"machine": machine_line(), "cache": str(cache), "windows": len(groups), "window": args.window,
              "feature_GB": round(delivered / GB, 2), "raw_sequential_read_GBps": round(raw, 3),
              "seconds": {k: round(v, 2) for k, v in seconds.items()},
              "GBps": {k: round(delivered / v / GB, 3) for k, v in seconds.items()},
              "all_GBps": round(delivered / total / GB, 3), "all_over_raw_read": round(delivered / total / GB / raw, 2)}
    print(f"machine: {machine_line()}")
    for stage in seconds:
        print(f"{stage:10s} {result['seconds'][stage]:6.2f} s  {result['GBps'][stage]:.3f} GB/s")
    print(f"all        {total:6.2f} s  {result['all_GBps']:.3f} GB/s = {result['all_over_raw_read']}x the raw "
          f"sequential read ({result['raw_sequential_read_GBps']} GB/s)")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
