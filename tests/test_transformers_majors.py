"""The other transformers major: caches of the three offline PrLMs built under transformers 4.x are
bit-identical to the ones this environment (transformers 5.x in CI) builds.

The 4.x environment is a venv under .venv-transformers4/ that layers transformers<5 (and the
tokenizers/huggingface-hub it needs) over this environment's packages, so it installs in seconds and
is reused by later runs. Without a package index it is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import transformers

from prlmfuse.cache_features import CacheReader

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
OTHER_MAJOR = "transformers>=4.46,<5"
ALIASES = ("minilm-l6", "e5-small-multilingual", "smollm2-135m")
SENTENCES = [
    "In the beginning was the Word, and the Word was with God.",
    "Jesus wept.",
    "And he said unto them, Go ye into all the world, and preach the gospel to every creature.",
    "東京は日本の首都です。",
]


def _python_with_transformers4() -> Path:
    """A venv whose own site-packages hold transformers 4.x, falling back to this environment's."""
    venv = REPO / ".venv-transformers4"
    python = venv / "bin" / "python"
    stamp = venv / "installed"
    if stamp.exists() and stamp.read_text() == OTHER_MAJOR:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    # addsitedir (not a bare path) so this environment's .pth files, prlmfuse's editable install among
    # them, work there too; it appends, so the venv's own transformers 4.x wins.
    Path(own_site, "_outer_environment.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-warn-conflicts", OTHER_MAJOR],
        capture_output=True, text=True)
    if install.returncode != 0:
        pytest.skip(f"cannot install {OTHER_MAJOR} (no package index?): {install.stderr.strip()[-300:]}")
    stamp.write_text(OTHER_MAJOR)
    return python


def _build(python: Path, alias: str, corpus: Path, out: Path, env: dict) -> None:
    cmd = [str(python), "-m", "prlmfuse.cli", "--quiet", "cache", "build", "--checkpoint", alias,
           "--corpus", str(corpus), "--out", str(out), "--layers", "-2,-1", "--dtype", "float32"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_caches_are_bit_identical_across_transformers_majors(tmp_path):
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("this environment already runs transformers 4.x; the other major is 5.x")
    python4 = _python_with_transformers4()
    version4 = subprocess.run([str(python4), "-c", "import transformers; print(transformers.__version__)"],
                              check=True, capture_output=True, text=True).stdout.strip()
    assert version4.startswith("4."), version4

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    env = {**os.environ, "PRLMFUSE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    for alias in ALIASES:
        _build(Path(sys.executable), alias, corpus, tmp_path / f"{alias}-5", env)
        _build(python4, alias, corpus, tmp_path / f"{alias}-4", env)
        five, four = CacheReader(tmp_path / f"{alias}-5"), CacheReader(tmp_path / f"{alias}-4")
        assert len(five) == len(four) == len(SENTENCES)
        for i in range(len(SENTENCES)):
            a, b = five.features(i).numpy(), four.features(i).numpy()
            assert a.shape == b.shape and np.array_equal(a, b), (alias, i, float(np.abs(a - b).max()))
