"""Which device a stage runs on and at which compute precision: one function for each."""

from __future__ import annotations

import contextlib
import functools

import torch

from prlmfuse.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(setting: str | torch.device | None = "auto") -> torch.device:
    """`auto` (CUDA when torch sees one, else CPU), `cpu`, `cuda` or `cuda:N` as a torch.device."""
    text = "auto" if setting is None else str(setting).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"device {setting!r} unknown; use {DEVICE_CHOICES}") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {setting!r} unknown; use {DEVICE_CHOICES}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {setting!r}: torch sees no CUDA GPU here; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"device {setting!r}: only {torch.cuda.device_count()} CUDA device(s) visible; use cuda:0.."
                f"{torch.cuda.device_count() - 1}"
            )
    return device


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """The CPU multiplies bf16 natively (AMX or AVX512-BF16); emulated bf16 is slower than float32."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return "AMX" in str(torch.backends.cpu.get_cpu_capability()).upper()


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The autocast dtype that is fast on `device`: bf16 where it multiplies bf16 natively (recent
    GPUs, CPUs with AMX or AVX512-BF16), fp16 on GPUs without bf16, float32 otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def precision_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def autocast(device: torch.device | str, dtype: torch.dtype):
    """torch.autocast at `dtype` on `device`, or nothing for float32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
