"""Process-wide settings shared by the heavy stages (cache build, training, decoding)."""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP_FREED_TRIM_BYTES = 1 << 30

# PRLMFUSE_MALLOC=glibc leaves glibc's defaults alone (bench/train_throughput.py --compare malloc compares both).
MALLOC_ENV = "PRLMFUSE_MALLOC"

_state: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc reuse freed memory for large tensors instead of unmapping it; True when in effect.

    glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps
    it on free, so each logits- or activation-sized tensor of a training or decoding step pays page
    faults and kernel page zeroing again; that was over a quarter of a small model's step time here
    (`python bench/train_throughput.py --compare malloc`). With mmap off and a high trim threshold, freed
    blocks stay in the heap and the next step reuses them: the process keeps its peak heap instead.
    A no-op off glibc (macOS, musl) or when PRLMFUSE_MALLOC=glibc. Idempotent.
    """
    global _state
    if _state is not None:
        return _state
    _state = False
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "glibc" or not sys.platform.startswith("linux"):
        return _state
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _state
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _state = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_TRIM_BYTES))
    return _state
