"""CPU time the hypervisor took from this VM (steal), for benchmarks on shared machines.

Why: on a shared VM the host can run someone else on our vCPUs (the steal column of /proc/stat),
which moves step times while the code does not change. Benchmarks record the steal fraction of
every timed window and compute ratios from the windows where it stayed low.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QUIET_STEAL = 0.05  # a timed window counts as quiet when at most 5% of the vCPU time was stolen


def _cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) jiffies summed over all vCPUs since boot; None where /proc/stat has no steal."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return values[7], sum(values)


def steal_mark() -> tuple[int, int] | None:
    """A point in time to measure steal from (pass it to `steal_since`)."""
    return _cpu_jiffies()


def steal_since(mark: tuple[int, int] | None) -> float | None:
    """Stolen share of all vCPU time since `mark` (None if unknown)."""
    end = _cpu_jiffies()
    if mark is None or end is None or end[1] <= mark[1]:
        return None
    return (end[0] - mark[0]) / (end[1] - mark[1])


def quiet_median(ratios: list[float], steals: list[float | None], limit: float = QUIET_STEAL) -> tuple[float, int]:
    """Median of the ratios whose window's steal was at most `limit` (all of them if none was, or if unknown).

    Returns (median, number of ratios it was taken over).
    """
    quiet = [r for r, s in zip(ratios, steals) if s is not None and s <= limit]
    chosen = quiet or ratios
    return float(np.median(chosen)), len(chosen)


def worst_steal(*steals: float | None) -> float | None:
    """The largest steal fraction of several windows, None if any is unknown."""
    return None if any(s is None for s in steals) else max(steals)
