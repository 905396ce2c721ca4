"""Bringing your own data: `prlmfuse data text` prints the pipeline.yaml lines that build the same
corpus, and the README's "Your own data" pipeline runs as written (only its paths pointed at tiny files)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prlmfuse.corpora import load_corpus
from prlmfuse.fileio import read_lines

from helpers import small_runs
from helpers.reliability import run_cli


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _text_files(root):
    files = {}
    for split, n in (("train", 30), ("dev", 4), ("test", 4)):
        files[f"{split}_src"] = _write(root / f"{split}.en", [f"the {split} sentence number {i} ." for i in range(n)])
        files[f"{split}_tgt"] = _write(root / f"{split}.ja", [f"{split} の 文 {i} 番 。" for i in range(n)])
    return files


def test_data_text_prints_the_lines_that_build_the_same_corpus(tmp_path, capsys, monkeypatch):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import ensure_data

    files = _text_files(tmp_path / "my files")
    args = ["data", "text", tmp_path / "corpus", "--src-lang", "en", "--tgt-lang", "ja"]
    for key, path in files.items():
        args += [f"--{key.replace('_', '-')}", path]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    block = out[out.index("data:\n"):]
    assert "  kind: text\n" in block and f"    train_src: {files['train_src']}\n" in block

    # Pasted into a pipeline file elsewhere, the lines build a corpus with the same files.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pipeline.yaml").write_text("workdir: work\n" + block, encoding="utf-8")
    cfg = load_pipeline(elsewhere / "pipeline.yaml")
    built, registered = ensure_data(cfg), load_corpus(tmp_path / "corpus")
    for split in ("train", "dev", "test"):
        assert built.src_sha256(split) == registered.src_sha256(split)
        assert built.tgt_sha256(split) == registered.tgt_sha256(split)
    assert (built.src_lang, built.tgt_lang, built.task) == ("en", "ja", "translation")


README = Path(__file__).resolve().parents[1] / "README.md"
CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def _section_blocks(path: Path, heading: str) -> list[str]:
    """The YAML blocks of a markdown file's section, as written."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```yaml\n(.*?)```", text[start:end if end > 0 else len(text)], re.S)


def _readme_blocks() -> list[str]:
    """README's own-data pipeline, then docs/configuration.md's `kind: hf` data section."""
    return _section_blocks(README, "Your own data") + _section_blocks(CONFIGURATION, "Data kinds")


def _readme_pipeline(root: Path) -> Path:
    """README's own-data pipeline file beside the six files it names, with only its PrLM pointed at a
    tiny local checkpoint directory (the README says a local directory goes where the hub id is)."""
    full = _readme_blocks()[0]
    assert full.count(HUB_ID) == 2
    prlm = small_runs.tiny_prlm(root / "tiny-prlm", layers=3, width=32)
    rng = random.Random(0)
    words = "the a dog cat sees big small red house tree river near".split()
    for split, n in (("train", 30), ("dev", 4), ("test", 4)):
        pairs = [[rng.choice(words) for _ in range(rng.randint(4, 9))] for _ in range(n)]
        _write(root / "corpus" / f"{split}.en", [" ".join(p) for p in pairs])
        _write(root / "corpus" / f"{split}.de", [" ".join(reversed(p)).upper() for p in pairs])
    path = root / "pipeline.yaml"
    path.write_text(full.replace(HUB_ID, str(prlm)), encoding="utf-8")
    return path


def test_readme_own_data_pipeline_loads_and_builds_its_corpus(tmp_path):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import ensure_data
    from prlmfuse.plan import plan_lines

    cfg = load_pipeline(_readme_pipeline(tmp_path))
    assert [r.name for r in cfg.train.runs] == ["baseline", "fused", "baseline-matched"]
    assert cfg.evaluate.baseline == "baseline"
    corpus = ensure_data(cfg)
    assert read_lines(corpus.src_path("test")) == read_lines(tmp_path / "corpus" / "test.en")
    assert read_lines(corpus.tgt_path("train")) == read_lines(tmp_path / "corpus" / "train.de")
    assert any(line.startswith("train: fused") for line in plan_lines(cfg, None))


@pytest.mark.slow
def test_readme_own_data_pipeline_runs_as_written(tmp_path):
    path = _readme_pipeline(tmp_path)
    env = dict(os.environ, PRLMFUSE_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "run", "pipeline.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "work" / "my-corpus" / "results"
    rows = {r["run"]: r for r in json.loads((results / "results.json").read_text())["rows"]}
    assert set(rows) == {"baseline", "fused", "baseline-matched"} and rows["fused"]["compared_with"] == "baseline"
    assert rows["fused"]["num_sentences"] == 4 and rows["fused"]["updates"] == 20  # one batch an epoch, 20 epochs
    assert done.stdout.splitlines()[-1].startswith("plots: ")


def test_readme_hf_data_section_builds_its_corpus(tmp_path):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import ensure_data

    datasets = pytest.importorskip("datasets")
    full, hf_data = _readme_blocks()[:2]
    # The hf block stands in place of the complete pipeline's data section, as the README says.
    start = full.index("\ndata:\n")
    end = full.index("\ncache:\n")
    text = full[:start + 1] + hf_data.rstrip("\n") + full[end:]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"translation": {"en": f"sentence {i} here", "ja": f"文 {i}"}} for i in range(200)]),
        "validation": datasets.Dataset.from_list([{"translation": {"en": f"dev {i}", "ja": f"開発 {i}"}} for i in range(5)]),
    }).save_to_disk(str(tmp_path / "my-dataset"))
    (tmp_path / "pipeline.yaml").write_text(text, encoding="utf-8")
    cfg = load_pipeline(tmp_path / "pipeline.yaml")
    assert cfg.data.kind == "hf" and cfg.data.dataset == str(tmp_path / "my-dataset")
    corpus = ensure_data(cfg)
    assert read_lines(corpus.src_path("dev")) == [f"dev {i}" for i in range(5)]
    assert corpus.num_pairs("train") + corpus.num_pairs("test") == 200 and corpus.num_pairs("test") >= 1
