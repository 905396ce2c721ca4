"""Stage two's entry point: train_run() checks a run against its caches and directory, then trains it.

It opens every PrLM branch's caches (train_fused.branches), trains the joint BPE, builds the
model, writes run.json (train_fused.run_dir) and hands over to the Trainer loop. No PrLM is ever
loaded here: features come from the caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch

from prlmfuse.distributed import DistContext, barrier, broadcast_parameters, init_distributed
from prlmfuse.errors import SettingError, UserError
from prlmfuse.fileio import disk_full_error, is_disk_full, read_lines
from prlmfuse.precision import Runtime, resolve_runtime
from prlmfuse.train_fused import checkpointing
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.bpe import BPE, train_bpe_in_child
from prlmfuse.train_fused.branches import PrLMBranch, open_branch
from prlmfuse.train_fused.config import RunConfig
from prlmfuse.train_fused.data import PairDataset, cap_source
from prlmfuse.train_fused.modeling import FusedTransformer
from prlmfuse.train_fused.run_dir_upkeep import (
    remove_stale_temps, set_aside_for_fresh_start, settle_previous_run, training_lock,
)
from prlmfuse.train_fused.trainer import DevHook, Trainer

logger = logging.getLogger(__name__)

# The splits whose caches a training run checks and records; test is optional (evaluation reads it).
TRAIN_SPLITS = ("train", "dev", "test")


def _check_run(run: RunConfig, caches: list[dict[str, str]]) -> None:
    try:
        run.check()  # pipeline.yaml's runs passed it when read; a RunConfig made in Python meets it here
    except SettingError as e:
        raise UserError(f"run {run.name}: {e}") from None
    if len(caches) != len(run.prlms):
        raise UserError(
            f"run {run.name} fuses {len(run.prlms)} PrLM(s) but {len(caches)} cache set(s) were given; "
            "pass one {split: cache path} mapping per entry of the run's prlms, in their order"
        )
    for use, paths in zip(run.prlms, caches):
        missing = [split for split in ("train", "dev") if not paths.get(split)]
        if missing:
            raise UserError(f"run {run.name}: no {' or '.join(missing)} cache given for PrLM {use.checkpoint}")


def open_run_branches(run: RunConfig, corpus, caches: list[dict[str, str]]) -> dict[str, list[PrLMBranch]]:
    """Split -> one PrLMBranch per PrLM of the run. The train cache decides the layers read and the key
    fields the other splits' caches must match; every cache is checked against its checksums first."""
    by_split: dict[str, list[PrLMBranch]] = {split: [] for split in TRAIN_SPLITS}
    for use, paths in zip(run.prlms, caches):
        trained = None
        for split in TRAIN_SPLITS:
            if not paths.get(split):
                continue
            branch = open_branch(
                use, str(paths[split]), trained=trained, source=str(corpus.src_path(split)),
                source_name=f"{split} source", source_sha256=corpus.src_sha256(split), source_lines=int(corpus.splits[split]["src"]["lines"]),
                seed=run.seed, in_memory=run.in_memory_features and split != "test",
            )
            trained = branch.record
            by_split[split].append(branch)
    return by_split


def _branch_records(branches: dict[str, list[PrLMBranch]]) -> list[dict]:
    """run.json's prlms: each branch's record plus the path and key of every split's cache."""
    records = []
    for i, train in enumerate(branches["train"]):
        caches = {split: {"path": b[i].reader.path, "key": b[i].reader.key} for split, b in branches.items() if len(b) > i}
        records.append({**train.record, "caches": caches})
    return records


def train_run_bpe(run: RunConfig, corpus, bpe_path: Path) -> None:
    """The run's joint BPE over its training pairs, trained in a child process and saved to `bpe_path`."""
    train_bpe_in_child(str(corpus.src_path("train")), str(corpus.tgt_path("train")), run.max_train_pairs,
                       run.bpe_vocab, str(bpe_path))


# Lines per encode_batch call: a whole split at once would hold every line's Encoding (ids, tokens,
# offsets, masks) and its Python list together, a heap peak that grows with the corpus.
ENCODE_CHUNK = 2000


