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

Nothing here imports the pipeline: the pipeline (and `search`) build the tasks and call `launch`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prlmfuse import signals
from prlmfuse.errors import UserError

logger = logging.getLogger(__name__)

LAUNCHERS = ("local", "slurm")
CLUSTER_ENV = "PRLMFUSE_SUBMITIT_CLUSTER"
# The extra that brings optuna (search) and submitit (--launcher slurm).
EXTRA_HINT = "pip install 'prlmfuse[search]' (optuna and submitit)"

try:  # submitit is optional (the `search` extra): without it the class below is a plain callable
    from submitit.helpers import Checkpointable as _Checkpointable
except ImportError:  # pragma: no cover - exercised where submitit is missing
    _Checkpointable = object


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


def _cause(task: Task, code: int) -> str:
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


def _report(outcome: Outcome, label: str) -> None:
    task, minutes = outcome.task, outcome.minutes or 0.0
    if outcome.finished:
        say(f"{label}: {task.name} finished in {minutes:.1f} min")
        return
    stopped = outcome.code in (signals.PREEMPTED_EXIT, signals.INTERRUPTED_EXIT)
    say(f"{label}: {task.name} {'stopped' if stopped else 'FAILED'} after {minutes:.1f} min ({outcome.cause}); "
        f"see {task.log}")


def _settle(outcomes: list[Outcome], stopped_by: int | None, what: str, not_started: list[Task] = ()) -> list[Outcome]:
    """Raise for the tasks that did not finish (Stopped where this process got a stop signal), else return."""
    failed = [f"{o.task.name} ({o.cause}; log {o.task.log})" for o in outcomes if o.code is not None and not o.finished]
    if stopped_by is not None:
        waiting = f"; not started: {', '.join(t.name for t in not_started)}" if not_started else ""
        raise signals.Stopped(stopped_by, "; ".join(failed) + waiting + "; rerun the same command to resume")
    if failed:
        raise UserError(f"{len(failed)} of {len(outcomes)} {what} failed: " + "; ".join(failed))
    return outcomes


