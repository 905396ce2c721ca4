"""A system over its seeds: a run name without the `.seed-N` a seed grid adds is its system, and each system gets
the mean and sample standard deviation of its scores, and of its Δ against its baseline or a run named with
`report --against`, one row per seed."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field

from prlmfuse.evaluate.results import SIGNIFICANCE, RunResult

SEED_SUFFIX = re.compile(r"\.seed-[^.]+")
FILE_LABEL = re.compile(r" \[[^\]]*\]$")


@dataclass
class SystemSummary:
    """One system over its seeds on one test set: mean and sample standard deviation."""

    system: str
    test_set: str
    runs: list[str]
    metric: str
    mean: float
    sd: float
    chrf_mean: float
    chrf_sd: float
    delta_mean: float | None = None  # of Δ against each seed's own baseline
    delta_sd: float | None = None
    significant: int = 0  # seeds ahead of their baseline with p < SIGNIFICANCE
    compared: int = 0  # seeds with a Δ
    left_out: dict[str, str] = field(default_factory=dict)  # run -> the run of its seed that counts instead


@dataclass
class AgainstSummary:
    """One system against a run named with --against, over the seeds that count for it (one row per seed)."""

    system: str
    test_set: str
    against: str
    runs: list[str]  # this system's rows that were compared, one per seed
    metric: str
    delta_mean: float
    delta_sd: float
    ahead: int  # seeds ahead of the compared run with p < SIGNIFICANCE
    behind: int  # seeds behind it with p < SIGNIFICANCE


def system_of(run: str) -> str:
    """The system a run belongs to: its name without the `.seed-N` a seed grid adds or the `[file]` a merge adds."""
    return SEED_SUFFIX.sub("", FILE_LABEL.sub("", run))


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def systems_over_seeds(rows: list[RunResult], file_order: dict[str, int]) -> list[SystemSummary]:
    """Each system's mean and sd over its seeds, one row per seed: where a seed has several rows (a run decoded
    again with other hypotheses, or batches that each trained it), the one from the earliest file counts."""
    out = []
    for split in dict.fromkeys(r.test_set for r in rows):
        for system in dict.fromkeys(system_of(r.run) for r in rows if r.test_set == split):
            candidates = [r for r in rows if r.test_set == split and system_of(r.run) == system]
            counted: dict[object, RunResult] = {}  # seed -> its row that counts
            for r in sorted(candidates, key=lambda r: file_order[r.run]):
                counted.setdefault(r.seed if r.seed is not None else r.run, r)
            counting = {c.run for c in counted.values()}
            group = [r for r in candidates if r.run in counting]
            metric = group[0].main_metric
            mean, sd = mean_sd([getattr(r, metric) for r in group])
            chrf_mean, chrf_sd = mean_sd([r.chrf for r in group])
            # Only a comparison with another system counts: an evaluation that named one seed's baseline
            # also compares the baseline's other seeds with it, which measures seed spread, not a gain.
            against_other = [r for r in group if metric in r.delta and r.compared_with
                             and system_of(r.compared_with) != system]
            deltas = [r.delta[metric] for r in against_other]
            ahead, _ = _significant([(r.delta[metric], r.p_value.get(metric, 1.0)) for r in against_other])
            summary = SystemSummary(system, split, [r.run for r in group], metric, mean, sd, chrf_mean, chrf_sd,
                                    compared=len(deltas), significant=ahead,
                                    left_out={r.run: counted[r.seed].run for r in candidates if r.run not in counting})
            if deltas:
                summary.delta_mean, summary.delta_sd = mean_sd(deltas)
            out.append(summary)
    return out


def against_over_seeds(systems: list[SystemSummary], compared: list[dict],
                       seed_of: dict[str, int | None]) -> list[AgainstSummary]:
    """Each system's Δ against each --against run over the seeds that count for it. Only a comparison with another
    system's run of the same seed counts: across systems, as over the baselines, and within a seed, since a row whose
    seed the compared system lacks is compared with another seed's run."""
    out = []
    for name in dict.fromkeys(c["against"] for c in compared):
        for m in systems:
            counted = [c for c in compared if c["against"] == name and c["test_set"] == m.test_set
                       and c["run"] in m.runs and system_of(c["against_run"]) != m.system
                       and seed_of[c["run"]] == seed_of[c["against_run"]] and m.metric in c["delta"]]
            if not counted:
                continue
            pairs = [(c["delta"][m.metric], c["p_value"][m.metric]) for c in counted]
            mean, sd = mean_sd([d for d, _ in pairs])
            ahead, behind = _significant(pairs)
            out.append(AgainstSummary(m.system, m.test_set, name, [c["run"] for c in counted], m.metric, mean, sd,
                                      ahead=ahead, behind=behind))
    return out


def _significant(pairs: list[tuple[float, float]]) -> tuple[int, int]:
    """Of (Δ, p) pairs, how many are ahead and how many behind with p < SIGNIFICANCE."""
    return (sum(1 for d, p in pairs if d > 0 and p < SIGNIFICANCE),
            sum(1 for d, p in pairs if d < 0 and p < SIGNIFICANCE))
