"""Which device a stage runs on and at which compute precision: one function for each."""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

import torch

from prlmfuse.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
PRECISION_CHOICES = ("auto", "bf16", "fp16", "fp32")
_DEVICE_TEXT = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_device_text(setting) -> str:
    """The device setting in canonical form, checked for spelling only (availability is resolve_device's)."""
    text = str(setting).strip().lower() if isinstance(setting, str) else ""
    if not _DEVICE_TEXT.match(text):
        raise UserError(f"device {setting!r} unknown; use {DEVICE_CHOICES}")
    return text


def check_precision_text(setting) -> str:
    text = str(setting).strip().lower() if isinstance(setting, str) else ""
    if text not in PRECISION_CHOICES:
        raise UserError(f"precision {setting!r} unknown; use {', '.join(PRECISION_CHOICES)}")
    return text


def resolve_device(setting: str | torch.device | None = "auto") -> torch.device:
    """`auto` (CUDA when torch sees one, else CPU), `cpu`, `cuda` or `cuda:N` as a torch.device."""
    if isinstance(setting, torch.device):
        setting = str(setting)
    text = "auto" if setting is None else check_device_text(setting)
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


def resolve_precision(setting: str | None, device: torch.device | str) -> torch.dtype:
    """`auto` (compute_dtype of the device) or an explicit bf16 / fp16 / fp32 as an autocast dtype.

    fp16 on a CPU is refused: CPU autocast to fp16 is slow and has no loss scaling here.
    """
    text = "auto" if setting is None else check_precision_text(setting)
    if text == "auto":
        return compute_dtype(device)
    if text == "fp16" and torch.device(device).type == "cpu":
        raise UserError("precision 'fp16' is for CUDA devices; on the CPU use bf16, fp32 or auto")
    return _DTYPES[text]


def dtype_of(name: str) -> torch.dtype:
    """bf16 / fp16 / fp32 -> the torch dtype (the inverse of precision_name)."""
    return _DTYPES[check_precision_text(name) if name != "auto" else "fp32"]


@dataclass(frozen=True)
class Runtime:
    """Where a stage computes and at which precision, resolved once from the user's settings."""

    device: torch.device
    dtype: torch.dtype

    @property
    def precision(self) -> str:
        return precision_name(self.dtype)

    def describe(self) -> str:
        """For each stage's first line of output: `device cpu, precision fp32`."""
        return f"device {self.device}, precision {self.precision}"

    def autocast(self):
        return autocast(self.device, self.dtype)


def resolve_runtime(device: str | torch.device | None = "auto", precision: str | None = "auto") -> Runtime:
    """The device of `device` (under torchrun, `cuda` means this rank's LOCAL_RANK GPU) and its precision,
    with the process set up to compute there (prepare_device)."""
    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        from prlmfuse.distributed import local_cuda_index

        resolved = torch.device("cuda", local_cuda_index())
    prepare_device(resolved)
    return Runtime(resolved, resolve_precision(precision, resolved))


def prepare_device(device: torch.device | str) -> None:
    """Process-wide settings for computing on `device`; every stage applies them before it computes.

    On CUDA, scaled_dot_product_attention may not choose cuDNN's kernel, which recent torch builds put
    first for bf16/fp16 on Hopper and Blackwell GPUs: it builds a graph for every new input shape, and
    token-budget batches and the cache builder's batches seldom repeat one within an epoch, so a first
    pass over the data would wait for a build at most steps. The flash and memory-efficient kernels need
    none.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's out-of-memory error, or the CPU allocator's: a batch too large for the device."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def free_memory(device: torch.device) -> None:
    """Give back what a failed forward or backward held (call it once the exception and its frames are gone)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def grad_scaler(runtime: Runtime) -> "torch.amp.GradScaler":
    """Loss scaling for fp16 autocast (its gradients underflow without it); a no-op scaler otherwise."""
    return torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == torch.float16)


def machine_line(device: torch.device | str = "cpu") -> str:
    """The machine a figure came from, for results files: CPU model and cores with its bf16 support,
    the GPU when `device` is one, and the torch build."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    bf16 = "fast bf16" if cpu_has_fast_bf16() else "no fast bf16"
    line = f"{cpu}, {os.cpu_count()} cores ({bf16})"
    device = torch.device(device)
    if device.type == "cuda":
        line += f"; {torch.cuda.get_device_name(device)}"
    return f"{line}; torch {torch.__version__}"
