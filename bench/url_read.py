"""Reading a zarr cache at an fsspec URL: one ranged read a stretch (the library) against zarr's array API.

    python bench/url_read.py [--checkpoint minilm-l6] [--sentences 4000] [--rounds 5]

A cache of --sentences Bible verses (zarr, float16, layer -2) is built on local disk, then read at its file://
URL, through fsspec's local filesystem: what differs between the lanes is the work and the number of reads per
sentence, not a network. Each lane reads as a training DataLoader worker does: every sentence once in shuffled
order, 64 at a time (cache_throughput.read_all, fresh reader, the page cache warm). Lanes, in turn each round,
their order alternating between rounds:
  library   the reader as shipped: a shard's arrays opened once (size and index read, crc32c checked), then
            each stretch of neighbouring sentences one ranged read (fs.cat_file) of its array's shard file
  zarr_api  the same reader with the layout-2 check turned off at URLs (shard_handle._back_to_back patched to None
            there), so every read goes through zarr's array API, which reads the shard's index and then
            each inner chunk the rows touch
Reported: sentences/s (median of the rounds), the median of the rounds' library/zarr_api ratios, and the files
each lane opens per sentence over one pass (LocalFileSystem._open calls: on an object store, a request each).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_throughput import bible_sentences, read_all, write_corpus  # noqa: E402


@contextlib.contextmanager
def zarr_api_at_urls():
    """The zarr_api lane: at a URL, no array is taken as back to back, so zarr's API reads every one."""
    from prlmfuse.cache_features import shard_handle

    back_to_back = shard_handle._back_to_back
    with mock.patch.object(shard_handle, "_back_to_back",
                           lambda location, name, array: None if location.url else back_to_back(location, name, array)):
        yield


LANES = {"library": contextlib.nullcontext, "zarr_api": zarr_api_at_urls}


def opens_per_sentence(url: str, lane: str) -> float:
    """Files a lane's pass opens through fsspec's local filesystem, per sentence read."""
    from fsspec.implementations.local import LocalFileSystem

    opened = 0
    open_file = LocalFileSystem._open

    def counted(self, *args, **kwargs):
        nonlocal opened
        opened += 1
        return open_file(self, *args, **kwargs)

    with LANES[lane](), mock.patch.object(LocalFileSystem, "_open", counted):
        _, sentences = read_all(url, seed=0)
    return opened / sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="minilm-l6")
    parser.add_argument("--sentences", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from prlmfuse.cache_features import build_cache
    from prlmfuse.precision import machine_line

    print(f"machine: {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="prlmfuse-url-read-") as tmp:
        corpus = write_corpus(bible_sentences(args.sentences), Path(tmp) / "train.src")
        built = build_cache(args.checkpoint, corpus, Path(tmp) / "cache", progress=False)
        url = f"file://{Path(built.path).resolve()}"
        rates: dict[str, list[float]] = {lane: [] for lane in LANES}
        for r in range(args.rounds):
            for lane in (list(LANES) if r % 2 == 0 else list(LANES)[::-1]):
                with LANES[lane]():
                    seconds, sentences = read_all(url, seed=r)
                rates[lane].append(sentences / seconds)
            print(f"round {r + 1}: " + ", ".join(f"{lane} {v[-1]:,.0f}" for lane, v in rates.items()) + " sentences/s",
                  file=sys.stderr)
        opens = {lane: round(opens_per_sentence(url, lane), 2) for lane in LANES}
    ratios = [a / b for a, b in zip(rates["library"], rates["zarr_api"])]
    result = {
        "checkpoint": args.checkpoint,
        "sentences": args.sentences,
        "rounds": args.rounds,
        "sentences_per_s": {lane: round(statistics.median(v)) for lane, v in rates.items()},
        "sentences_per_s_rounds": {lane: [round(x) for x in v] for lane, v in rates.items()},
        "library_over_zarr_api": round(statistics.median(ratios), 3),
        "library_over_zarr_api_rounds": [round(x, 3) for x in ratios],
        "opens_per_sentence": opens,
        "machine": machine_line(),
    }
    for lane in LANES:
        print(f"{lane:9s} {result['sentences_per_s'][lane]:8,d} sentences/s, {opens[lane]} files opened a sentence")
    print(f"library over zarr_api: {result['library_over_zarr_api']} (rounds {result['library_over_zarr_api_rounds']})")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
