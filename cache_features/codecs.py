"""Storage dtypes of cached features: what each stores, and the encode/decode between float32 and it.

float16 and float32 are stored as they are; bfloat16 as its raw uint16 bits (numpy has no bfloat16);
int8 as symmetric per-token quantization with a float32 absmax / 127 scale per row.
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


def token_bytes_per_row(dtype: str, hidden_size: int) -> int:
    return hidden_size * token_numpy_dtype(dtype).itemsize + (4 if dtype == "int8" else 0)


def encode(x: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [..., d] -> (stored values, per-row float32 scales for int8 else None)."""
    if dtype == "float32":
        return x.float().contiguous().numpy(), None
    if dtype == "float16":
        return x.to(torch.float16).contiguous().numpy(), None
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), None
    if dtype == "int8":
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
        return q.contiguous().numpy(), scale.squeeze(-1).float().contiguous().numpy()
    raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(STORAGE_DTYPES)}")


def decode(values: np.ndarray, scales: np.ndarray | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode`, always float32."""
    return decode_to_transfer(values, scales, dtype).float()


def transfer_dtype(dtype: str) -> torch.dtype:
    """The narrowest torch dtype that holds a stored dtype's values exactly (int8: dequantized float32)."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)


def decode_to_transfer(values: np.ndarray, scales: np.ndarray | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode` in `transfer_dtype(dtype)`: float16/bfloat16 values are not widened."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    t = torch.from_numpy(np.ascontiguousarray(values))
    if dtype == "int8":
        return t.float().mul_(torch.from_numpy(np.ascontiguousarray(scales)).float().unsqueeze(-1))
    return t
