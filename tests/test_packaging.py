"""The stage folders install under the prlmfuse namespace and never shadow Hugging Face's `evaluate`."""

import subprocess
import sys

import pytest


def test_stage_packages_live_under_prlmfuse_and_hf_evaluate_still_imports(tmp_path):
    pytest.importorskip("evaluate", reason="Hugging Face evaluate is in the [test] extra")
    # A fresh interpreter in an unrelated directory sees only what is installed.
    code = (
        "import evaluate, prlmfuse.evaluate, prlmfuse.cache_features, prlmfuse.train_fused\n"
        "assert hasattr(evaluate, 'load'), evaluate.__file__\n"
        "assert 'site-packages' in evaluate.__file__, evaluate.__file__\n"
        "assert prlmfuse.evaluate.__name__ == 'prlmfuse.evaluate'\n"
        "import importlib.util\n"
        "for top in ('cache_features', 'train_fused'):\n"
        "    assert importlib.util.find_spec(top) is None, top\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
