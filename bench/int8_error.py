"""Error of an int8 cache against float32 features of the same sentences, per layer.

    python bench/int8_error.py [--checkpoint smollm2-135m] [--layers 5,15,28] [--sentences 24]

Builds a float32 and an int8 cache of the first --sentences Bible training verses (fp32 compute,
so the two differ only by storage) and prints, per layer, the largest |value|, the rms, and the
relative error (whole layer: ||int8 - fp32|| / ||fp32||; per token: the mean of the same ratio
per token) of the stored int8 scheme and of a plain per-token absmax scale for comparison.
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from prlmfuse.cache_features import CacheReader, build_cache
from prlmfuse.corpora import build_bible


def per_token_absmax(x: torch.Tensor) -> torch.Tensor:
    """x stored as int8 with one absmax scale per token, read back."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-127, 127) * scale


def relative_errors(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    err = approx - exact
    return float(err.norm() / exact.norm()), float((err.norm(dim=-1) / exact.norm(dim=-1)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2-135m")
    ap.add_argument("--layers", default="5,15,28")
    ap.add_argument("--sentences", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = [int(x) for x in args.layers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bible = build_bible(root / "bible")
        lines = (bible.root / "train.src").read_text(encoding="utf-8").splitlines()[: args.sentences]
        src = root / "verses.src"
        src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        readers = {
            dtype: CacheReader(build_cache(args.checkpoint, src, root / dtype, layers=args.layers, dtype=dtype,
                                           precision="fp32", progress=False).path)
            for dtype in ("float32", "int8")
        }
        for row, layer in enumerate(layers):
            exact = torch.cat([readers["float32"].features(i)[row] for i in range(len(lines))]).float()
            stored = torch.cat([readers["int8"].features(i)[row] for i in range(len(lines))]).float()
            rows.append({
                "layer": layer,
                "absmax": float(exact.abs().max()),
                "rms": float(exact.pow(2).mean().sqrt()),
                "int8": relative_errors(stored, exact),
                "per_token_absmax": relative_errors(per_token_absmax(exact), exact),
            })
    print(f"{args.checkpoint}, {len(lines)} verses: relative error against float32 (whole layer / mean per token)")
    print(f"{'layer':>5} {'absmax':>9} {'rms':>8} {'int8 (stored)':>17} {'per-token absmax':>19}")
    for r in rows:
        print(f"{r['layer']:>5} {r['absmax']:>9.0f} {r['rms']:>8.1f} {r['int8'][0]:>8.4f} / {r['int8'][1]:.4f}"
              f" {r['per_token_absmax'][0]:>10.4f} / {r['per_token_absmax'][1]:.4f}")
    print("RESULT " + json.dumps({"checkpoint": args.checkpoint, "sentences": len(lines), "layers": rows}))


if __name__ == "__main__":
    main()
