"""How much a run's dev loss still falls: its relative gain over a span of updates at each dev evaluation, and
the first evaluation where that gain drops under a threshold, the rule that fixes a budget from a baseline's
dev curve before any run it is compared with trains ("the first update count where the dev loss gains under
1% over 1,000 updates")."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.train_fused.run_dir import METRICS, read_dev_curve


@dataclass(frozen=True)
class CurvePoint:
    update: int
    loss: float
    # the loss's relative fall since `over` updates earlier (negative where it rose); None before that
    gain: float | None


@dataclass(frozen=True)
class DevCurve:
    run_dir: Path
    key: str  # the metrics.jsonl field: dev_loss (as trained) or dev_nll_loss
    over: int
    below: float  # a fraction: 0.01 is 1%
    points: list[CurvePoint]

    @property
    def flat_at(self) -> int | None:
        """The first update whose dev loss gained under `below` over the last `over` updates, if any."""
        return next((p.update for p in self.points if p.gain is not None and p.gain < self.below), None)

    def to_dict(self) -> dict:
        return {"key": self.key, "over": self.over, "below": self.below, "flat_at": self.flat_at,
                "points": [[p.update, p.loss, p.gain] for p in self.points]}


def dev_curve(run_dir: str | os.PathLike, *, over: int = 1000, below: float = 0.01, nll: bool = False) -> DevCurve:
    """The dev curve of the run in `run_dir` from its metrics.jsonl, each evaluation with its gain over the last
    `over` updates: against the loss at exactly `over` updates earlier, interpolated linearly between the two
    evaluations around that update where none was made there (dev evaluations at save steps and epoch ends
    rarely fall `over` apart)."""
    if over < 1:
        raise UserError(f"the span a gain is measured over must be at least 1 update, not {over}")
    key = "dev_nll_loss" if nll else "dev_loss"
    curve = read_dev_curve(run_dir, key)
    if not curve:
        if nll and read_dev_curve(run_dir, "dev_loss"):
            raise UserError(f"{Path(run_dir)}'s {METRICS} has dev losses but no dev NLL ({key}), as runs of "
                            "older versions do; drop --nll to read the loss it trained on")
        raise UserError(f"{Path(run_dir)} has no dev evaluation ({key}) in its {METRICS}; train it past its first "
                        "dev evaluation, or name a run directory")
    unusable = next(((update, loss) for update, loss in curve if not math.isfinite(loss) or loss <= 0), None)
    if unusable is not None:
        raise UserError(f"{Path(run_dir)}'s dev loss at update {unusable[0]:,} is {unusable[1]}, and a "
                        "relative gain needs a finite, positive loss (a run that diverged?); retrain it or name "
                        "another run")
    points = [CurvePoint(update, loss, _gain(curve, update, loss, over)) for update, loss in curve]
    return DevCurve(Path(run_dir), key, over, below, points)


def _gain(curve: list[tuple[int, float]], update: int, loss: float, over: int) -> float | None:
    earlier = _loss_at(curve, update - over)
    return None if earlier is None else (earlier - loss) / earlier


def _loss_at(curve: list[tuple[int, float]], update: int) -> float | None:
    """The dev loss at `update`: evaluated there, or interpolated between the evaluations around it."""
    for (u0, l0), (u1, l1) in zip(curve, curve[1:]):
        if u0 <= update <= u1:
            return l0 + (l1 - l0) * (update - u0) / (u1 - u0)
    return None  # before the first evaluation (`update` is always before the curve's last)
