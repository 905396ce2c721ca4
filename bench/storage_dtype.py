"""What int8 storage costs against float16, side by side in one process, on real Bible verses.

    python bench/storage_dtype.py [--checkpoint minilm-l6] [--sentences 3000] [--rounds 3]

For each of --rounds rounds, in alternating order (float16 first in odd rounds, int8 first in even
ones), the same verses are built into a float16 and an int8 cache (build_cache end to end, model
load included), and each cache is then read the way training reads it with `in_memory_features`:
a reader holding the cache in RAM, every sentence once in shuffled order, 64 at a time, widened to
float32 for the model (cache_throughput.read_all with in_memory and widen). Each dtype keeps its
best round.
Printed: build seconds and tokens/s, the read rate, bytes per token of the stored layer and of all
files, the int8/float16 ratios, and the last line `RESULT {json}`. Quality (BLEU) is not measured
here: that is the `storage-int8` row of examples/prlm-choice-en-ja.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_throughput import bible_sentences, read_all, write_corpus  # noqa: E402

DTYPES = ("float16", "int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="minilm-l6")
    parser.add_argument("--sentences", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    args = parser.parse_args()

    from prlmfuse.cache_features import build_cache, inspect_cache
    from prlmfuse.precision import machine_line

    build_s = {d: float("inf") for d in DTYPES}
    read_s = {d: float("inf") for d in DTYPES}
    stats = {}
    with tempfile.TemporaryDirectory(prefix="prlmfuse-bench-dtype-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = write_corpus(bible_sentences(args.sentences), tmp / "verses.src")
        for r in range(args.rounds):
            order = DTYPES if r % 2 == 0 else DTYPES[::-1]
            for dtype in order:
                out = tmp / f"{dtype}-{r}"
                start = time.perf_counter()
                result = build_cache(args.checkpoint, corpus, out, dtype=dtype, progress=False, device=args.device)
                build_s[dtype] = min(build_s[dtype], time.perf_counter() - start)
                read_s[dtype] = min(read_s[dtype], read_all(result.path, r, in_memory=True, widen=True)[0])
                if dtype not in stats:
                    stats[dtype] = inspect_cache(result.path)
            print(f"round {r + 1}: " + ", ".join(f"{d} build {build_s[d]:.1f} s read {read_s[d]:.2f} s" for d in DTYPES),
                  file=sys.stderr)

    tokens = int(stats["float16"]["num_tokens"])
    for dtype in DTYPES:
        print(f"{dtype:8s} build {build_s[dtype]:7.1f} s ({tokens / build_s[dtype]:8,.0f} tokens/s, model load included); "
              f"in-memory read {args.sentences / read_s[dtype]:9,.0f} sentences/s; "
              f"{stats[dtype]['bytes_per_token']:6.1f} bytes/token of the layer, "
              f"{stats[dtype]['bytes_per_token_total']:6.1f} with all files")
    ratios = {
        "build_seconds": build_s["int8"] / build_s["float16"],
        "read_seconds": read_s["int8"] / read_s["float16"],
        "bytes_per_token": stats["int8"]["bytes_per_token"] / stats["float16"]["bytes_per_token"],
        "bytes_per_token_total": stats["int8"]["bytes_per_token_total"] / stats["float16"]["bytes_per_token_total"],
    }
    print("int8 / float16: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    result_line = {
        "checkpoint": args.checkpoint,
        "sentences": args.sentences,
        "tokens": tokens,
        "rounds": args.rounds,
        "build_seconds": {d: round(build_s[d], 2) for d in DTYPES},
        "read_sentences_per_s": {d: round(args.sentences / read_s[d]) for d in DTYPES},
        "bytes_per_token": {d: round(stats[d]["bytes_per_token"], 1) for d in DTYPES},
        "bytes_per_token_total": {d: round(stats[d]["bytes_per_token_total"], 1) for d in DTYPES},
        "int8_over_float16": {k: round(v, 3) for k, v in ratios.items()},
        "machine": machine_line(),
        "cpu_count": os.cpu_count(),
    }
    print("RESULT " + json.dumps(result_line))


if __name__ == "__main__":
    main()
