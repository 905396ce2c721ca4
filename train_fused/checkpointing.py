"""Checkpoints of a run directory: safetensors weights and optimizer state, JSON trainer state.

Layout (design.md "Run directory"):

    checkpoints/update-00000500.safetensors   model weights
    checkpoints/optimizer-00000500.safetensors   Adam state, one tensor per (parameter, state key)
    checkpoints/update-00000500.json          trainer state of that checkpoint (written last of the three)
    best.safetensors                          weights with the lowest dev loss so far
    trainer_state.json                        names the newest complete checkpoint; written after it

Every file goes through `atomic_path` (temp name, fsync, rename), and trainer_state.json is only
replaced once the checkpoint it names is complete, so a kill -9 at any moment leaves a run that
resumes from the last complete checkpoint. Nothing here unpickles: tensors are safetensors,
everything else (update count, epoch position, RNG state) is plain JSON.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_path, atomic_write_json, is_disk_full, read_json

CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE = "trainer_state.json"
BEST = "best.safetensors"
_WEIGHTS_RE = re.compile(r"^update-(\d{8})\.safetensors$")
# What trainer_state.json may name: files of this run's checkpoints/ folder, nothing else.
_NAMED_FILE_RE = {
    "checkpoint": re.compile(rf"^{CHECKPOINT_DIR}/update-\d{{8}}\.safetensors$"),
    "optimizer": re.compile(rf"^{CHECKPOINT_DIR}/optimizer-\d{{8}}\.safetensors$"),
}
# atomic_path's temp names (".<final name>.<random>.tmp") of the files training writes: what a kill -9
# mid-save leaves behind. (average-last*.safetensors temps are not among them: evaluate may be
# writing one right now, without the training lock.)
_STALE_TEMP_RE = re.compile(r"^\.(update-\d{8}\.(safetensors|json)|optimizer-\d{8}\.safetensors|"
                            r"trainer_state\.json|best\.safetensors|run\.json|bpe\.json|metrics\.jsonl)\..+\.tmp$")


def weights_path(run_dir: Path, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"update-{update:08d}.safetensors"


def optimizer_path(run_dir: Path, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"optimizer-{update:08d}.safetensors"


def state_path(run_dir: Path, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"update-{update:08d}.json"


def save_weights(model: torch.nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    # save_model drops the duplicate names of tied weights (shared embeddings), which save_file refuses.
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=metadata)


def load_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights not found: {path}; train the run first or pick another checkpoint")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except SafetensorError as e:
        raise UserError(f"weights file {path} is corrupt ({e}); delete it and use another checkpoint") from None
    if missing or unexpected:
        raise UserError(
            f"weights {path} do not fit this model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); "
            "it belongs to a different run configuration"
        )


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
    trainer_state: dict,
    *,
    is_best: bool,
    keep_last: int,
) -> Path:
    """Write one complete checkpoint, then trainer_state.json naming it, then prune old ones.

    A full disk is a UserError naming the checkpoint; the temp file is gone and the previous
    checkpoint (still the one trainer_state.json names) is untouched, so a rerun resumes from it.
    """
    run_dir = Path(run_dir)
    update = int(trainer_state["update"])
    try:
        return _save_checkpoint(run_dir, update, model, optimizer, trainer_state, is_best=is_best, keep_last=keep_last)
    except Exception as e:  # noqa: BLE001 - safetensors reports I/O errors as SafetensorError
        if is_disk_full(e):
            raise UserError(
                f"disk full while writing checkpoint update-{update:08d} in {run_dir}; free space and rerun to resume"
            ) from None
        raise


def _save_checkpoint(run_dir: Path, update: int, model, optimizer, trainer_state: dict, *, is_best: bool,
                     keep_last: int) -> Path:
    weights = weights_path(run_dir, update)
    save_weights(model, weights, metadata={"update": str(update)})
    with atomic_path(optimizer_path(run_dir, update)) as tmp:
        save_file(optimizer_tensors(optimizer, model), str(tmp), metadata={"update": str(update)})
    state = dict(trainer_state)
    state["checkpoint"] = f"{CHECKPOINT_DIR}/{weights.name}"
    state["optimizer"] = f"{CHECKPOINT_DIR}/{optimizer_path(run_dir, update).name}"
    atomic_write_json(state_path(run_dir, update), state)
    if is_best:
        save_weights(model, run_dir / BEST, metadata={"update": str(update)})
    atomic_write_json(run_dir / TRAINER_STATE, state)
    prune_checkpoints(run_dir, keep_last)
    return weights


def complete_checkpoints(run_dir: str | os.PathLike) -> list[int]:
    """Update counts of checkpoints whose weights, optimizer state and JSON all exist, ascending."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    updates = []
    for entry in directory.iterdir():
        m = _WEIGHTS_RE.match(entry.name)
        if m:
            u = int(m.group(1))
            if state_path(run_dir, u).is_file() and optimizer_path(run_dir, u).is_file():
                updates.append(u)
    return sorted(updates)


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (never the one trainer_state.json names)."""
    run_dir = Path(run_dir)
    keep = set(complete_checkpoints(run_dir)[-max(1, keep_last) :])
    named = latest_trainer_state(run_dir)
    if named is not None:
        keep.add(int(named["update"]))
    directory = run_dir / CHECKPOINT_DIR
    for entry in directory.iterdir():
        m = re.match(r"^(?:update|optimizer)-(\d{8})\.(?:safetensors|json)$", entry.name)
        if m and int(m.group(1)) not in keep:
            entry.unlink(missing_ok=True)


def latest_trainer_state(run_dir: str | os.PathLike) -> dict | None:
    """The trainer state to resume from, or None for a fresh run.

    trainer_state.json is authoritative. If it is missing (a kill between the first checkpoint's
    files and its first write), the newest complete checkpoint's own JSON is used instead.
    """
    run_dir = Path(run_dir)
    path = run_dir / TRAINER_STATE
    if path.is_file():
        state = _checked_state(read_json(path, "trainer state"), path)
        if not (run_dir / state.get("checkpoint", "")).is_file():
            raise UserError(
                f"{path} names {state.get('checkpoint')!r}, which is missing; "
                "restore it or start the run afresh in a new directory"
            )
        return state
    updates = complete_checkpoints(run_dir)
    if not updates:
        return None
    return _checked_state(read_json(state_path(run_dir, updates[-1]), "checkpoint state"), state_path(run_dir, updates[-1]))


def _checked_state(state: dict, path: Path) -> dict:
    """File names read from a trainer state must stay inside the run's checkpoints/ folder."""
    if not isinstance(state, dict) or not isinstance(state.get("update"), int):
        raise UserError(f"{path} is not a trainer state written by prlmfuse (no integer 'update'); "
                        "restore it or start the run afresh in a new directory")
    for key, pattern in _NAMED_FILE_RE.items():
        name = state.get(key)
        if not isinstance(name, str) or not pattern.match(name):
            raise UserError(f"{path}: {key} {name!r} is not a file of this run's {CHECKPOINT_DIR}/ folder; "
                            "the trainer state is corrupt, restore it or start the run afresh in a new directory")
    return state


