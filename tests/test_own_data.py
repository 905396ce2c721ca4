"""Bringing your own data: `prlmfuse data text` prints the pipeline.yaml lines that build the same
corpus, and the README's "Your own data" pipeline runs as written (only its paths pointed at tiny files)."""

from __future__ import annotations

from prlmfuse.corpora import load_corpus

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
    from prlmfuse.pipeline import ensure_data

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
