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


ENCODE_BLOCK_BYTES = 4 << 20  # float32 rows encoded at once: temporaries that small are reused from the heap


def encode(x: torch.Tensor, dtype: str, *, rows: torch.Tensor | None = None,
           what: str = "features") -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """float32 [..., d] -> (stored values, the side arrays of `side_arrays`, per row).

    With `rows` (x [..., d] seen as [N, d]), the rows x[rows] alone, in that order: a batch's real tokens.
    float16 refuses values past its range (check_fits, naming `what`). Rows are gathered and encoded a
    block at a time into the returned arrays: whole-batch temporaries are large enough that the allocator
    maps fresh pages for each, and the encoder then spends its time in page faults.
    """
    check_dtype(dtype)
    d = x.shape[-1]
    flat = x.detach().reshape(-1, d)
    count = len(flat) if rows is None else len(rows)
    shape = (*x.shape[:-1], d) if rows is None else (count, d)
    values = np.empty((count, d), token_numpy_dtype(dtype))
    values_out = torch.from_numpy(values)
    if dtype == "bfloat16":
        values_out = values_out.view(torch.bfloat16)
    sides = {name: np.empty((count, *row), side_dtype) for name, (row, side_dtype) in side_arrays(dtype, d).items()}
    quant_out = torch.from_numpy(sides["quant"]) if dtype == "int8" else None
    block = max(1, ENCODE_BLOCK_BYTES // (4 * d))
    for start in range(0, count, block):
        x_block = flat[start : start + block] if rows is None else flat.index_select(0, rows[start : start + block])
        stop = start + len(x_block)
        if dtype == "int8":
            values_out[start:stop], quant_out[start:stop] = _quantize_int8(x_block.float())
        else:
            check_fits(x_block, dtype, what)
            values_out[start:stop] = x_block  # cast from the input's dtype, as a .to(dtype) would
    return values.reshape(shape), {name: side.reshape(*shape[:-1], side.shape[-1]) for name, side in sides.items()}


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n, d] -> (the values int8-rounded, still float32; their `quant` rows, see side_arrays)."""
    k = min(INT8_OUTLIERS, x.shape[-1])
    magnitude = x.abs()
    index = magnitude.topk(k, dim=-1).indices
    scale = magnitude.scatter_(-1, index, 0.0).amax(dim=-1, keepdim=True).div_(127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    rounded = x.scatter(-1, index, 0.0).div_(safe).round_().clamp_(-127, 127)
    return rounded, torch.cat([scale, index.float(), x.gather(-1, index)], dim=-1)


def decode(values: np.ndarray, side: dict[str, np.ndarray] | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode`, always float32."""
    return decode_to_transfer(values, side, dtype).float()


def transfer_dtype(dtype: str) -> torch.dtype:
    """The narrowest torch dtype that holds a stored dtype's values exactly (int8: dequantized float32)."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array, bfloat16 as its uint16 bits (numpy has no bfloat16)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


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