def remove_stale_temps(run_dir: str | os.PathLike) -> list[str]:
    """Delete temp files a killed save left beside the run's files; returns their names.

    Only for the process that owns the run directory (train_run holds its lock): another
    writer's temp file would otherwise vanish under it.
    """
    run_dir = Path(run_dir)
    removed = []
    for directory in (run_dir, run_dir / CHECKPOINT_DIR):
        if directory.is_dir():
            for entry in directory.iterdir():
                if _STALE_TEMP_RE.match(entry.name) and entry.is_file():
                    entry.unlink(missing_ok=True)
                    removed.append(entry.name)
    return removed


def load_checkpoint(
    run_dir: str | os.PathLike, state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    run_dir = Path(run_dir)
    load_weights(model, run_dir / state["checkpoint"])
    if optimizer is not None:
        path = run_dir / state["optimizer"]
        try:
            tensors = load_file(str(path))
        except (FileNotFoundError, SafetensorError) as e:
            raise UserError(f"optimizer state {path} is missing or corrupt ({e}); start the run afresh") from None
        load_optimizer_tensors(optimizer, model, tensors)


def average_checkpoints(run_dir: str | os.PathLike, last: int = 5, out: str | os.PathLike | None = None) -> Path:
    """Average the weights of the newest `last` saved checkpoints into one safetensors file.

    Default output: run_dir/average-last{K}.safetensors. Its metadata lists the averaged
    checkpoints, and an existing file over the same checkpoints is reused as is.
    """
    run_dir = Path(run_dir)
    if last < 1:
        raise UserError(f"average_checkpoints: last={last}; average at least 1 checkpoint")
    updates = complete_checkpoints(run_dir)
    if not updates:
        raise UserError(f"no complete checkpoints under {run_dir / CHECKPOINT_DIR}; train the run first")
    chosen = updates[-last:]
    out = Path(out) if out is not None else run_dir / f"average-last{last}.safetensors"
    sources = json.dumps([weights_path(run_dir, u).name for u in chosen])
    if out.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(out), framework="pt") as f:
                if (f.metadata() or {}).get("averaged") == sources:
                    return out
        except SafetensorError:
            pass  # corrupt: rebuild below
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for u in chosen:
        try:
            tensors = load_file(str(weights_path(run_dir, u)))
        except SafetensorError as e:
            raise UserError(f"weights file {weights_path(run_dir, u)} is corrupt ({e}); delete that checkpoint "
                            "(its update-*.safetensors, optimizer-*.safetensors and .json) and average again") from None
        if total and set(tensors) != set(total):
            raise UserError(
                f"checkpoint {weights_path(run_dir, u)} has different tensors from the others; "
                "the run directory mixes two configurations"
            )
        for name, t in tensors.items():
            dtypes.setdefault(name, t.dtype)
            if name in total:
                total[name] += t.to(torch.float64)
            else:
                total[name] = t.to(torch.float64)
    averaged = {name: (t / len(chosen)).to(dtypes[name]).contiguous() for name, t in total.items()}
    with atomic_path(out) as tmp:
        save_file(averaged, str(tmp), metadata={"averaged": sources, "update": str(chosen[-1])})
    return out
