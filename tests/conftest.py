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

# submitit configures logging (logging.config.dictConfig) when first imported, which closes every handler
# registered so far; absl's handler (rouge-score imports absl) then closes the stream it was made with, which
# in a test is pytest's capture of an earlier test. Imported here, before any test, it finds none to close.
import submitit  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip where torch sees no GPU, so one command runs them on a GPU machine."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
