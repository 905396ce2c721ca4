"""Keeping a run directory whole: its lock (one trainer; an averager waits), the run a `--fresh` start sets aside
until the new one saves, and the temp files a killed save leaves behind."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.fileio import fsync_dir, pid_lock
from prlmfuse.train_fused.run_dir import (
    CHECKPOINT_DIR, LOCK, PREVIOUS_RUN, RESUME_DIR, TRAIN_LOG, TRAINER_STATE, complete_checkpoints, state_to_resume,
)

logger = logging.getLogger(__name__)

# atomic_path's temp names (".<final name>.<random>.tmp") of the files training and averaging write:
# what a kill -9 mid-save leaves behind (both write under the run directory's lock).
_STALE_TEMP_RE = re.compile(r"^\.(update-\d{8}\.(safetensors|json)|optimizer-\d{8}\.safetensors|"
                            r"trainer_state\.json|state\.json|best\.safetensors|run\.json|bpe\.json|metrics\.jsonl|"
                            r"average-(last|epochs)\d+(-at\d+)?\.safetensors)\..+\.tmp$"
                            # safetensors' save_file writes through a Rust tempfile (".tmp" + 6 characters)
                            # in the target's folder, so a kill mid-save leaves one of those too.
                            r"|^\.tmp[A-Za-z0-9]{6}$")


def training_lock(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """One training process per run directory: a second one would interleave checkpoints."""
    return _run_dir_lock(run_dir, "wait for it to finish (a rerun then resumes or finds the run done) or choose "
                         "another directory")


def averaging_lock(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Writing an average into (or from) a run directory: never while a trainer writes and prunes its
    checkpoints (refused), one averager at a time (the second waits)."""
    return _run_dir_lock(run_dir, "average or evaluate it once training has finished (or stop it: a rerun resumes)",
                         purpose=_AVERAGING)


_AVERAGING = "averaging"


def _run_dir_lock(run_dir: Path, if_training: str, purpose: str = "") -> contextlib.AbstractContextManager[None]:
    """The run directory's lock: a holder that is averaging is waited for (seconds), a trainer refuses."""

    def wait_or_refuse(holder: str) -> None:
        pid, _, held_for = holder.partition(" ")
        if held_for == _AVERAGING:
            logger.info("%s: waiting for pid %s to finish averaging checkpoints", run_dir, pid)
            return
        raise UserError(f"{run_dir} is being trained by another process (pid {pid}); {if_training}")

    return pid_lock(Path(run_dir) / LOCK, when_held=wait_or_refuse, purpose=purpose)


def _has_resume_point(run_dir: Path) -> bool:
    """A complete resume point: the fresh run it belongs to has saved, as a checkpoint would say."""
    try:
        state = state_to_resume(run_dir)
    except UserError:
        return False
    return state is not None and state.checkpoint.startswith(f"{RESUME_DIR}/")


def _run_files(run_dir: Path) -> list[Path]:
    """What a run consists of: everything in its directory but the lock, a training child's log
    (being written by this very process under --jobs) and a run set aside."""
    keep = {LOCK, TRAIN_LOG, PREVIOUS_RUN}
    return [entry for entry in run_dir.iterdir() if entry.name not in keep] if run_dir.is_dir() else []


def _remove(entries: list[Path]) -> None:
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def settle_previous_run(run_dir: str | os.PathLike, *, resume: bool) -> None:
    """Before training starts (under `training_lock`): resolve a run an earlier `--fresh` set aside.

    If the fresh run saved a checkpoint, the old one is deleted. If it never did, resuming brings
    the old run back (nothing a fresh start left behind is worth more than it); `--fresh` again
    keeps it aside and clears the unsaved attempt.
    """
    run_dir = Path(run_dir)
    previous = run_dir / PREVIOUS_RUN
    if not previous.is_dir():
        return
    if (run_dir / TRAINER_STATE).is_file() or complete_checkpoints(run_dir) or _has_resume_point(run_dir):
        shutil.rmtree(previous)
        return
    _remove(_run_files(run_dir))
    if resume:
        for entry in previous.iterdir():
            os.replace(entry, run_dir / entry.name)
        previous.rmdir()
        fsync_dir(run_dir)
        logger.info("%s: the fresh start never saved a checkpoint; resuming the run it was to replace", run_dir)


def set_aside_for_fresh_start(run_dir: str | os.PathLike) -> None:
    """`train --fresh` on a run directory with checkpoints: move the old run into PREVIOUS_RUN; it is
    deleted only once the new run has saved its first checkpoint (discard_previous_run), so a fresh
    start killed early loses nothing."""
    run_dir = Path(run_dir)
    previous = run_dir / PREVIOUS_RUN
    previous.mkdir()
    for entry in _run_files(run_dir):
        os.replace(entry, previous / entry.name)
    fsync_dir(previous)
    fsync_dir(run_dir)
    logger.info("%s: starting over (--fresh); the previous run is kept in %s until the first checkpoint",
                run_dir, previous)


def discard_previous_run(run_dir: str | os.PathLike) -> None:
    """The new run has a checkpoint of its own: the run it replaced goes."""
    previous = Path(run_dir) / PREVIOUS_RUN
    if previous.is_dir():
        shutil.rmtree(previous)


def remove_stale_temps(run_dir: str | os.PathLike) -> list[str]:
    """Delete temp files a killed save left beside the run's files; returns their names.

    Only for the process that owns the run directory (it holds `training_lock`): another
    writer's temp file would otherwise vanish under it.
    """
    run_dir = Path(run_dir)
    removed = []
    for directory in (run_dir, run_dir / CHECKPOINT_DIR, run_dir / RESUME_DIR):
        if directory.is_dir():
            for entry in directory.iterdir():
                if _STALE_TEMP_RE.match(entry.name) and entry.is_file():
                    entry.unlink(missing_ok=True)
                    removed.append(entry.name)
    return removed
