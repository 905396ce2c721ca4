"""An encoder thread's work on one batch (padding dropped, range check, float16 cast or int8 quantization),
side by side with the same steps over the whole batch at once.

    python bench/feature_encode.py [--batches 128x512,32x512,64x128] [--width 768] [--rounds 5]

Features: float32 [B, T, width] as a model hands them over, random values with two channels a hundred times
larger (a causal LM's massive activations); sentence lengths uniform in 1..T (seeded), so about half the
rows are padding. Lanes, in turn within each round (order alternating between rounds), for float16 and int8:
  library      cache_features.background_writer.encode_batch: codecs.encode gathers the real rows and
               encodes them a block of rows at a time into the arrays it returns (its time includes
               the batch's pooled vectors, two rows a sentence)
  whole_batch  index_select of every real row at once, the float16 range check over it, then the cast,
               or the same per-token int8 formula, one pass of each op over the whole batch
Both must give the same bytes (checked every round). Reported per batch shape and dtype: each lane's
median seconds and GB/s of stored bytes, and the median over rounds of library's speed over
whole_batch's. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

DTYPES = ("float16", "int8")


def whole_batch(states: torch.Tensor, real_rows: torch.Tensor, dtype: str) -> dict[str, np.ndarray]:
    from prlmfuse.cache_features.codecs import INT8_OUTLIERS, check_fits

    x = states.flatten(0, 1).index_select(0, real_rows)
    if dtype == "float16":
        check_fits(x, dtype, "features")
        return {"values": x.to(torch.float16).numpy()}
    k = min(INT8_OUTLIERS, x.shape[-1])
    index = x.abs().topk(k, dim=-1).indices
    outliers = x.gather(-1, index)
    rest = x.scatter(-1, index, 0.0)
    scale = rest.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rest / safe).clamp_(-127, 127).to(torch.int8)
    return {"values": q.numpy(), "quant": torch.cat([scale, index.float(), outliers], dim=-1).numpy()}


def library(states: torch.Tensor, real_rows: torch.Tensor, dtype: str) -> dict[str, np.ndarray]:
    from prlmfuse.cache_features.background_writer import HostBatch, encode_batch

    pooled = states[:, :2].reshape(len(states), 1, 2, states.shape[-1])
    rows = encode_batch(HostBatch(states[None], pooled, real_rows), (0,), dtype)
    return {"values": rows["layer_000"], **({"quant": rows["quant_000"]} if dtype == "int8" else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="128x512,32x512,64x128", help="sentences x padded length, comma-separated")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    from prlmfuse.precision import machine_line

    lanes = {"library": library, "whole_batch": whole_batch}
    print(f"machine: {machine_line()}; torch threads {torch.get_num_threads()}", flush=True)
    result: dict = {"machine": machine_line(), "torch_threads": torch.get_num_threads(), "width": args.width, "batches": []}
    for shape in args.batches.split(","):
        sentences, padded = (int(n) for n in shape.split("x"))
        generator = torch.Generator().manual_seed(sentences * padded)
        states = torch.randn(sentences, padded, args.width, generator=generator)
        states[..., :2] *= 100.0
        lengths = torch.randint(1, padded + 1, (sentences,), generator=generator)
        real_rows = (torch.arange(padded)[None, :] < lengths[:, None]).reshape(-1).nonzero().squeeze(1)
        for dtype in DTYPES:
            seconds: dict[str, list[float]] = {lane: [] for lane in lanes}
            stored = 0
            for round_ in range(args.rounds):
                outputs = {}
                for lane in (lanes if round_ % 2 == 0 else reversed(list(lanes))):
                    started = time.perf_counter()
                    outputs[lane] = lanes[lane](states, real_rows, dtype)
                    seconds[lane].append(time.perf_counter() - started)
                a, b = outputs["library"], outputs["whole_batch"]
                if a.keys() != b.keys() or not all(np.array_equal(a[name], b[name]) for name in a):
                    print(f"feature_encode: the lanes' bytes differ at {shape} {dtype}", file=sys.stderr)
                    return 1
                stored = sum(array.nbytes for array in a.values())
            row = {"batch": shape, "real_tokens": len(real_rows), "dtype": dtype, "stored_MB": round(stored / 1e6, 1)}
            for lane, times in seconds.items():
                row[f"{lane}_s"] = round(statistics.median(times), 4)
                row[f"{lane}_GBps"] = round(stored / statistics.median(times) / 1e9, 3)
            row["library_over_whole_batch"] = round(
                statistics.median(w / l for l, w in zip(seconds["library"], seconds["whole_batch"])), 2)
            result["batches"].append(row)
            print(f"{shape} {dtype}: {row}", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
