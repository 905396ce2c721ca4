"""Storage dtypes of cached features: what each stores, and the encode/decode between float32 and it.

float16 and float32 are stored as they are (float16 refuses values past its largest finite 65504
rather than store inf); bfloat16 as its raw uint16 bits (numpy has no bfloat16); int8 as symmetric
per-token quantization that keeps each token's INT8_OUTLIERS largest-magnitude values apart, in
float32, and scales the rest by their own absmax / 127: a causal LM's residual stream carries a few
channels hundreds of times larger than the rest, and one absmax over the whole token would round
the rest of that token to zero.
"""

from __future__ import annotations

import numpy as np
import torch

from prlmfuse.errors import UserError

STORAGE_DTYPES = ("float16", "bfloat16", "float32", "int8")


def check_dtype(dtype: str) -> str:
    if dtype not in STORAGE_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(STORAGE_DTYPES)}")
    return dtype


def token_numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype({"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int8": np.int8}[dtype])


def pooled_storage_dtype(dtype: str) -> str:
    # pooled vectors are few; int8 caches keep them in float16 rather than quantizing them too
    return "float16" if dtype == "int8" else dtype


FLOAT16_MAX = 65504.0
INT8_OUTLIERS = 4  # values per token kept exactly beside an int8 cache's quantized rest


def side_arrays(dtype: str, hidden_size: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Per-token arrays a stored layer keeps beside its values: name -> (shape of one token's row, dtype).

    int8: `quant`, float32 [1 + 2k] per token: the scale (absmax / 127 of the values other than the
    outliers), the k outliers' channels, then their values. One array, so reading a token's features
    takes as many reads as a per-token scale alone would (channel numbers are exact in float32).
    """
    if dtype != "int8":
        return {}
    return {"quant": ((1 + 2 * min(INT8_OUTLIERS, hidden_size),), np.dtype(np.float32))}


def token_bytes_per_row(dtype: str, hidden_size: int) -> int:
    side = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in side_arrays(dtype, hidden_size).values())
    return hidden_size * token_numpy_dtype(dtype).itemsize + side


def check_fits(x: torch.Tensor, dtype: str, what: str) -> None:
    """Refuse features a float16 store would turn into inf, naming them, their largest value and a dtype that fits."""
    if dtype != "float16" or not x.numel():
        return
    peak = float(x.detach().abs().amax())
    if peak > FLOAT16_MAX:
        raise UserError(
            f"{what} hold values up to {peak:,.0f}, past float16's largest {FLOAT16_MAX:,.0f} (they would be stored "
            "as inf); cache this checkpoint with dtype bfloat16 or float32 (--dtype, or dtype in pipeline.yaml's cache)"
        )


def encode(x: torch.Tensor, dtype: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """float32 [..., d] -> (stored values, the side arrays of `side_arrays`, per row)."""
    if dtype == "float32":
        return x.float().contiguous().numpy(), {}
    if dtype == "float16":
        return x.to(torch.float16).contiguous().numpy(), {}
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), {}
    if dtype == "int8":
        return _quantize_int8(x.float())
    raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(STORAGE_DTYPES)}")


INT8_BLOCK_BYTES = 1 << 20  # float32 rows quantized at once: temporaries that small are reused from the heap


def _quantize_int8(x: torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """int8 values and their `quant` rows (see side_arrays), a block of rows at a time.

    Whole-batch temporaries are large enough that the allocator maps fresh pages for each and the
    quantization spends its time in page faults; per block they fit the heap and are reused.
    """
    d = x.shape[-1]
    k = min(INT8_OUTLIERS, d)
    rows = x.reshape(-1, d)
    values = np.empty(rows.shape, np.int8)
    quant = np.empty((len(rows), 1 + 2 * k), np.float32)
    values_out, quant_out = torch.from_numpy(values), torch.from_numpy(quant)
    block = max(1, INT8_BLOCK_BYTES // (4 * d))
    for start in range(0, len(rows), block):
        x_block = rows[start : start + block]
        magnitude = x_block.abs()
        index = magnitude.topk(k, dim=-1).indices
        scale = magnitude.scatter_(-1, index, 0.0).amax(dim=-1, keepdim=True).div_(127.0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        rest = x_block.scatter(-1, index, 0.0)
        values_out[start : start + block] = rest.div_(safe).round_().clamp_(-127, 127)
        torch.cat([scale, index.float(), x_block.gather(-1, index)], dim=-1, out=quant_out[start : start + block])
    return values.reshape(x.shape), {"quant": quant.reshape(*x.shape[:-1], 1 + 2 * k)}


def decode(values: np.ndarray, side: dict[str, np.ndarray] | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode`, always float32."""
    return decode_to_transfer(values, side, dtype).float()


def transfer_dtype(dtype: str) -> torch.dtype:
    """The narrowest torch dtype that holds a stored dtype's values exactly (int8: dequantized float32)."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)


def decode_to_transfer(values: np.ndarray, side: dict[str, np.ndarray] | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode` in `transfer_dtype(dtype)`: float16/bfloat16 values are not widened."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    t = torch.from_numpy(np.ascontiguousarray(values))
    if dtype == "int8":
        quant = torch.from_numpy(np.ascontiguousarray(side["quant"]))
        k = (quant.shape[-1] - 1) // 2
        return t.float().mul_(quant[..., :1]).scatter_(-1, quant[..., 1:1 + k].long(), quant[..., 1 + k:])
    return t
