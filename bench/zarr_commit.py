"""Zarr shards: the library's layout (each array one file through zarr's sharding codec, its rows streamed in)
against layout 1 (256 KB chunks, a file each), written and committed side by side.

    python bench/zarr_commit.py --dir DIR [--shards 6] [--rounds 3]

Each round writes --shards shards of 64 MB of float16 features (random values, BERT-base width 768, appends of
a GPU batch's rows) once per lane, the lanes in turn:
  library       cache_features.shards.ZarrShardWriter: one shard file an array, rows written as they come,
                the padding and the shard index appended at commit, then fsync and rename
  chunk_files   bench/zarr_chunk_files.py's ChunkFilesWriter: rows buffered into 256 KB chunks, each flush's
                chunks handed to zarr's store together (Store.set), every chunk file fsynced at commit
Reported: each lane's GB/s of appends and commit together and of its appends alone (into the page cache,
before the commit), median over rounds, and library's ratio to chunk_files in each round (median, appends
and commit together). The directory is emptied at the end. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

SHARD_BYTES = 64 << 20
WIDTH = 768
ROWS_PER_APPEND = 4096  # a GPU batch's real tokens, about


def lanes() -> dict:
    from prlmfuse.cache_features.shards import ZarrShardWriter

    from zarr_chunk_files import ChunkFilesWriter

    return {"library": ZarrShardWriter, "chunk_files": ChunkFilesWriter}


def write_shards(writer_class, directory: Path, shards: int, values: np.ndarray) -> tuple[float, float]:
    """Seconds to write and commit `shards` shards of `values` rows through `writer_class`, and of those the
    seconds spent in appends (the rest is the commits)."""
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shards import ArraySpec

    location = Location(directory)
    specs = {"layer_010": ArraySpec((len(values), WIDTH), np.dtype(np.float16))}
    start, appending = time.perf_counter(), 0.0
    for index in range(shards):
        began = time.perf_counter()
        writer = writer_class(location, f"shards/shard-{index:05d}.zarr", specs)
        for row in range(0, len(values), ROWS_PER_APPEND):
            writer.append("layer_010", values[row : row + ROWS_PER_APPEND])
        appending += time.perf_counter() - began
        writer.commit()
    return time.perf_counter() - start, appending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="a new or empty directory on the disk to measure")
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.dir.exists() and any(args.dir.iterdir()):
        sys.exit(f"zarr_commit.py: {args.dir} is not empty; give a new or empty directory")
    from prlmfuse.precision import machine_line

    values = np.random.default_rng(0).standard_normal((SHARD_BYTES // (2 * WIDTH), WIDTH)).astype(np.float16)
    nbytes = args.shards * values.nbytes
    classes = lanes()
    rates: dict[str, list[float]] = {name: [] for name in classes}
    append_rates: dict[str, list[float]] = {name: [] for name in classes}
    try:
        for r in range(args.rounds):
            for name, writer_class in classes.items():
                target = args.dir / f"{name}-{r}"
                seconds, appending = write_shards(writer_class, target, args.shards, values)
                rates[name].append(nbytes / seconds / 1e9)
                append_rates[name].append(nbytes / appending / 1e9)
                shutil.rmtree(target)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rates.items()) + " GB/s", file=sys.stderr)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    result = {"machine": machine_line("cpu"), "shards": args.shards, "GB_per_lane": round(nbytes / 1e9, 2),
              "rounds": args.rounds}
    for name, values_ in rates.items():
        result[f"{name}_GBps"] = round(float(np.median(values_)), 3)
        result[f"{name}_appends_GBps"] = round(float(np.median(append_rates[name])), 3)
        if name != "library":
            ratios = [b / a for a, b in zip(values_, rates["library"])]
            result[f"library_over_{name}"] = round(float(np.median(ratios)), 3)
            result[f"library_over_{name}_rounds"] = [round(x, 3) for x in ratios]
        print(f"{name:10s} {result[f'{name}_GBps']:.3f} GB/s, appends alone {result[f'{name}_appends_GBps']:.3f} "
              f"(median of {args.rounds})")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
