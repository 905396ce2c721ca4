"""pipeline.yaml's `launcher:` section, checked when the file is read: which launcher runs the runs of `run` and
`train` and the workers of `search` (local or slurm), and, for slurm, each array task's resources, time limit,
preemption signal, extra sbatch options and setup lines. Nothing here imports submitit: prlmfuse.launch_slurm
turns these settings into submitit's parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCHERS = ("local", "slurm")

# sbatch options a launcher key sets, or submitit sets itself (prlmfuse.launch_slurm's SlurmLauncher.parameters):
# refused in launcher.sbatch.
_SBATCH_OWNED = {
    "partition": "set launcher.partition", "p": "set launcher.partition",
    "time": "set launcher.time", "t": "set launcher.time",
    "mem": "set launcher.mem", "cpus-per-task": "set launcher.cpus", "c": "set launcher.cpus",
    "gpus-per-node": "set launcher.gpus", "gres": "set launcher.gpus",
    **dict.fromkeys(("array", "a"), "prlmfuse submits the array itself (launcher.array_parallelism sets its %N)"),
    "signal": "submitit asks for --signal=USR2@signal_delay_s itself and requeues on USR2; set "
              "launcher.signal_delay_s",
    **dict.fromkeys(("output", "o", "error", "e"), "submitit writes its logs in launcher.folder; each task's own "
                    "output goes to its log"),
    "open-mode": "submitit appends to its logs",
    "no-requeue": "prlmfuse asks for --requeue: a preempted or timed-out task goes back into the queue and resumes",
    "job-name": "prlmfuse names the array (prlmfuse-train, prlmfuse-search)",
    "J": "prlmfuse names the array (prlmfuse-train, prlmfuse-search)",
    **dict.fromkeys(("gpus", "G", "gpus-per-task", "gpus-per-socket"), "set launcher.gpus (GPUs per task)"),
    **dict.fromkeys(("nodes", "N", "ntasks", "n", "ntasks-per-node"),
                    "submitit runs each array task as one process on one node"),
    **dict.fromkeys(("mem-per-cpu", "mem-per-gpu"), "set launcher.mem (the memory of each task)"),
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
# A short option (-J NAME, -G2): refused where it is one of _SBATCH_OWNED's, else written the long way.
_SHORT_RE = re.compile(r"^-([A-Za-z])(?:[= ]?(.+))?$")


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


def _sexagesimal_seconds(settings: LauncherConfig, key: tuple, where) -> None:
    """An unquoted `time: 1:00:00` (or `30:00`): PyYAML (YAML 1.1) reads it as the base-60 integer 3600 (1800),
    the time in seconds of SLURM's HH:MM:SS (MM:SS). Written so (a plain scalar with ':'), it is kept as that
    text, which time_minutes reads as SLURM does; a plain integer stays minutes."""
    written = getattr(where, "plain", {}).get(key + ("time",))
    if isinstance(settings.time, int) and not isinstance(settings.time, bool) and written and ":" in written:
        settings.time = written.strip().replace("_", "")


def read_launcher(raw: Any, where, base_dir: Path) -> LauncherConfig:
    """The launcher section, every value checked where it is written (file:line:col)."""
    from prlmfuse.yaml_fields import build, check_choice

    key = ("launcher",)
    settings = build(LauncherConfig, raw, key, where, base_dir)
    _sexagesimal_seconds(settings, key, where)
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
        short = _SHORT_RE.match(text) if not m else None
        if short and short.group(1) in _SBATCH_OWNED:
            letter = short.group(1)
            raise where.error(key + ("sbatch", i), f"-{letter} is not set here: {_SBATCH_OWNED[letter]}")
        if not m:
            raise where.error(key + ("sbatch", i), f"expected an sbatch option such as --account=NAME, got {line!r}")
        option, value = m.group(1), m.group(2)
        if option in _SBATCH_OWNED:
            raise where.error(key + ("sbatch", i), f"--{option} is not set here: {_SBATCH_OWNED[option]}")
        settings.extra_parameters[option] = True if value is None else value
    if not settings.folder or "://" in settings.folder:
        raise where.error(key + ("folder",), f"expected a directory relative to the workdir, got {settings.folder!r}")
    return settings
