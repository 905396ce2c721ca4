"""Shared test setup: makes the builders in tests/helpers/ importable as `helpers`.

pytest runs with --import-mode=importlib (pyproject.toml), which leaves sys.path alone, so the
tests directory is added here, before any test module is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
