"""The stage folders install under the prlmfuse namespace and never shadow Hugging Face's `evaluate`."""

import subprocess
import sys
from pathlib import Path

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


def test_every_package_folder_is_listed_for_installation():
    """pyproject.toml lists packages by name, so a new subpackage left out would be missing from a wheel."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(root / folder).parts
            on_disk.add(".".join((package, *relative)))
    assert on_disk <= listed, sorted(on_disk - listed)
