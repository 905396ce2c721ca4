"""Writing and restoring a run's checkpoints: safetensors weights and optimizer state, JSON trainer state.

File names and the reading side (trainer state, checkpoint listing, averaging) belong to
train_fused.run_dir. Every file goes through `atomic_path` (temp name, fsync, rename), and
trainer_state.json is only replaced once the checkpoint it names is complete, so a kill -9 at any
moment leaves a run that resumes from the last complete checkpoint. Nothing here unpickles:
tensors are safetensors, everything else (update count, epoch position, RNG state) is plain JSON.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_path, atomic_write_json, disk_full_error, fsync_dir, is_disk_full, read_json
from prlmfuse.train_fused.run_dir import (
    BEST,
    CHECKPOINT_DIR,
    RESUME_DIR,
    TRAINER_STATE,
    TrainingState,
    budget_dir,
    checkpoint_file_update,
    complete_checkpoints,
    epoch_end_checkpoints,
    latest_trainer_state,
    optimizer_path,
    relative_name,
    resume_paths,
    state_path,
    stop_reason,
    weights_path,
)
from prlmfuse.train_fused.run_dir_upkeep import discard_previous_run
from prlmfuse.train_fused.weights import load_weights


def save_weights(model: torch.nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    # save_model drops the duplicate names of tied weights (shared embeddings), which save_file refuses.
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=metadata)


def _named_params(model: torch.nn.Module) -> dict[int, str]:
    # named_parameters() lists a tied weight once, under its first name: stable across runs.
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Optimizer state flattened to `<param name>.<state key>` tensors (exp_avg, exp_avg_sq, step)."""
    names = _named_params(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{names[id(p)]}.{key}"] = tensor.detach().contiguous().clone()
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> None:
    names = _named_params(model)
    state_dict = optimizer.state_dict()
    position = 0
    restored: dict[int, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
            if entry:
                restored[position] = entry
            position += 1
    state_dict["state"] = restored
    optimizer.load_state_dict(state_dict)


def save_checkpoint(
    run_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: TrainingState,
    *,
    is_best: bool,
    keep_last: int,
    keep_last_epochs: int = 0,
) -> Path:
    """Write one complete checkpoint, then trainer_state.json naming it, then prune old ones.

    A full disk is a UserError naming the checkpoint; the temp file is gone and the previous
    checkpoint (still the one trainer_state.json names) is untouched, so a rerun resumes from it.
    """
    run_dir = Path(run_dir)
    update = trainer_state.update
    try:
        return _save_checkpoint(run_dir, update, model, optimizer, trainer_state, is_best=is_best, keep_last=keep_last,
                                keep_last_epochs=keep_last_epochs)
    except Exception as e:  # noqa: BLE001 - safetensors reports I/O errors as SafetensorError
        if is_disk_full(e):
            raise disk_full_error(f"checkpoint update-{update:08d}", run_dir) from None
        raise


def _save_checkpoint(run_dir: Path, update: int, model, optimizer, trainer_state: TrainingState, *, is_best: bool,
                     keep_last: int, keep_last_epochs: int) -> Path:
    weights = weights_path(run_dir, update)
    save_weights(model, weights, metadata={"update": str(update)})
    with atomic_path(optimizer_path(run_dir, update)) as tmp:
        save_file(optimizer_tensors(optimizer, model), str(tmp), metadata={"update": str(update)})
    state = dataclasses.replace(
        trainer_state, checkpoint=relative_name(weights), optimizer=relative_name(optimizer_path(run_dir, update))
    ).to_dict()
    atomic_write_json(state_path(run_dir, update), state)
    if is_best:
        save_weights(model, run_dir / BEST, metadata={"update": str(update)})
    atomic_write_json(run_dir / TRAINER_STATE, state)
    discard_previous_run(run_dir)  # a run `--fresh` replaced goes once this one has a state of its own
    prune_checkpoints(run_dir, keep_last, keep_last_epochs)
    shutil.rmtree(run_dir / RESUME_DIR, ignore_errors=True)  # a resume point is older than any later save
    return weights


def save_resume_point(run_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      trainer_state: TrainingState) -> Path:
    """Write the state after the last finished update into resume/, apart from the scheduled checkpoints.

    Weights and optimizer state first, under their update's names, then resume/state.json naming
    them, atomically, then the older resume files go: a kill at any moment leaves either the previous
    resume point or this one complete, and `run_dir.state_to_resume` picks the newest complete one.
    """
    run_dir = Path(run_dir)
    update = trainer_state.update
    weights, optimizer_file, state_file = resume_paths(run_dir, update)
    weights.parent.mkdir(exist_ok=True)
    try:
        save_weights(model, weights, metadata={"update": str(update)})
        with atomic_path(optimizer_file) as tmp:
            save_file(optimizer_tensors(optimizer, model), str(tmp), metadata={"update": str(update)})
        state = dataclasses.replace(trainer_state, checkpoint=relative_name(weights),
                                    optimizer=relative_name(optimizer_file))
        atomic_write_json(state_file, state.to_dict())
    except Exception as e:  # noqa: BLE001 - safetensors reports I/O errors as SafetensorError
        if is_disk_full(e):
            raise disk_full_error(f"resume point at update {update}", run_dir) from None
        raise
    for entry in weights.parent.iterdir():
        if entry.name not in (weights.name, optimizer_file.name, state_file.name) and not entry.name.startswith("."):
            entry.unlink(missing_ok=True)
    return state_file


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int, keep_last_epochs: int = 0) -> None:
    """Delete all but the newest `keep_last` checkpoints and the newest `keep_last_epochs` epoch-end ones,
    which an average over epochs reads (never the one trainer_state.json names)."""
    run_dir = Path(run_dir)
    keep = set(complete_checkpoints(run_dir)[-max(1, keep_last) :])
    if keep_last_epochs > 0:
        keep.update(epoch_end_checkpoints(run_dir)[-keep_last_epochs:])
    named = latest_trainer_state(run_dir)
    if named is not None:
        keep.add(named.update)
    for entry in (run_dir / CHECKPOINT_DIR).iterdir():
        update = checkpoint_file_update(entry.name)
        if update is not None and update not in keep:
            entry.unlink(missing_ok=True)


def settle_budget_end(run_dir: str | os.PathLike, run, state: TrainingState) -> None:
    """Before training from `state`, a scheduled checkpoint: where it is a budget end the run trains on past,
    link the weights and trainer state of every save up to it (what an average of the run there reads) into
    `budget_dir`, since pruning checkpoints/ will delete them; where the run is done at its max_updates but
    the state does not say so (stepped before budget ends were recorded, or stopped by a signal right after
    that save), record it."""
    run_dir = Path(run_dir)
    ends = state.budget_ends or []
    reason = stop_reason(run, state)
    if reason == "max_updates" and state.update not in ends:
        state.budget_ends = [*ends, state.update]
        for path in (state_path(run_dir, state.update), run_dir / TRAINER_STATE):
            saved = read_json(path, "trainer state")
            if saved.get("update") == state.update:
                atomic_write_json(path, {**saved, "budget_ends": state.budget_ends})
    elif reason is None and state.update in ends and not budget_dir(run_dir, state.update).is_dir():
        target = budget_dir(run_dir, state.update)
        building = target.with_name(f".{target.name}.building")
        shutil.rmtree(building, ignore_errors=True)  # a kill left it half linked
        building.mkdir(parents=True)
        for update in complete_checkpoints(run_dir):
            if update <= state.update:
                for source in (weights_path(run_dir, update), state_path(run_dir, update)):
                    try:
                        os.link(source, building / source.name)  # files are replaced, never rewritten in place
                    except OSError:
                        shutil.copy2(source, building / source.name)
                        with open(building / source.name, "rb+") as copied:
                            os.fsync(copied.fileno())
        fsync_dir(building)
        os.replace(building, target)
        fsync_dir(target.parent)


def load_checkpoint(
    run_dir: str | os.PathLike, state: TrainingState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Restore the weights (and optimizer state) of the checkpoint a trainer state names."""
    run_dir = Path(run_dir)
    load_weights(model, run_dir / state.checkpoint)
    if optimizer is not None:
        path = run_dir / state.optimizer
        try:
            tensors = load_file(str(path))
        except (FileNotFoundError, SafetensorError) as e:
            raise UserError(f"optimizer state {path} is missing or corrupt ({e}); start the run afresh") from None
        load_optimizer_tensors(optimizer, model, tensors)
