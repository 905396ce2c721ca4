"""bench/_steal.py: steal accounting and the quiet-round median the benchmarks report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_steal", Path(__file__).parents[1] / "bench" / "_steal.py")
steal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steal)


def test_quiet_median_uses_only_quiet_rounds():
    ratios = [1.10, 1.60, 1.12, 3.00, 1.14]
    steals = [0.01, 0.30, 0.02, 0.55, 0.00]
    assert steal.quiet_median(ratios, steals) == (pytest.approx(1.12), 3)


def test_quiet_median_falls_back_to_all_rounds():
    assert steal.quiet_median([1.0, 2.0, 4.0], [0.2, None, 0.3]) == (2.0, 3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_steal_fraction_is_a_fraction():
    mark = steal.steal_mark()
    sum(i * i for i in range(200_000))  # let the jiffy counters move
    fraction = steal.steal_since(mark)
    assert fraction is None or 0.0 <= fraction <= 1.0
