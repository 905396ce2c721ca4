"""What a launcher runs and how each run ended, shared by the local and the SLURM launcher: Task (a prlmfuse
command line and its log), Outcome (its exit status, and why it did not finish), the line naming each end and the
error for the tasks that did not finish. Callers import these from prlmfuse.launch; they live here so that
prlmfuse.launch_slurm uses them without importing prlmfuse.launch back."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from prlmfuse import signals
from prlmfuse.errors import UserError

logger = logging.getLogger(__name__)

# The extra that brings optuna (search) and submitit (--launcher slurm).
EXTRA_HINT = "pip install 'prlmfuse[search]' (optuna and submitit)"
# A stopped child finishes one update and writes its resume point; one that takes longer than this is hung.
STOP_WAIT_SECONDS = 600


def say(message: str) -> None:
    """A progress line, once under torchrun (the CLI shows INFO records to the user)."""
    from prlmfuse.distributed import is_main_process

    if is_main_process():
        logger.info(message)


def require(module: str, what: str):
    """The optional module `module` (optuna, submitit), or one line saying what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs {module}, which is not installed: {EXTRA_HINT}") from None


# ---------------------------------------------------------------------------- tasks and outcomes


@dataclass(frozen=True)
class Task:
    """One child's work: `prlmfuse ARGV...`, its output appended to `log`."""

    name: str  # what it does, in the lines naming its end: a run's name, "worker-2"
    argv: tuple[str, ...]  # the arguments after `prlmfuse`, e.g. ("train", "--pipeline", P, "--runs", NAME, ...)
    log: Path
    run_dir: Path | None = None  # a training run's directory: where it stopped is read from its resume point

    def command(self) -> list[str]:
        return [sys.executable, "-m", "prlmfuse.cli", *self.argv]


@dataclass
class Outcome:
    """How a task ended: its exit status (None: still queued or running, or it never started)."""

    task: Task
    code: int | None
    minutes: float | None = None
    job_id: str | None = None  # a SLURM array task, "ARRAY_INDEX"
    cause: str = ""  # why it did not finish, in words ("" when it finished)

    @property
    def finished(self) -> bool:
        return self.code == 0


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (tqdm's carriage-return updates count as lines)."""
    try:
        tail = Path(path).read_bytes()[-4096:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [x.strip() for x in tail.replace("\r", "\n").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def cause_of(task: Task, code: int) -> str:
    """Why a task with exit status `code` (not 0) did not finish, with where a training run stopped."""
    at = ""
    if task.run_dir is not None:
        from prlmfuse.train_fused import run_dir as rundir

        with contextlib.suppress(UserError):
            state = rundir.state_to_resume(task.run_dir)
            at = f" at update {state.update}" if state is not None else ""
    if code == signals.PREEMPTED_EXIT:
        return f"stopped by a signal, saved{at}"
    if code == signals.INTERRUPTED_EXIT:
        return f"interrupted, saved{at}"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}; it resumes from its last checkpoint{at}"
    return f"exit {code}: {_last_line(task.log)}"


def report_end(outcome: Outcome, label: str) -> None:
    task, minutes = outcome.task, outcome.minutes or 0.0
    if outcome.finished:
        say(f"{label}: {task.name} finished in {minutes:.1f} min")
        return
    stopped = outcome.code in (signals.PREEMPTED_EXIT, signals.INTERRUPTED_EXIT)
    say(f"{label}: {task.name} {'stopped' if stopped else 'FAILED'} after {minutes:.1f} min ({outcome.cause}); "
        f"see {task.log}")


def settle(outcomes: list[Outcome], stopped_by: int | None, what: str, not_started: list[Task] = ()) -> list[Outcome]:
    """Raise for the tasks that did not finish (Stopped where this process got a stop signal), else return."""
    failed = [f"{o.task.name} ({o.cause}; log {o.task.log})" for o in outcomes if o.code is not None and not o.finished]
    if stopped_by is not None:
        waiting = f"; not started: {', '.join(t.name for t in not_started)}" if not_started else ""
        raise signals.Stopped(stopped_by, "; ".join(failed) + waiting + "; rerun the same command to resume")
    if failed:
        raise UserError(f"{len(failed)} of {len(outcomes)} {what} failed: " + "; ".join(failed))
    return outcomes