def launch(tasks: list[Task], settings: "LauncherConfig", *, workdir: Path, parallel: int, wait: bool = True,
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


# A stopped child finishes one update and writes its resume point; one that takes longer than this is hung.
STOP_WAIT_SECONDS = 600


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
            cause = "" if code == 0 else _cause(task, code)
            outcome = Outcome(task, code, (time.monotonic() - started) / 60, cause=cause)
            outcomes[task] = outcome
            _report(outcome, label)

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
        return _settle([outcomes[t] for t in tasks if t in outcomes], stopped_by, what, pending)


def _wait_or_kill(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()  # it resumes from its last checkpoint
        proc.wait()


# ---------------------------------------------------------------------------- slurm (submitit)


class ChildCommand(_Checkpointable):
    """One array task: a prlmfuse command run as a subprocess, its output appended to `log`.

    Checkpointable: on submitit's preemption signal (USR2) submitit calls `checkpoint()`, which passes the
    signal on to prlmfuse, waits (at most `stop_wait` seconds) for it to save a resume point and exit 75,
    and returns the same command without `--fresh` for submitit to requeue: the requeued task resumes.
    A stop that reaches prlmfuse directly (SLURM's SIGTERM at a preemption, `scancel`) ends it with 75
    too; the task then asks SLURM to requeue it, which a cancelled job refuses.
    """

    def __init__(self, command: list[str], log: str, env: dict[str, str], stop_wait: float = STOP_WAIT_SECONDS):
        self.command = list(command)
        self.log = str(log)
        self.env = dict(env)
        self.stop_wait = float(stop_wait)
        self._proc: subprocess.Popen | None = None
        self._checkpointed = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_proc"] = None  # a process is not pickled into the requeued submission
        state["_checkpointed"] = False
        return state

    def __call__(self) -> int:
        Path(self.log).parent.mkdir(parents=True, exist_ok=True)
        print(f"prlmfuse task: {' '.join(self.command)} (log {self.log})", flush=True)
        with open(self.log, "ab") as fh:
            self._proc = subprocess.Popen(self.command, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=dict(os.environ, **self.env))
        try:
            while (code := self._returncode()) is None:
                time.sleep(0.5)
        finally:
            self._stop_child(signal.SIGTERM)  # this task is going away (cancelled, an error): the child saves first
        print(f"prlmfuse task: exit {code}", flush=True)
        if code == signals.PREEMPTED_EXIT and not self._checkpointed and _requeue_this_task():
            # Stopped by a signal that did not pass through submitit (SLURM's SIGTERM at a preemption): requeued,
            # so no result is written and the driver goes on waiting for the rerun.
            raise SystemExit(code)
        return code

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit's preemption hook: pass its signal on, let prlmfuse save, requeue the same command."""
        from submitit.core.job_environment import JobEnvironment
        from submitit.helpers import DelayedSubmission

        self._checkpointed = True
        signum = getattr(signal, "SIG" + JobEnvironment.USR_SIG, signal.SIGUSR2)
        code = self._stop_child(signum)
        print(f"prlmfuse task: {signal.Signals(signum).name} passed on; prlmfuse exited {code}; requeued", flush=True)
        resumed = [arg for arg in self.command if arg != "--fresh"]  # the rerun resumes, never starts over
        return DelayedSubmission(ChildCommand(resumed, self.log, self.env, self.stop_wait))

    def _returncode(self) -> int | None:
        """The child's exit status, or None while it runs. Reaps with waitpid, not Popen's own lock, so it can
        run inside a signal handler that interrupted the loop above."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere
            return proc.returncode if proc.returncode is not None else -1
        if pid == 0:
            return None
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode

    def _stop_child(self, signum: int) -> int | None:
        """Send `signum` to a running child and wait for it (then kill it); its exit status."""
        if self._proc is None or self._returncode() is not None:
            return None if self._proc is None else self._proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signum)
        deadline = time.monotonic() + self.stop_wait
        while (code := self._returncode()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
            while (code := self._returncode()) is None:
                time.sleep(0.1)
        return code


def _requeue_this_task() -> bool:
    """Ask SLURM to requeue the array task this process runs in (False outside SLURM, or where SLURM refuses)."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return False
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{index}" if array and index else os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        return subprocess.call(["scontrol", "requeue", job], timeout=60) == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class SlurmLauncher:
    """The tasks as one SLURM job array through submitit (see the module's docstring)."""

    def __init__(self, settings: "LauncherConfig", folder: Path, cluster: str | None = None):
        self.settings = settings
        self.folder = Path(folder)
        self.cluster = cluster or os.environ.get(CLUSTER_ENV) or "slurm"

    def at_once(self, parallel: int, tasks: list[Task]) -> int:
        """Array tasks running at once (the %N of --array): launcher.array_parallelism, else --jobs where it is
        above 1, else all of them."""
        return self.settings.array_parallelism or (parallel if parallel > 1 else len(tasks))

    def parameters(self, parallel: int, tasks: list[Task], label: str) -> dict[str, Any]:
        """AutoExecutor.update_parameters' arguments: the resources of one task and the array's throttle."""
        s = self.settings
        params: dict[str, Any] = {
            "name": f"prlmfuse-{label}",
            "timeout_min": s.time_minutes,
            "slurm_signal_delay_s": s.signal_delay_s,
            "slurm_array_parallelism": self.at_once(parallel, tasks),
            # requeue: a preempted or timed-out task goes back into the queue (submitit's checkpoint, or SLURM's own)
            "slurm_additional_parameters": {"requeue": True, **s.extra_parameters},
            "slurm_setup": [*s.setup, *(f"# task {i} ({t.name}): prlmfuse {' '.join(t.argv)}"
                                        for i, t in enumerate(tasks))],
        }
        if s.partition:
            params["slurm_partition"] = s.partition
        if s.gpus:
            params["gpus_per_node"] = s.gpus
        if s.cpus:
            params["cpus_per_task"] = s.cpus
        if s.mem_gb:
            params["mem_gb"] = s.mem_gb
        return params

    def executor(self, parallel: int, tasks: list[Task], label: str):
        submitit = require("submitit", "--launcher slurm")
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            executor = submitit.AutoExecutor(folder=str(self.folder), cluster=self.cluster,
                                             slurm_max_num_timeout=self.settings.max_timeouts)
        except RuntimeError as e:  # SlurmExecutor: no srun on PATH
            raise UserError(f"--launcher slurm: {e} (SLURM's srun, sbatch and sacct must be on PATH; "
                            f"{CLUSTER_ENV}=local runs the same array tasks on this machine)") from None
        executor.update_parameters(**self.parameters(parallel, tasks, label))
        return executor

    def launch(self, tasks: list[Task], *, parallel: int, wait: bool = True, label: str = "train",
               what: str = "runs") -> list[Outcome]:
        self._refuse_if_still_queued(tasks)
        executor = self.executor(parallel, tasks, label)
        env = {"TQDM_MININTERVAL": "30"}
        if self.settings.cpus:
            env["OMP_NUM_THREADS"] = str(self.settings.cpus)
        stop_wait = max(5.0, self.settings.signal_delay_s - 15)  # the time limit ends the task signal_delay_s later
        for task in tasks:
            task.log.parent.mkdir(parents=True, exist_ok=True)
        jobs = executor.submit_array([ChildCommand(t.command(), str(t.log), env, stop_wait) for t in tasks])
        array = str(jobs[0].job_id).split("_")[0] if jobs else "?"
        kind = "SLURM array" if self.cluster == "slurm" else f"submitit {self.cluster} jobs from"
        say(f"{label}: {len(tasks)} task(s) submitted as {kind} {array}, {self.at_once(parallel, tasks)} at once; "
            f"submitit's files in {self.folder}")
        for job, task in zip(jobs, tasks):
            target = f" -> {task.run_dir}" if task.run_dir is not None else ""
            say(f"{label}: {task.name}{target} (array task {job.job_id}; log {task.log})")
        self._record(array, tasks)
        if not wait:
            say(f"{label}: not waiting (--no-wait); `squeue -j {array}` shows the array, and the same command run "
                "again once it has ended goes on from what it finished")
            return [Outcome(task, None, None, str(job.job_id)) for task, job in zip(tasks, jobs)]
        return self._wait(tasks, jobs, array, label, what)

    def _wait(self, tasks: list[Task], jobs: list, array: str, label: str, what: str) -> list[Outcome]:
        started = time.monotonic()
        outcomes: dict[int, Outcome] = {}
        poll = float(os.environ.get("PRLMFUSE_SUBMITIT_POLL_S", "5"))
        with signals.deferred():
            while len(outcomes) < len(jobs) and signals.received() is None:
                for i, job in enumerate(jobs):
                    if i not in outcomes and job.done():
                        outcomes[i] = self._outcome(tasks[i], job, (time.monotonic() - started) / 60)
                        _report(outcomes[i], label)
                if len(outcomes) < len(jobs):
                    time.sleep(poll)
        stopped_by = signals.received()
        if stopped_by is not None:
            running = [t.name for i, t in enumerate(tasks) if i not in outcomes]
            raise signals.Stopped(stopped_by, f"SLURM array {array} keeps running ({', '.join(running)}); "
                                  f"`scancel {array}` stops it (each task saves a resume point first); the same "
                                  "command run again once it has ended goes on from what it finished")
        return _settle([outcomes[i] for i in range(len(jobs))], None, what)

    # SLURM job states of an array task that has not ended.
    NOT_ENDED = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "RESIZING", "SUSPENDED", "STOPPED")

    def _record(self, array: str, tasks: list[Task]) -> None:
        """Remember which tasks the array runs (folder/arrays.json), so that a second launch of them waits for it."""
        from prlmfuse.fileio import atomic_write_json

        path = self.folder / "arrays.json"
        entries = self._recorded()
        entries.append({"array": array, "cluster": self.cluster, "tasks": [t.name for t in tasks],
                        "logs": [str(t.log) for t in tasks], "submitted": time.time()})
        atomic_write_json(path, entries[-50:])

    def _recorded(self) -> list[dict]:
        import json

        try:
            entries = json.loads((self.folder / "arrays.json").read_text())
        except (OSError, ValueError):
            return []
        return entries if isinstance(entries, list) else []

    def _refuse_if_still_queued(self, tasks: list[Task]) -> None:
        """Two arrays must not train one run directory at once (on a cluster its lock cannot see the other node):
        a task still queued or running in an array submitted before is waited for, not submitted again."""
        if self.cluster != "slurm":
            return
        submitit = require("submitit", "--launcher slurm")
        logs = {str(t.log): t.name for t in tasks}
        for entry in reversed(self._recorded()):
            if entry.get("cluster") != "slurm":
                continue
            for index, log in enumerate(entry.get("logs", [])):
                if log not in logs:
                    continue
                job = submitit.SlurmJob(folder=self.folder, job_id=f"{entry['array']}_{index}")
                state = (job.get_info(mode="force").get("State") or "UNKNOWN").split()[0]
                if state in self.NOT_ENDED:
                    array = entry["array"]
                    raise UserError(f"{logs[log]} is still {state} in SLURM array {array} (task {index}), submitted "
                                    f"earlier; wait for it to end (`squeue -j {array}`) or stop it (`scancel {array}`: "
                                    "its tasks save first), then run the same command again")

    @staticmethod
    def _outcome(task: Task, job, minutes: float) -> Outcome:
        try:
            code = job.result()
        except Exception as e:  # the task's own failure (submitit's FailedJobError / UncompletedJobError)
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            return Outcome(task, 1, minutes, str(job.job_id), f"the array task failed: {first}; submitit's log "
                           f"{job.paths.stderr}")
        code = int(code)
        return Outcome(task, code, minutes, str(job.job_id), "" if code == 0 else _cause(task, code))


# ---------------------------------------------------------------------------- pipeline.yaml's launcher section


# sbatch options a launcher key sets, or submitit sets itself: refused in launcher.sbatch.
_SBATCH_OWNED = {
    "partition": "set launcher.partition", "p": "set launcher.partition",
    "time": "set launcher.time", "t": "set launcher.time",
    "mem": "set launcher.mem", "cpus-per-task": "set launcher.cpus", "c": "set launcher.cpus",
    "gpus-per-node": "set launcher.gpus", "gres": "set launcher.gpus",
    "array": "prlmfuse submits the array itself (launcher.array_parallelism sets its %N)",
    "signal": "submitit asks for --signal=USR2@signal_delay_s itself and requeues on USR2; set "
              "launcher.signal_delay_s",
    "output": "submitit writes its logs in launcher.folder; each task's own output goes to its log",
    "error": "submitit writes its logs in launcher.folder; each task's own output goes to its log",
    "open-mode": "submitit appends to its logs",
}


@dataclass
class LauncherConfig:
    """pipeline.yaml's `launcher:` section: where the runs of `run` and `train` and the workers of `search` run."""

    kind: str = "local"  # local | slurm (--launcher overrides it)
    partition: str | None = None
    gpus: int = 0  # GPUs per task
    cpus: int | None = None  # CPU cores per task, also its OMP threads
    mem: str | float | None = None  # memory per task: a number of GB, or "32G", "500M"
    time: int | str = 60  # time limit per task: minutes, or "HH:MM:SS", "D-HH:MM:SS"
    array_parallelism: int | None = None  # array tasks at once (--array=0-N%P); default: --jobs above 1, else all
    signal_delay_s: int = 120  # submitit's USR2 this long before the time limit
    max_timeouts: int = 10  # times a task may reach its time limit and be requeued
    sbatch: list[str] = field(default_factory=list)  # extra sbatch options, e.g. "--account=nlp", "--qos=high"
    setup: list[str] = field(default_factory=list)  # shell lines run before the tasks (module load, conda activate)
    folder: str = "slurm"  # submitit's folder (scripts, pickles, its logs), relative to the workdir
    # Set when read: the time in minutes, the memory in GB, the sbatch options as submitit's parameters.
    time_minutes: int = field(default=60, init=False)
    mem_gb: float | None = field(default=None, init=False)
    extra_parameters: dict[str, Any] = field(default_factory=dict, init=False)


_MEM_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_OPTION_RE = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(.+))?$")


