"""int8 quantization of a batch's features, as an encoder thread runs it, side by side with the same
formula over the whole batch at once.

    python bench/int8_encode.py [--tokens 4096,16384,65536] [--width 768] [--rounds 5]

Features: float32 [tokens, width] of random values with two channels a hundred times larger (a causal
LM's massive activations). Lanes, in turn within each round (order alternating between rounds):
  library      cache_features.codecs.encode(x, "int8"), which quantizes a block of rows at a time
  whole_batch  the same per-token formula (absmax of the rest after the INT8_OUTLIERS largest values,
               rounded to int8) over the whole batch in one pass of each op
Both must give the same bytes (checked every round). Reported per token count: each lane's median
seconds and GB/s of stored bytes (int8 values and their float32 `quant` rows), and the median over
rounds of library's speed over whole_batch's. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch


def whole_batch(x: torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    from prlmfuse.cache_features.codecs import INT8_OUTLIERS

    k = min(INT8_OUTLIERS, x.shape[-1])
    index = x.abs().topk(k, dim=-1).indices
    outliers = x.gather(-1, index)
    rest = x.scatter(-1, index, 0.0)
    scale = rest.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rest / safe).clamp_(-127, 127).to(torch.int8)
    return q.contiguous().numpy(), {"quant": torch.cat([scale, index.float(), outliers], dim=-1).contiguous().numpy()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,16384,65536", help="real tokens per batch, comma-separated")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    from prlmfuse.cache_features.codecs import encode
    from prlmfuse.precision import machine_line

    lanes = {"library": lambda x: encode(x, "int8"), "whole_batch": whole_batch}
    print(f"machine: {machine_line()}; torch threads {torch.get_num_threads()}", flush=True)
    result: dict = {"machine": machine_line(), "torch_threads": torch.get_num_threads(), "width": args.width, "batches": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        generator = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, args.width, generator=generator)
        x[:, :2] *= 100.0
        seconds: dict[str, list[float]] = {lane: [] for lane in lanes}
        stored = 0
        for round_ in range(args.rounds):
            outputs = {}
            for lane in (lanes if round_ % 2 == 0 else reversed(list(lanes))):
                started = time.perf_counter()
                outputs[lane] = lanes[lane](x)
                seconds[lane].append(time.perf_counter() - started)
            (a, a_side), (b, b_side) = outputs["library"], outputs["whole_batch"]
            if not (np.array_equal(a, b) and np.array_equal(a_side["quant"], b_side["quant"])):
                print(f"int8_encode: the lanes' bytes differ at {tokens} tokens", file=sys.stderr)
                return 1
            stored = a.nbytes + a_side["quant"].nbytes
        row = {"tokens": tokens, "stored_MB": round(stored / 1e6, 1)}
        for lane, times in seconds.items():
            row[f"{lane}_s"] = round(statistics.median(times), 4)
            row[f"{lane}_GBps"] = round(stored / statistics.median(times) / 1e9, 3)
        row["library_over_whole_batch"] = round(
            statistics.median(w / l for l, w in zip(seconds["library"], seconds["whole_batch"])), 2)
        result["batches"].append(row)
        print(f"{tokens} tokens: {row}", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
