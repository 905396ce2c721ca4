"""A run's weights as decoding reads them: one checkpoint, the best one, or an average of the newest.

File names are train_fused.run_dir's; this module loads and averages the files it names.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file

from prlmfuse.errors import UserError
from prlmfuse.fileio import FileDigests, atomic_path
from prlmfuse.train_fused import run_dir as rd
from prlmfuse.train_fused.bpe import BPE
from prlmfuse.train_fused.modeling import FusedTransformer, ModelConfig
from prlmfuse.train_fused.run_dir_upkeep import averaging_lock

WEIGHTS_CHOICES = ("best", "last", "average")


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


def average_checkpoints(
    run_dir: str | os.PathLike, last: int = 5, out: str | os.PathLike | None = None, *, average: str = "saves",
    at_update: int | None = None,
) -> Path:
    """Average the weights of the newest `last` checkpoints into one safetensors file.

    average: "saves" takes the newest saves, "epochs" the newest epoch-end saves (fewer if fewer exist).
    at_update: the newest of the run as it was at that update instead, a budget end it trained on past
    (`run_dir.budget_saves`).
    Default output: run_dir/average-last{K}.safetensors (saves) or average-epochs{K}.safetensors, with
    -at{U} before the suffix for at_update U.
    Its metadata lists the averaged checkpoints with their sha256, and an existing file over exactly
    those files is reused as is (a run retrained in place writes checkpoints of the same names with
    other weights). Done under the run directory's lock (averaging_lock): a trainer pruning
    checkpoints meanwhile is refused.
    """
    if not Path(run_dir).is_dir():
        raise UserError(f"no complete checkpoints under {Path(run_dir) / rd.CHECKPOINT_DIR}; train the run first")
    try:
        with averaging_lock(Path(run_dir)):
            return _average_checkpoints(run_dir, last, out, average, at_update)
    except OSError as e:
        # A run directory this process may not write (shared, read-only) still serves an average made before.
        found = (_average_checkpoints(run_dir, last, out, average, at_update, reuse_only=True)
                 if e.errno in _NOT_WRITABLE else None)
        if found is None:
            raise
        return found


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _average_checkpoints(run_dir: str | os.PathLike, last: int, out: str | os.PathLike | None, average: str,
                         at_update: int | None = None, *, reuse_only: bool = False) -> Path | None:
    run_dir = Path(run_dir)
    if last < 1:
        raise UserError(f"average_checkpoints: last={last}; average at least 1 checkpoint")
    if at_update is None:
        updates = rd.averageable_checkpoints(run_dir, average)
        if not updates:
            raise UserError(f"no complete checkpoints under {run_dir / rd.CHECKPOINT_DIR}; train the run first")
        chosen = [rd.weights_path(run_dir, u) for u in updates[-last:]]
    else:
        chosen = rd.budget_saves(run_dir, at_update, average)[-last:]
    at = "" if at_update is None else f"-at{at_update}"
    default_name = f"average-epochs{last}{at}.safetensors" if average == "epochs" else f"average-last{last}{at}.safetensors"
    out = Path(out) if out is not None else run_dir / default_name
    digests = FileDigests()
    sources = json.dumps([[path.name, digests.sha256(path)] for path in chosen])
    digests.save()
    if out.is_file():
        try:
            with safe_open(str(out), framework="pt") as f:
                if (f.metadata() or {}).get("averaged") == sources:
                    return out
        except SafetensorError:
            pass  # corrupt: rebuild below
    if reuse_only:
        return None
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path in chosen:
        try:
            tensors = load_file(str(path))
        except SafetensorError as e:
            raise UserError(f"weights file {path} is corrupt ({e}); delete that checkpoint "
                            "(its update-*.safetensors, optimizer-*.safetensors and .json) and average again") from None
        if total and set(tensors) != set(total):
            raise UserError(
                f"checkpoint {path} has different tensors from the others; "
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
        save_file(averaged, str(tmp), metadata={"averaged": sources, "update": str(rd.checkpoint_file_update(chosen[-1].name))})
    return out


def load_run(
    run_dir: str | os.PathLike, weights: str = "average", *, last: int = 5, average: str = "saves",
    at_update: int | None = None,
) -> tuple[FusedTransformer, BPE, dict]:
    """(model in eval mode with the chosen weights, the run's BPE, run.json + "weights" path).

    weights: "best" (lowest dev loss), "last" (newest checkpoint) or "average" (of the last `last`
    saves, or epoch-end saves for average="epochs"; up to `at_update`, a budget end, where given).
    """
    run_dir = Path(run_dir)
    if weights not in WEIGHTS_CHOICES:
        raise UserError(f"weights={weights!r}: choose best, last or average")
    info = rd.read_run_info(run_dir)
    bpe = BPE.load(run_dir / rd.BPE_JSON)
    model = FusedTransformer(ModelConfig.from_dict(info["model"]))
    if weights == "best":
        path = run_dir / rd.BEST
    elif weights == "last":
        state = rd.latest_trainer_state(run_dir)
        if state is None:
            raise UserError(f"{run_dir} has no checkpoint yet; train the run first")
        path = run_dir / state.checkpoint
    else:
        path = average_checkpoints(run_dir, last=last, average=average, at_update=at_update)
    load_weights(model, path)
    model.eval()
    info = dict(info)
    info["weights"] = str(path)
    return model, bpe, info