def time_minutes(value: int | str) -> int | None:
    """A SLURM time limit as whole minutes (rounded up): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]; None if
    it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    m = _TIME_RE.match(str(value).strip())
    if not m:
        return None
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:
        seconds = a * 60
    return -(-seconds // 60) if seconds > 0 else None


def read_launcher(raw: Any, where, base_dir: Path) -> LauncherConfig:
    """The launcher section, every value checked where it is written (file:line:col)."""
    from prlmfuse.yaml_fields import build, check_choice

    key = ("launcher",)
    settings = build(LauncherConfig, raw, key, where, base_dir)
    check_choice(settings.kind, LAUNCHERS, key + ("kind",), where)
    for name, least in (("gpus", 0), ("cpus", 1), ("array_parallelism", 1), ("signal_delay_s", 10),
                        ("max_timeouts", 0)):
        value = getattr(settings, name)
        if value is not None and value < least:
            raise where.error(key + (name,), f"expected an integer >= {least}, got {value!r}")
    minutes = time_minutes(settings.time)
    if minutes is None:
        raise where.error(key + ("time",), f"expected minutes or HH:MM:SS / D-HH:MM:SS, got {settings.time!r}")
    settings.time_minutes = minutes
    if settings.signal_delay_s >= minutes * 60:
        raise where.error(key + ("signal_delay_s",), f"{settings.signal_delay_s} s is not shorter than the time limit "
                          f"({minutes} min); the signal must come before the end")
    if settings.mem is not None:
        if isinstance(settings.mem, float):
            gb = settings.mem
        else:
            m = _MEM_RE.match(settings.mem)
            scale = {"K": 1 / 2**20, "M": 1 / 1024, "": 1, "G": 1, "T": 1024}
            gb = float(m.group(1)) * scale[m.group(2).upper()] if m else 0
        if not gb > 0:
            raise where.error(key + ("mem",), "expected a number of GB or a size such as 32G or 500M, got "
                              f"{settings.mem!r}")
        settings.mem_gb = gb
    for i, line in enumerate(settings.sbatch):
        text = line.strip().removeprefix("#SBATCH").strip()
        m = _OPTION_RE.match(text)
        if not m:
            raise where.error(key + ("sbatch", i), f"expected an sbatch option such as --account=NAME, got {line!r}")
        option, value = m.group(1), m.group(2)
        if option in _SBATCH_OWNED:
            raise where.error(key + ("sbatch", i), f"--{option} is not set here: {_SBATCH_OWNED[option]}")
        settings.extra_parameters[option] = True if value is None else value
    if not settings.folder or "://" in settings.folder:
        raise where.error(key + ("folder",), f"expected a directory relative to the workdir, got {settings.folder!r}")
    return settings
