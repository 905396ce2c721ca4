"""`--launcher slurm` (prlmfuse.launch tells the whole story): the tasks as ONE SLURM job array through submitit,
each array task a `ChildCommand` (a `submitit.helpers.Checkpointable` that runs the task's prlmfuse command as a
subprocess and passes submitit's USR2 on to it); the executor's parameters from the launcher section; waiting for
the array, or not (--no-wait); the refusal of a task still queued or running in an array submitted before.

PRLMFUSE_SUBMITIT_CLUSTER names another submitit executor (`local`, `debug`) for trying a launch, and for the
tests, without a cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from prlmfuse import signals
from prlmfuse.errors import UserError
from prlmfuse.launch_config import LauncherConfig
from prlmfuse.launch_tasks import STOP_WAIT_SECONDS, Outcome, Task, cause_of, report_end, require, say, settle

CLUSTER_ENV = "PRLMFUSE_SUBMITIT_CLUSTER"
# Set by ChildCommand in its child's environment: the pid of the array task's own process. A process whose parent
# has that pid is the array task's own command (its search worker keeps the array task's identity across a
# requeue); any process that command starts in turn (a search's local workers) is not.
ARRAY_TASK_ENV = "PRLMFUSE_ARRAY_TASK_PID"

try:  # submitit is optional (the `search` extra): without it the class below is a plain callable
    from submitit.helpers import Checkpointable as _Checkpointable
except ImportError:  # pragma: no cover - exercised where submitit is missing
    _Checkpointable = object


class ChildCommand(_Checkpointable):
    """One array task: a prlmfuse command run as a subprocess, its output appended to `log`.

    Checkpointable: on submitit's preemption signal (USR2) submitit calls `checkpoint()`, which passes the
    signal on to prlmfuse, waits (at most `stop_wait` seconds) for it to save a resume point and exit 75,
    and returns the same command without `--fresh` for submitit to requeue: the requeued task resumes.
    A stop that reaches prlmfuse directly (SLURM's SIGTERM at a preemption, `scancel`) ends it with 75
    too; the task then writes the same command without `--fresh` where submitit keeps its submission (what the
    requeued task runs) and asks SLURM to requeue it, which a cancelled job refuses.
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
                                          env=dict(os.environ, **self.env, **{ARRAY_TASK_ENV: str(os.getpid())}))
        try:
            while (code := self._returncode()) is None:
                time.sleep(0.5)
        finally:
            self._stop_child(signal.SIGTERM)  # this task is going away (cancelled, an error): the child saves first
        print(f"prlmfuse task: exit {code}", flush=True)
        if code == signals.PREEMPTED_EXIT and not self._checkpointed and _in_slurm_job():
            # Stopped by a signal that did not pass through submitit (SLURM's SIGTERM at a preemption): the rerun
            # resumes (submitit's own checkpoint() path rewrites its submission so; this one must too), and once
            # requeued no result is written, so the driver goes on waiting for the rerun.
            self._submit_resumed()
            if _requeue_this_task():
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
        return DelayedSubmission(self.resumed())

    def resumed(self) -> "ChildCommand":
        """The same command without --fresh: what a requeued task runs, which resumes and never starts over."""
        return ChildCommand([arg for arg in self.command if arg != "--fresh"], self.log, self.env, self.stop_wait)

    def _submit_resumed(self) -> None:
        """What submitit's own checkpoint path does (submitit.core.job_environment._checkpoint): the submission
        pickle SLURM's requeue reruns becomes the resumed command, with the time limit and the timeouts left
        that the submitted one carries."""
        from submitit.core import utils
        from submitit.core.job_environment import JobEnvironment

        try:
            path = JobEnvironment().paths.submitted_pickle
            submitted = utils.DelayedSubmission.load(path)
            resumed = utils.DelayedSubmission(self.resumed())
            resumed.set_timeout(submitted._timeout_min, submitted._timeout_countdown)
            with utils.temporary_save_path(path) as tmp:
                resumed.dump(tmp)
        except Exception as e:  # noqa: BLE001 - the requeue goes on; the rerun's --fresh then starts over
            print(f"prlmfuse task: could not write the resumed submission ({type(e).__name__}: {e})", flush=True)
            return
        print(f"prlmfuse task: the requeued task runs {' '.join(resumed.function.command)}", flush=True)

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


def _slurm_job() -> str | None:
    """The SLURM job (ARRAY_INDEX for an array task) this submitit task runs as; None outside SLURM."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else os.environ.get("SLURM_JOB_ID") or None


def _in_slurm_job() -> bool:
    return _slurm_job() is not None


def _requeue_this_task() -> bool:
    """Ask SLURM to requeue the array task this process runs in (False outside SLURM, or where SLURM refuses)."""
    job = _slurm_job()
    if not job:
        return False
    try:
        return subprocess.call(["scontrol", "requeue", job], timeout=60) == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class SlurmLauncher:
    """The tasks as one SLURM job array through submitit (see the module's docstring)."""

    def __init__(self, settings: LauncherConfig, folder: Path, cluster: str | None = None):
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
                        report_end(outcomes[i], label)
                if len(outcomes) < len(jobs):
                    time.sleep(poll)
        stopped_by = signals.received()
        if stopped_by is not None:
            running = [t.name for i, t in enumerate(tasks) if i not in outcomes]
            raise signals.Stopped(stopped_by, f"SLURM array {array} keeps running ({', '.join(running)}); "
                                  f"`scancel {array}` stops it (each task saves a resume point first); the same "
                                  "command run again once it has ended goes on from what it finished")
        return settle([outcomes[i] for i in range(len(jobs))], None, what)

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
        return Outcome(task, code, minutes, str(job.job_id), "" if code == 0 else cause_of(task, code))
