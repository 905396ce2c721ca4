"""Stage two: the fused Transformer and its trainer. Never loads a PrLM: features come from the cache.

    train_run(run, corpus, caches, out_dir, *, resume=True, progress=True) -> run_dir
        caches: one {split: cache path} per entry of run.prlms
    average_checkpoints(run_dir, last=5, out=None) -> path of the averaged safetensors
    load_run(run_dir, weights="average"|"best"|"last", *, last=5) -> (model in eval mode, BPE, run_info)

Modules: config (RunConfig, ModelConfig and their rules), run_dir (the run directory's files, run.json,
trainer state), run_dir_upkeep (its lock, a `--fresh` start's set-aside run), weights (load_run, averages),
branches (a PrLM branch opened over its cache), data (batches), batch_samplers (which pairs form each batch,
in what order), modeling (the model; its parts in blocks and layer_selection), trainer (the loop), update_step
(one update: schedule, loss, accumulation), run_setup (train_run), checkpointing (writing checkpoints), bpe,
dev_curve (how much a run's dev loss still falls).
The rest is imported on first use, so `prlmfuse.train_fused.config` (read by the pipeline
parser) stays cheap to import.
"""

from __future__ import annotations

from prlmfuse.train_fused.config import PrLMUse, RunConfig

_LAZY = {
    "train_run": "prlmfuse.train_fused.run_setup",
    "average_checkpoints": "prlmfuse.train_fused.weights",
    "load_run": "prlmfuse.train_fused.weights",
    "BPE": "prlmfuse.train_fused.bpe",
    "train_bpe": "prlmfuse.train_fused.bpe",
}

__all__ = ["PrLMUse", "RunConfig", "average_checkpoints", "load_run", "train_run", "BPE", "train_bpe"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prlmfuse.train_fused' has no attribute {name!r}")
