"""Stage two: the fused Transformer and its trainer. Never loads a PrLM: features come from the cache.

    train_run(run, corpus, caches, out_dir, *, resume=True, progress=True) -> run_dir
    average_checkpoints(run_dir, last=5, out=None) -> path of the averaged safetensors
    load_run(run_dir, weights="average"|"best"|"last", *, last=5) -> (model in eval mode, BPE, run_info)
    PrLMCaches(use, train, dev, test=None)

The trainer is imported on first use, so `prlmfuse.train_fused.config` (read by the pipeline
parser) stays cheap to import.
"""

from __future__ import annotations

from prlmfuse.train_fused.config import PrLMUse, RunConfig

_LAZY = {
    "PrLMCaches": "prlmfuse.train_fused.trainer",
    "train_run": "prlmfuse.train_fused.trainer",
    "average_checkpoints": "prlmfuse.train_fused.trainer",
    "load_run": "prlmfuse.train_fused.trainer",
    "BPE": "prlmfuse.train_fused.bpe",
    "train_bpe": "prlmfuse.train_fused.bpe",
}

__all__ = ["PrLMCaches", "PrLMUse", "RunConfig", "average_checkpoints", "load_run", "train_run", "BPE", "train_bpe"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prlmfuse.train_fused' has no attribute {name!r}")
