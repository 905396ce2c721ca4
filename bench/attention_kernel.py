"""CPU training step of a fused `small` model: attention through SDPA vs written out, side by side.

One process, one model, the same batch; the two variants alternate update by update (in reverse
order every other update), and the ratio is of the medians. The last line is `RESULT {json}`.

    python bench/attention_kernel.py [--updates 14] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from prlmfuse.precision import autocast, compute_dtype
from prlmfuse.train_fused import blocks, modeling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=14, help="timed updates per variant (2 more warm up)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    spec = modeling.PrLMSpec(name="prlm", width=384, num_layers=1, num_pooled=0)
    model = modeling.FusedTransformer(modeling.ModelConfig.from_preset("small", vocab_size=8000, prlms=[spec],
                                                                       side="source", position="ffn")).train()
    optimizer = torch.optim.Adam(model.parameters())
    batch, src_len, tgt_len, prlm_len = 100, 35, 30, 40
    src = torch.randint(3, 8000, (batch, src_len))
    tgt = torch.randint(3, 8000, (batch, tgt_len))
    feats = [modeling.PrLMFeatures(torch.randn(batch, 1, prlm_len, 384), torch.ones(batch, prlm_len, dtype=torch.bool))]
    dtype = compute_dtype("cpu")
    written_out = blocks.cpu_training_attention

    def via_sdpa(q, k, v, mask, dropout_p):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    def update() -> float:
        start = time.perf_counter()
        with autocast("cpu", dtype):
            loss = F.cross_entropy(model(src, tgt, feats).float().flatten(0, 1), tgt.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    times = {"sdpa": [], "written_out": []}
    variants = [("sdpa", via_sdpa), ("written_out", written_out)]
    for i in range(args.updates + 2):
        for name, fn in variants if i % 2 else variants[::-1]:
            blocks.cpu_training_attention = fn
            elapsed = update()
            if i >= 2:
                times[name].append(elapsed)
    blocks.cpu_training_attention = written_out
    sdpa, written = statistics.median(times["sdpa"]), statistics.median(times["written_out"])
    print(f"update: SDPA {sdpa * 1000:.0f} ms, written out {written * 1000:.0f} ms (precision {dtype})")
    print("RESULT " + json.dumps({"sdpa_ms": round(sdpa * 1000, 1), "written_out_ms": round(written * 1000, 1),
                                  "sdpa_over_written_out": round(sdpa / written, 3), "dtype": str(dtype)}))


if __name__ == "__main__":
    main()