def _encode_lines(bpe: BPE, lines: list[str]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for start in range(0, len(lines), ENCODE_CHUNK):
        out.extend(np.asarray(ids, dtype=np.int32) for ids in bpe.encode_batch(lines[start : start + ENCODE_CHUNK]))
    return out


def _encode_split(bpe: BPE, corpus, split: str, limit: int | None, *,
                  max_source_tokens: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The BPE ids of a split's first `limit` pairs (all for None), each source cut as the model reads it
    (`data.cap_source`: its first max_source_tokens - 1 ids, </s> appended by the batch)."""
    src = read_lines(corpus.src_path(split))
    tgt = read_lines(corpus.tgt_path(split))
    if limit is not None:
        src, tgt = src[:limit], tgt[:limit]
    return [cap_source(ids, max_source_tokens) for ids in _encode_lines(bpe, src)], _encode_lines(bpe, tgt)


def train_run(
    run: RunConfig,
    corpus,
    caches: list[dict[str, str]],
    out_dir: str | os.PathLike,
    *,
    resume: bool = True,
    progress: bool = True,
    runtime: Runtime | None = None,
    dev_hook: DevHook | None = None,
) -> Path:
    """Train one run into `out_dir` (the run directory); resume=True continues a run already there.

    caches: for each entry of run.prlms, in order, {split: cache directory or fsspec URL} for
    "train" and "dev" (and "test", recorded in run.json for evaluation).
    runtime: device and precision (default: auto, auto); under torchrun `cuda` is this rank's LOCAL_RANK GPU.
    dev_hook: extra dev evaluations and a callback after each that may stop the run (trainer.DevHook).
    """
    run_dir = Path(out_dir)
    _check_run(run, caches)
    corpus.check_files()  # the files still hold what corpus.json, and so the caches, record
    runtime = runtime if runtime is not None else resolve_runtime()
    ctx = init_distributed(runtime.device)
    if ctx.is_main:
        logger.info("train: %s -> %s (%s)", run.name, run_dir, runtime.describe())
    branches = open_run_branches(run, corpus, caches)
    with contextlib.ExitStack() as stack:
        if ctx.is_main:
            stack.enter_context(training_lock(run_dir))
            # Safe only under the lock: a killed save's temp file is nobody's now.
            remove_stale_temps(run_dir)
        try:
            return _train_locked(run, corpus, branches, run_dir, ctx, resume=resume, progress=progress, runtime=runtime,
                                 dev_hook=dev_hook)
        except OSError as e:
            # run.json, bpe.json and the like are written atomically (fileio.atomic_path names the file).
            if is_disk_full(e) and e.filename:
                raise disk_full_error(Path(e.filename).name, Path(e.filename).parent) from None
            raise


def _train_locked(run: RunConfig, corpus, branches: dict[str, list[PrLMBranch]], run_dir: Path, ctx: DistContext, *,
                  resume: bool, progress: bool, runtime: Runtime, dev_hook: DevHook | None = None) -> Path:
    if ctx.is_main:
        settle_previous_run(run_dir, resume=resume)
        # Not read first: --fresh also starts over from a trainer state too damaged to resume.
        if not resume and any((run_dir / name).exists()
                              for name in (rundir.TRAINER_STATE, rundir.CHECKPOINT_DIR, rundir.RESUME_DIR)):
            set_aside_for_fresh_start(run_dir)
    barrier(ctx)
    # A stop signal's resume point where it is newer than the last checkpoint.
    existing = rundir.state_to_resume(run_dir)

    bpe_path = run_dir / rundir.BPE_JSON
    if ctx.is_main and (existing is None or not bpe_path.is_file()):
        if existing is not None:
            raise UserError(f"{bpe_path} is missing from a run with checkpoints; restore it or start in a new directory")
        train_run_bpe(run, corpus, bpe_path)
    barrier(ctx)
    bpe = BPE.load(bpe_path)

    torch.manual_seed(run.seed)
    model_config = run.model_config(bpe.vocab_size, [b.spec for b in branches["train"]])
    model = FusedTransformer(model_config).to(runtime.device)
    broadcast_parameters(ctx, model)

    # Sources cut as the model reads them (max_source_tokens), the dev evaluation's as training's.
    cap = run.max_source_tokens
    train_src, train_tgt = _encode_split(bpe, corpus, "train", run.max_train_pairs, max_source_tokens=cap)
    dev_src, dev_tgt = _encode_split(bpe, corpus, "dev", None, max_source_tokens=cap)
    train_set = PairDataset(train_src, train_tgt, branches["train"])
    dev_set = PairDataset(dev_src, dev_tgt, branches["dev"])
    trainer = Trainer(run, run_dir, model, train_set, dev_set, ctx, progress=progress, runtime=runtime,
                      dev_hook=dev_hook)

    info = rundir.run_info(run, corpus, dataclasses.asdict(model_config), _branch_records(branches), {
        "device": str(runtime.device),
        "precision": runtime.precision,
        "world_size": ctx.world_size,
        "train_pairs": len(train_set),
        "train_pairs_used": trainer.train_sampler.num_pairs,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    })
    if existing is not None and (run_dir / rundir.RUN_JSON).is_file():
        rundir.check_same_run(run_dir, rundir.read_run_info(run_dir), info)
    if ctx.is_main:
        rundir.write_run_info(run_dir, info)

    if existing is not None:
        trainer.restore(existing)
        if ctx.is_main and not existing.checkpoint.startswith(rundir.RESUME_DIR):
            checkpointing.settle_budget_end(run_dir, run, trainer.state)
        if ctx.is_main and rundir.stop_reason(run, existing) is None:
            source = "a stop signal's resume point" if existing.checkpoint.startswith(rundir.RESUME_DIR) else "its last checkpoint"
            logger.info("train: %s resumes at update %d from %s", run.name, existing.update, source)
    if ctx.is_main:
        rundir.truncate_metrics(run_dir, existing.update if existing is not None else 0)
    barrier(ctx)
    reason = trainer.fit()
    if ctx.is_main:
        # Also on a rerun of a finished run, which trains nothing: say that it is finished, and why.
        logger.info("train: %s done at update %d (%s)", run.name, trainer.state.update,
                    reason if trainer.state.stopped else f"{reason} reached")
    return run_dir
