"""Stop signals of a shared cluster: SIGTERM and SIGUSR1 (what SLURM sends before a preemption or a
time limit) and SIGUSR2 (what submitit asks SLURM to send, `--launcher slurm`) take SIGINT's path, and
each process handles the first one it gets, once.

Outside training a stop signal raises `Stopped` in the main thread, as Ctrl-C raises KeyboardInterrupt,
so every stage unwinds through its cleanup (a cache build discards the shard it was writing, an
evaluation keeps the results of the runs it finished). Inside `deferred()` (a training loop) the
signal is only recorded: the loop finishes its update, writes a resume point and raises `Stopped`
itself. A signal sent to the whole process group (SLURM's, a terminal's) reaches the children and
loader workers too; workers ignore it (`ignore_in_worker`) and every other process handles its own
copy once, so no process counts it twice. A later signal is ignored: the first one's work finishes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


# SIGUSR2 is submitit's preemption signal (JobEnvironment.USR_SIG): SLURM sends it to every process of an
# array task's step, this one and its loader workers too, whose default action for it would be to die.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# The exit status of a command stopped by SIGTERM, SIGUSR1 or SIGUSR2 after saving what it had: "try again"
# (sysexits' EX_TEMPFAIL). A job script requeues on it; rerunning the same command resumes.
PREEMPTED_EXIT = 75
# SIGINT keeps the shell's status for Ctrl-C.
INTERRUPTED_EXIT = 130


class Stopped(BaseException):
    """A stop signal ended the command (a BaseException, like KeyboardInterrupt: no `except Exception` swallows it)."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = int(signum)
        self.detail = detail
        super().__init__(f"{signal.Signals(self.signum).name}{': ' + detail if detail else ''}")

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT if self.signum == signal.SIGINT else PREEMPTED_EXIT

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_received: int | None = None
_deferring = 0


def _handler(signum, frame) -> None:
    # Python runs handlers in the main thread, between bytecodes, possibly inside another handler or a
    # write to stderr: so no lock and no I/O here, only the first signal recorded.
    global _received
    if _received is not None:
        return
    _received = signum
    if not _deferring:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C as Python has it, for whatever handles that already
        raise Stopped(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Handle the stop signals (SIGINT, SIGTERM, SIGUSR1, SIGUSR2) while a command runs (in the main thread; elsewhere nothing
    changes), then give the previous handlers back."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    previous = {signum: signal.signal(signum, _handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received = None  # the command is over: nothing of its signal outlives it in this process


def received() -> int | None:
    """The stop signal this process got, if any."""
    return _received


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a stop signal is recorded (`received()`), not raised: the caller stops at a safe point."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def start_multiprocessing_helpers(context: str) -> None:
    """Start multiprocessing's resource tracker (and the forkserver) now, ignoring the stop signals.

    They are started on first use and would otherwise inherit the default disposition, which for
    SIGUSR1 is to die: a signal to the process group would then kill them under the loader workers.
    A disposition of SIG_IGN is inherited across fork and exec, so they keep ignoring it.
    """
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    if threading.current_thread() is not threading.main_thread():
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}
    try:
        multiprocessing.resource_tracker.ensure_running()
        if context == "forkserver":
            multiprocessing.forkserver.ensure_running()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def ignore_in_worker(_worker_id: int = 0) -> None:
    """A DataLoader worker's init: the group's stop signal is the main process's to handle, which ends its workers."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
