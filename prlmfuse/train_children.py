"""`train --jobs N`: several runs at once, each `prlmfuse train --runs NAME` in a process of its own.

The parent starts up to N children, each with cores/N threads and its output in runs/NAME/train.log,
names each run's end (finished, stopped by a signal with a resume point, killed, failed with its log's
last line), and passes a stop signal on to every child before it exits with the signal's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from prlmfuse import signals
from prlmfuse.config import PipelineConfig
from prlmfuse.errors import UserError
from prlmfuse.pipeline import _say, run_path
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (tqdm's carriage-return updates count as lines)."""
    try:
        tail = path.read_bytes()[-4096:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [x.strip() for x in tail.replace("\r", "\n").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def train_in_children(cfg: PipelineConfig, runs: list[RunConfig], parallel: int, *, resume: bool) -> list[Path]:
    """Train `parallel` runs at a time, each `prlmfuse train --runs NAME` in its own process.

    Each child gets cores/parallel threads: small models use two cores poorly, so two runs at once
    finish a grid sooner than one run with both cores. A child's output goes to runs/NAME/train.log;
    a failed run is reported with its log's last line once the others have finished.
    """
    import subprocess
    import sys
    import time

    threads = max(1, (os.cpu_count() or 1) // parallel)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TQDM_MININTERVAL="30")
    pending = list(runs)
    active: dict = {}
    failed: list[str] = []
    stopped_by: int | None = None
    try:
        # Deferred: a stop signal is recorded, never raised between a child's start and its bookkeeping.
        with signals.deferred():
            while (pending or active) and signals.received() is None:
                while pending and len(active) < parallel:
                    run = pending.pop(0)
                    out = run_path(cfg, run.name)
                    out.mkdir(parents=True, exist_ok=True)
                    log = out / rundir.TRAIN_LOG
                    cmd = [sys.executable, "-m", "prlmfuse.cli", "train", "--pipeline", str(cfg.path), "--runs",
                           run.name, "--device", cfg.device, "--precision", cfg.precision]
                    if not resume:
                        cmd.append("--fresh")
                    with open(log, "ab") as fh:
                        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=env)
                    active[proc] = (run, log, time.monotonic())
                    _say(f"train: {run.name} -> {out} (own process, {threads} thread(s); log {log})")
                time.sleep(0.5)
                for proc in [p for p in active if p.poll() is not None]:
                    _report_child(proc, *active.pop(proc), failed)
            stopped_by = signals.received()
            if stopped_by is not None:
                # Each child gets the signal (again, if the group's reached it too: a child handles one),
                # finishes its update, saves a resume point and exits; no new run starts.
                for proc in active:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(stopped_by)
                for proc in list(active):
                    _wait_or_kill(proc)
                    _report_child(proc, *active.pop(proc), failed)
    finally:
        for proc in active:  # an error of this process's own: the children resume from their last save next time
            proc.terminate()
        for proc in active:
            proc.wait()
    if stopped_by is not None:
        waiting = f"; not started: {', '.join(r.name for r in pending)}" if pending else ""
        raise signals.Stopped(stopped_by, "; ".join(failed) + waiting + "; rerun the same command to resume")
    if failed:
        raise UserError(f"{len(failed)} of {len(runs)} runs failed: " + "; ".join(failed))
    return [run_path(cfg, r.name) for r in runs]


# A stopped child finishes one update and writes its resume point; one that takes longer than this is hung.
STOP_WAIT_SECONDS = 600


def _wait_or_kill(proc) -> None:
    import subprocess

    try:
        proc.wait(timeout=STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()  # it resumes from its last checkpoint
        proc.wait()


def _report_child(proc, run: RunConfig, log: Path, started: float, failed: list[str]) -> None:
    """Say how a training child ended; a run that did not finish goes into `failed` with its cause."""
    import time

    minutes = (time.monotonic() - started) / 60
    code = proc.returncode
    if code == 0:
        _say(f"train: {run.name} finished in {minutes:.1f} min")
        return
    state = rundir.state_to_resume(log.parent)
    at = f" at update {state.update}" if state is not None else ""
    if code == signals.PREEMPTED_EXIT:
        cause = f"stopped by a signal, saved{at}"
    elif code == signals.INTERRUPTED_EXIT:
        cause = f"interrupted, saved{at}"
    elif code < 0:
        cause = f"killed by {signal.Signals(-code).name}; it resumes from its last checkpoint{at}"
    else:
        cause = f"exit {code}: {_last_line(log)}"
    failed.append(f"{run.name} ({cause}; log {log})")
    stopped = code in (signals.PREEMPTED_EXIT, signals.INTERRUPTED_EXIT)
    _say(f"train: {run.name} {'stopped' if stopped else 'FAILED'} after "
         f"{minutes:.1f} min ({cause}); see {log}")
