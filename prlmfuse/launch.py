"""One home for launching: the runs of `run` and `train`, the workers of `search`, on this machine or as a
SLURM job array, behind one interface.

    Task(name, argv, log, run_dir)      the prlmfuse command line one child runs (`prlmfuse ARGV...`) and the
                                        file its output is appended to (a run's runs/NAME/train.log)
    launch(tasks, settings, workdir=..., parallel=N, wait=True, label="train") -> list[Outcome]

`launch` names each task's start and end ("train: NAME finished in 3.1 min", "... stopped after ...
(stopped by a signal, saved at update 40)", "... FAILED after ... (exit 2: <the log's last line>)") and
returns one Outcome per task once all have ended. Where a task did not finish it raises, after the
others have ended: `signals.Stopped` (exit 75, or 130 for Ctrl-C) when this process was stopped by a
signal, else a UserError naming every task that failed.

local (`LocalLauncher`): child processes on this machine, `parallel` at a time, each with cores/parallel
    threads. A stop signal this process gets goes on to every child (each finishes its update, saves a
    resume point and exits 75); no new child starts.
slurm (`SlurmLauncher`): ONE job array through submitit (`AutoExecutor(cluster="slurm").submit_array`),
    each array task a `ChildCommand`: a `submitit.helpers.Checkpointable` that runs the same command as a
    subprocess. submitit asks SLURM for `--signal=USR2@signal_delay_s`; on USR2 its handler calls
    `ChildCommand.checkpoint()`, which passes the signal on to prlmfuse (USR2 is one of prlmfuse's stop
    signals: it saves a resume point and exits 75), waits for it, and returns a DelayedSubmission of the
    same command (without --fresh), which submitit requeues (`scontrol requeue`); the requeued task
    resumes from the resume point. `--no-wait` returns once the array is submitted.

The environment variable PRLMFUSE_SUBMITIT_CLUSTER names another submitit executor for `--launcher slurm`
(`local`: the same array tasks as processes on this machine, with submitit's own requeueing; `debug`: in
this process), for trying a launch, and for the tests, without a cluster.

Nothing here imports the pipeline: the pipeline (and `search`) build the tasks and call `launch`. This module
holds `launch` and the local launcher, and is where callers import every name of launching from;
prlmfuse.launch_tasks defines Task and Outcome, prlmfuse.launch_slurm the SLURM launcher, and
prlmfuse.launch_config pipeline.yaml's `launcher:` section.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from prlmfuse import signals
from prlmfuse.errors import UserError
from prlmfuse.launch_config import LAUNCHERS, LauncherConfig, read_launcher, time_minutes
# ChildCommand stays importable here: an array task submitted before the split unpickles prlmfuse.launch.ChildCommand.
from prlmfuse.launch_slurm import ARRAY_TASK_ENV, CLUSTER_ENV, ChildCommand, SlurmLauncher
from prlmfuse.launch_tasks import (EXTRA_HINT, STOP_WAIT_SECONDS, Outcome, Task, cause_of, report_end, require,
                                   say, settle)

# What callers import from here, wherever it is defined.
__all__ = ["ARRAY_TASK_ENV", "CLUSTER_ENV", "EXTRA_HINT", "LAUNCHERS", "STOP_WAIT_SECONDS", "ChildCommand",
           "LauncherConfig", "LocalLauncher", "Outcome", "SlurmLauncher", "Task", "launch", "read_launcher", "require",
           "say", "time_minutes"]


def launch(tasks: list[Task], settings: LauncherConfig, *, workdir: Path, parallel: int, wait: bool = True,
           label: str = "train", what: str = "runs") -> list[Outcome]:
    """Run `tasks` with the launcher `settings.kind` names: `parallel` at once (local), or as one SLURM array
    whose tasks run `settings.array_parallelism` at once (else `parallel` where it is above 1, else all). `label`
    starts each progress line,
    `what` names the tasks in the error ("2 of 3 runs failed: ...")."""
    if settings.kind == "local":
        if not wait:
            raise UserError("--no-wait needs --launcher slurm: local children end with the command that starts them")
        return LocalLauncher().launch(tasks, parallel=parallel, label=label, what=what)
    return SlurmLauncher(settings, Path(workdir) / settings.folder).launch(tasks, parallel=parallel, wait=wait,
                                                                          label=label, what=what)


# ---------------------------------------------------------------------------- local




class LocalLauncher:
    """Child processes on this machine, `parallel` at a time, each with cores/parallel threads.

    Small models use two cores poorly, so two runs at once finish a grid sooner than one run with both
    cores. A child's output goes to its task's log; a failed task is reported with its log's last line
    once the others have finished.
    """

    def launch(self, tasks: list[Task], *, parallel: int, label: str = "train", what: str = "runs") -> list[Outcome]:
        threads = max(1, (os.cpu_count() or 1) // parallel)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TQDM_MININTERVAL="30")
        pending = list(tasks)
        active: dict[subprocess.Popen, tuple[Task, float]] = {}
        outcomes: dict[Task, Outcome] = {}
        stopped_by: int | None = None

        def ended(proc: subprocess.Popen) -> None:
            task, started = active.pop(proc)
            code = proc.returncode
            cause = "" if code == 0 else cause_of(task, code)
            outcome = Outcome(task, code, (time.monotonic() - started) / 60, cause=cause)
            outcomes[task] = outcome
            report_end(outcome, label)

        try:
            # Deferred: a stop signal is recorded, never raised between a child's start and its bookkeeping.
            with signals.deferred():
                while (pending or active) and signals.received() is None:
                    while pending and len(active) < parallel:
                        task = pending.pop(0)
                        task.log.parent.mkdir(parents=True, exist_ok=True)
                        with open(task.log, "ab") as fh:
                            proc = subprocess.Popen(task.command(), stdout=fh, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, env=env)
                        active[proc] = (task, time.monotonic())
                        target = f" -> {task.run_dir}" if task.run_dir is not None else ""
                        say(f"{label}: {task.name}{target} (own process, {threads} thread(s); log {task.log})")
                    time.sleep(0.5)
                    for proc in [p for p in active if p.poll() is not None]:
                        ended(proc)
                stopped_by = signals.received()
                if stopped_by is not None:
                    # Each child gets the signal (again, if the group's reached it too: a child handles one),
                    # finishes its update, saves a resume point and exits; no new task starts.
                    for proc in active:
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(stopped_by)
                    for proc in list(active):
                        _wait_or_kill(proc)
                        ended(proc)
        finally:
            for proc in active:  # an error of this process's own: the children resume from their last save next time
                proc.terminate()
            for proc in active:
                proc.wait()
        return settle([outcomes[t] for t in tasks if t in outcomes], stopped_by, what, pending)


def _wait_or_kill(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()  # it resumes from its last checkpoint
        proc.wait()
