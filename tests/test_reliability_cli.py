"""Bad input through the real CLI: one line on stderr starting "error: ", exit status 2, no traceback.

Fast tests call the CLI entry point (`prlmfuse.cli.main`, what `python -m prlmfuse.cli` and the
`prlmfuse` script run) in-process with a real argv; the slow ones launch real processes for the
damaged-cache cases (each launch costs seconds of imports, so they are few).
pipeline.yaml syntax errors and unknown keys are covered by tests/test_config.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prlmfuse import cli

from helpers import reliability, small_runs, tiny_prlms
from helpers.reliability import assert_one_line_error, run_cli

torch.set_num_threads(1)



@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A text-corpus pipeline over a tiny BERT: data and caches built through `prlmfuse run --only ...`."""
    root = tmp_path_factory.mktemp("reliability-cli")
    small_runs.small_bible(root, train=120, dev=12, test=12)
    ckpt = small_runs.tiny_prlm(root / "bert")
    raw = root / "raw"
    pipeline = root / "pipeline.yaml"
    pipeline.write_text(textwrap.dedent(f"""\
        workdir: {root / "work"}
        data:
          kind: text
          src: en
          tgt: ja
          files: {{train_src: {raw}/train.src, train_tgt: {raw}/train.tgt, dev_src: {raw}/dev.src,
                   dev_tgt: {raw}/dev.tgt, test_src: {raw}/test.src, test_tgt: {raw}/test.tgt}}
        precision: fp32
        cache:
          dtype: float16
          checkpoints:
            - name: {ckpt}
              layers: [-2]
        train:
          defaults: {{preset: tiny, bpe_vocab: 600, max_tokens: 300, max_updates: 2, max_epochs: null,
                      save_every: 2, warmup: 4, num_workers: 0}}
          runs:
            fused:
              prlms: [{{checkpoint: {ckpt}, layer: -2}}]
        evaluate: {{beam: 1}}
        """))
    mp = pytest.MonkeyPatch()
    try:
        for stage in ("data", "cache"):
            mp.setattr(sys, "argv", ["prlmfuse", "run", str(pipeline), "--only", stage])
            cli.main()
    finally:
        mp.undo()
    caches = {p.parent.name.split("-")[0]: p.parent for p in (root / "work" / "cache").rglob("manifest.json")}
    assert sorted(caches) == ["dev", "test", "train"]
    return {"root": root, "ckpt": ckpt, "raw": raw, "pipeline": pipeline, "caches": caches}


def _text_files(tmp_path: Path, **overrides: bytes) -> list[str]:
    """`data text` arguments over small valid files, with some files' bytes replaced."""
    args = []
    for split in ("train", "dev", "test"):
        for side in ("src", "tgt"):
            path = tmp_path / f"{split}.{side}"
            path.write_bytes(overrides.get(f"{split}_{side}", b"one sentence\nanother sentence\n"))
            args += [f"--{split}-{side}", str(path)]
    return args + ["--src-lang", "en", "--tgt-lang", "ja"]


# ------------------------------------------------------------------------------------------ corpora


def test_empty_corpus(tmp_path, capsys, monkeypatch):
    result = run_cli(["data", "text", tmp_path / "c", *_text_files(tmp_path, dev_src=b"", dev_tgt=b"")],
                     capsys, monkeypatch)
    assert_one_line_error(result, "dev split is empty", "dev.src")


def test_line_count_mismatch_shows_both_counts(tmp_path, capsys, monkeypatch):
    result = run_cli(["data", "text", tmp_path / "c", *_text_files(tmp_path, train_tgt=b"a\nb\nc\n")],
                     capsys, monkeypatch)
    assert_one_line_error(result, "not line-aligned", f"{tmp_path / 'train.src'} has 2",
                          f"{tmp_path / 'train.tgt'} has 3")


def test_invalid_utf8_names_file_and_line(tmp_path, capsys, monkeypatch):
    result = run_cli(["data", "text", tmp_path / "c", *_text_files(tmp_path, test_tgt=b"fine\nbro\xffken\n")],
                     capsys, monkeypatch)
    assert_one_line_error(result, f"{tmp_path / 'test.tgt'}:2: invalid UTF-8")


def test_a_byte_order_mark_is_dropped_never_passed_on(tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(["data", "text", tmp_path / "c", *_text_files(
        tmp_path, train_src=b"\xef\xbb\xbfone sentence\nanother sentence\n")], capsys, monkeypatch)
    assert code == 0, err
    data = (tmp_path / "c" / "train.src").read_bytes()
    assert data == b"one sentence\nanother sentence\n"


@pytest.mark.parametrize("content, needle", [
    (b"one sentence\ranother sentence\r", "train.src:1:13: carriage return inside a line (CR-only line endings?)"),
    (b"one sentence\nano\x00ther sentence\n", "train.src:2:4: control character U+0000 inside a line"),
    (b"one sentence\n\x1b[1manother sentence\n", "train.src:2:1: control character U+001B inside a line"),
])
def test_cr_only_line_endings_and_control_characters_are_refused(tmp_path, capsys, monkeypatch, content, needle):
    result = run_cli(["data", "text", tmp_path / "c", *_text_files(tmp_path, train_src=content, train_tgt=content)],
                     capsys, monkeypatch)
    assert_one_line_error(result, f"{tmp_path}/{needle}")
    assert not (tmp_path / "c").exists()


def test_cache_build_reads_a_corpus_with_a_byte_order_mark_as_without(tmp_path, capsys, monkeypatch, world):
    from prlmfuse.cache_features import CacheReader

    plain = tiny_prlms.write_corpus(tmp_path / "plain.txt", ["in the beginning", "the light"])
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + Path(plain).read_bytes())
    for corpus, out in ((plain, "a"), (marked, "b")):
        code, _, err = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", corpus,
                                "--out", tmp_path / out], capsys, monkeypatch)
        assert code == 0, err
    a, b = CacheReader(tmp_path / "a"), CacheReader(tmp_path / "b")
    assert a.lengths.tolist() == b.lengths.tolist() and torch.equal(a.features(0), b.features(0))
    nul = tiny_prlms.write_corpus(tmp_path / "nul.txt", ["in the\x00 beginning"])
    result = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", nul, "--out", tmp_path / "c"],
                     capsys, monkeypatch)
    assert_one_line_error(result, f"{nul}:1:7: control character U+0000")
    assert not (tmp_path / "c").exists()


def test_missing_input_file(tmp_path, capsys, monkeypatch, world):
    result = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", tmp_path / "nope.txt",
                      "--out", tmp_path / "c"], capsys, monkeypatch)
    assert_one_line_error(result, "not found", "nope.txt")


# ------------------------------------------------------------------------------------------ cache build


def test_unknown_checkpoint(tmp_path, capsys, monkeypatch, world):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network here; fail at once
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", ["a sentence"])
    result = run_cli(["cache", "build", "--checkpoint", "no-such-org/no-such-model", "--corpus", corpus,
                      "--out", tmp_path / "c"], capsys, monkeypatch)
    assert_one_line_error(result, "unknown checkpoint 'no-such-org/no-such-model'", "minilm-l6")


@pytest.mark.parametrize("option, value, needle", [
    ("--layers", "7", "valid range is -4..3"),
    ("--layers", "-2,x", "-2,x"),
    ("--dtype", "fp8", "unknown dtype 'fp8'; valid: float16, bfloat16, float32, int8"),
    ("--backend", "lmdb", "unknown backend 'lmdb'; valid: zarr, hdf5"),
])
def test_bad_cache_options(tmp_path, capsys, monkeypatch, world, option, value, needle):
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", ["a sentence"])
    result = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", corpus, "--out", tmp_path / "c",
                      option, value], capsys, monkeypatch)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_checkpoint_directory_without_tokenizer_files(tmp_path, capsys, monkeypatch, world):
    ckpt = tmp_path / "bert"
    shutil.copytree(world["ckpt"], ckpt)
    tokenizer_files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.name.startswith("tokenizer")}
    for name in tokenizer_files:
        (ckpt / name).unlink()
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", ["in the beginning", "the light"])
    args = ["cache", "build", "--checkpoint", ckpt, "--corpus", corpus, "--out", tmp_path / "cache"]
    assert_one_line_error(run_cli(args, capsys, monkeypatch), f"checkpoint directory {ckpt} has no tokenizer files",
                          "tokenizer.save_pretrained")
    assert not (tmp_path / "cache").exists()
    # A tokenizer file that is there but unreadable fails only once the build has started ...
    (ckpt / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    for name in set(tokenizer_files) - {"tokenizer.json"}:
        (ckpt / name).write_bytes(tokenizer_files[name])
    assert_one_line_error(run_cli(args, capsys, monkeypatch), f"cannot load checkpoint '{ckpt}'")
    # ... and the fixed checkpoint (another identity, so another key) builds there, not refused.
    (ckpt / "tokenizer.json").write_bytes(tokenizer_files["tokenizer.json"])
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0 and out.startswith("built: "), err


def test_over_long_inputs_are_cut_and_counted_not_errors(tmp_path, capsys, monkeypatch, world):
    long_line = " ".join(["the light and the darkness"] * 60)  # far past the tiny BERT's 128 positions
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", ["short", long_line, "also short"])
    code, _, err = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", corpus,
                            "--out", tmp_path / "c"], capsys, monkeypatch)
    assert code == 0, err
    code, out, _ = run_cli(["cache", "inspect", tmp_path / "c", "--json"], capsys, monkeypatch)
    info = json.loads(out)
    assert code == 0 and info["truncated_sentences"] == 1 and info["truncated_tokens"] > 0
    assert info["num_sentences"] == 3


# ------------------------------------------------------------------------------------------ damaged caches


KINDS = ["flipped byte", "missing shard", "truncated manifest"]


@pytest.fixture(scope="module")
def hdf5_test_cache(world, tmp_path_factory):
    """The test sentences cached again with `--backend hdf5`, through `prlmfuse cache build` (built once)."""
    out = tmp_path_factory.mktemp("reliability-cli-hdf5") / "test-cache"
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(sys, "argv", ["prlmfuse", "cache", "build", "--checkpoint", str(world["ckpt"]), "--corpus",
                                 str(world["raw"] / "test.src"), "--out", str(out), "--layers", "-2",
                                 "--dtype", "float16", "--backend", "hdf5"])
        cli.main()
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
@pytest.mark.parametrize("kind", KINDS)
def test_cache_verify_names_the_problem(tmp_path, capsys, monkeypatch, world, request, kind, backend):
    cache = tmp_path / "cache"
    source = world["caches"]["test"] if backend == "zarr" else request.getfixturevalue("hdf5_test_cache")
    shutil.copytree(source, cache)
    assert json.loads((cache / "manifest.json").read_text())["backend"] == backend
    assert run_cli(["cache", "verify", cache], capsys, monkeypatch)[0] == 0
    needle = reliability.damage_cache(kind, cache)
    assert_one_line_error(run_cli(["cache", "verify", cache], capsys, monkeypatch), needle, str(cache))


@pytest.mark.parametrize("shards, needle", [
    ('"shard-00000.zarr"', "'shards' is not a list of shard records"),
    ("[1, 2]", "'shards' is not a list of shard records"),
    ("dict(first, num_sentences='3')", "shard 0 (shard-00000.zarr) has no valid num_sentences"),
    ("dict(first, sha256=None, num_tokens=-1)", "shard 0 (shard-00000.zarr) has no valid num_tokens, sha256"),
])
def test_a_manifest_whose_shard_list_is_malformed_while_its_key_matches(tmp_path, capsys, monkeypatch, world,
                                                                        shards, needle):
    cache = tmp_path / "cache"
    shutil.copytree(world["caches"]["test"], cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    first = manifest["shards"][0]
    manifest["shards"] = eval(shards if not shards.startswith("dict") else f"[{shards}] + manifest['shards'][1:]")
    (cache / "manifest.json").write_text(json.dumps(manifest))
    for command in ("verify", "inspect"):
        assert_one_line_error(run_cli(["cache", command, cache], capsys, monkeypatch), needle, str(cache),
                              "rebuild with --force")
    # The same build is not "cached" on the strength of the key: it resumes and rewrites the manifest.
    code, out, err = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", world["raw"] / "test.src",
                              "--out", cache, "--dtype", "float16"], capsys, monkeypatch)
    assert code == 0 and out.startswith("built: "), err
    assert run_cli(["cache", "verify", cache], capsys, monkeypatch)[0] == 0
    assert json.loads((cache / "manifest.json").read_text())["shards"][0] == first


@pytest.fixture
def damaged_train_cache(world):
    """Damage the pipeline's train cache for one test, then put the good one back."""
    train = world["caches"]["train"]
    backup = train.with_name(train.name + ".good")
    shutil.copytree(train, backup)
    yield train
    shutil.rmtree(train)
    backup.rename(train)


@pytest.mark.parametrize("kind", KINDS)
def test_train_refuses_a_damaged_cache(world, damaged_train_cache, capsys, monkeypatch, kind):
    needle = reliability.damage_cache(kind, damaged_train_cache)
    if kind == "truncated manifest":
        # damaged, not "not built": the pipeline names the file and says how to rebuild it; doing so repairs it
        needle = (f"cache {damaged_train_cache} is damaged: its manifest {damaged_train_cache / 'manifest.json'} "
                  "is truncated or unreadable (")
    result = run_cli(["train", "-p", world["pipeline"]], capsys, monkeypatch)
    line = assert_one_line_error(result, needle, str(damaged_train_cache))
    if kind == "truncated manifest":
        assert f"rerun `prlmfuse run {world['pipeline']} --only cache` to rebuild it" in line, line
        assert "not built" not in line, line
    assert not (world["root"] / "work" / "runs").exists()
    if kind == "truncated manifest":
        assert run_cli(["run", world["pipeline"], "--only", "cache"], capsys, monkeypatch)[0] == 0
        assert run_cli(["cache", "verify", damaged_train_cache], capsys, monkeypatch)[0] == 0


def test_train_says_a_cache_without_manifest_is_not_built(world, damaged_train_cache, capsys, monkeypatch):
    (damaged_train_cache / "manifest.json").unlink()  # e.g. a build killed before it finished
    result = run_cli(["train", "-p", world["pipeline"]], capsys, monkeypatch)
    assert_one_line_error(result, f"cache {damaged_train_cache} is not built; run `prlmfuse run {world['pipeline']} "
                                  "--only cache` first")
    assert not (world["root"] / "work" / "runs").exists()


@pytest.mark.parametrize("flags, resume", [([], True), (["--resume"], True), (["--fresh"], False),
                                           (["--fresh", "--resume"], True)])
def test_train_resume_and_fresh_reach_train_runs(world, capsys, monkeypatch, flags, resume):
    # Resuming itself (update count, LR schedule, data order after a kill) is tested on train_run in
    # test_reliability_train.py; here only that the CLI flags arrive.
    import prlmfuse.pipeline

    calls = []
    monkeypatch.setattr(prlmfuse.pipeline, "train_runs", lambda cfg, **kw: calls.append(kw))
    code, _, err = run_cli(["train", "-p", world["pipeline"], "--runs", "fused", *flags], capsys, monkeypatch)
    assert code == 0, err
    assert calls == [{"names": ["fused"], "resume": resume, "parallel": 1, "wait": True}]


def test_train_fresh_starts_trained_runs_over_with_jobs_too(world, tmp_path, capsys, monkeypatch):
    pipeline = tmp_path / "pipeline.yaml"
    text = world["pipeline"].read_text().replace(f"workdir: {world['root'] / 'work'}", f"workdir: {tmp_path / 'work'}")
    pipeline.write_text(text.replace("    fused:\n", "    base: {}\n    fused:\n"))
    shutil.copytree(world["root"] / "work", tmp_path / "work")
    runs = tmp_path / "work" / "runs"

    def states() -> dict:
        return {name: (runs / name / "trainer_state.json").stat().st_ino for name in ("base", "fused")}

    assert run_cli(["train", "-p", pipeline], capsys, monkeypatch)[0] == 0
    first = states()
    code, _, err = run_cli(["train", "-p", pipeline, "--fresh", "--runs", "base"], capsys, monkeypatch)
    assert code == 0 and "starting over (--fresh)" in err, err
    second = states()
    assert second["base"] != first["base"] and second["fused"] == first["fused"]
    code, _, err = run_cli(["train", "-p", pipeline, "--fresh", "--jobs", "2"], capsys, monkeypatch)
    assert code == 0, err
    third = states()
    assert all(third[name] != second[name] for name in third), (second, third)
    for name in ("base", "fused"):
        assert "starting over (--fresh)" in (runs / name / "train.log").read_text()
        assert not (runs / name / ".previous-run").exists()
        assert [p.name for p in (runs / name / "checkpoints").iterdir()] != []


def test_train_help_says_resuming_is_the_default(capsys, monkeypatch):
    code, out, _ = run_cli(["train", "--help"], capsys, monkeypatch)
    assert code == 0 and "--resume / --fresh" in out and "[default: resume]" in out, out


def test_the_docs_and_help_say_what_fresh_does(capsys, monkeypatch):
    code, out, _ = run_cli(["train", "--help"], capsys, monkeypatch)
    assert code == 0 and "start runs over" in " ".join(out.split()) and "refuses" not in out, out
    readme = " ".join((Path(__file__).parents[1] / "docs" / "troubleshooting.md").read_text().split())
    assert "`--fresh` starts each run over" in readme and "`--fresh` refuses" not in readme


def test_train_refuses_a_cache_of_another_corpus(world, damaged_train_cache, capsys, monkeypatch):
    shutil.rmtree(damaged_train_cache)
    shutil.copytree(world["caches"]["dev"], damaged_train_cache)  # a complete cache, of the dev sentences
    result = run_cli(["train", "-p", world["pipeline"]], capsys, monkeypatch)
    assert_one_line_error(result, f"cache {damaged_train_cache} was built from a different train source",
                          "rebuild the cache for this corpus")


# ------------------------------------------------------------------------------------------ evaluate / translate


def test_evaluate_a_run_directory_without_checkpoints(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "untrained"
    run_dir.mkdir()
    result = run_cli(["evaluate", "--runs", run_dir, "--out", tmp_path / "results"], capsys, monkeypatch)
    assert_one_line_error(result, f"run directory {run_dir} has no checkpoints", "train it first")
    assert not (tmp_path / "results").exists()
    text = tmp_path / "in.txt"
    text.write_text("In the beginning\n")
    result = run_cli(["translate", "--run", run_dir, "--input", text], capsys, monkeypatch)
    assert_one_line_error(result, "has no checkpoints")


def test_translate_input_that_is_not_utf8_is_one_line(tmp_path, capsys, monkeypatch):
    text = tmp_path / "latin1.txt"
    text.write_bytes("In the beginning\nCaf\u00e9 au lait\n".encode("latin-1"))
    result = run_cli(["translate", "--run", tmp_path / "run", "--input", text], capsys, monkeypatch)
    assert_one_line_error(result, f"{text}:2: invalid UTF-8 (byte 0xe9)", "re-encode the file as UTF-8")
    # stdin, through a real process
    done = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "translate", "--run", str(tmp_path / "run")],
                          input=b"\xff\xfeI\x00n\x00", capture_output=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = done.stderr.decode()
    assert done.returncode == 2 and err.startswith("error: <stdin>:1: invalid UTF-8 (byte 0xff)"), err
    assert err.count("\n") == 1 and done.stdout == b""


def test_a_file_where_a_cache_directory_is_expected(tmp_path, capsys, monkeypatch, world):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a cache\n")
    for command in (["cache", "verify", a_file], ["cache", "inspect", a_file]):
        assert_one_line_error(run_cli(command, capsys, monkeypatch), f"{a_file} is a file, not a cache directory")
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", ["in the beginning"])
    result = run_cli(["cache", "build", "--checkpoint", world["ckpt"], "--corpus", corpus, "--out", a_file],
                     capsys, monkeypatch)
    assert_one_line_error(result, f"output {a_file} is a file, not a directory")
    assert a_file.read_text() == "not a cache\n"
    # a file further up the path: the generic one-line answer, whichever command meets it
    result = run_cli(["data", "text", a_file / "corpus", *_text_files(tmp_path)], capsys, monkeypatch)
    assert_one_line_error(result, f"{a_file} is a file where a directory is expected")


# Runs prlmfuse commands in a private mount namespace: FULL is a tmpfs with room for a few pages,
# RO a read-only tmpfs. Prints, per command, its exit status, stderr and what it left in the mounts.
_FULL_AND_READ_ONLY = r"""
import json, os, subprocess, sys
args = json.loads(sys.argv[1])
for name, options in (("full", "size=8k"), ("ro", "ro,size=64k")):
    os.makedirs(args[name], exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", args[name]], check=True)
report = {}
for case, argv in args["commands"].items():
    done = subprocess.run([sys.executable, "-m", "prlmfuse.cli", *argv], capture_output=True, text=True)
    left = sorted(os.path.relpath(os.path.join(d, f), args[m]) for m in ("full", "ro")
                  for d, ds, fs in os.walk(args[m]) for f in fs + ds)
    report[case] = {"code": done.returncode, "stderr": done.stderr, "left": left}
    for m in ("full",):  # empty the full disk for the next command
        subprocess.run(["sh", "-c", f"rm -rf {args[m]}/* {args[m]}/.[!.]*"], check=False)
print(json.dumps(report))
"""


def test_a_full_disk_or_a_read_only_directory_is_one_line_and_leaves_nothing(world, tmp_path):
    from prlmfuse.corpora import load_corpus
    from prlmfuse.train_fused import train_run

    reliability.skip_without_private_mounts(tmp_path)
    corpus = load_corpus(world["root"] / "work" / "data" / "text")
    run_dir = train_run(small_runs.tiny_run("base", max_updates=2, save_every=2), corpus, [], tmp_path / "base",
                        progress=False)
    full, ro = tmp_path / "full", tmp_path / "ro"
    raw = world["raw"]
    files = [f"--{split}-{side}={raw / f'{split}.{side}'}" for split in ("train", "dev", "test") for side in ("src", "tgt")]
    commands = {
        "data full": ["data", "text", full / "mycorpus", *files, "--src-lang", "en", "--tgt-lang", "ja"],
        "evaluate full": ["evaluate", "--runs", run_dir, "--out", full / "results", "--beam", "1", "--average-last", "1"],
        "data read-only": ["data", "text", ro / "corpus", *files, "--src-lang", "en", "--tgt-lang", "ja"],
        "cache read-only": ["cache", "build", "--checkpoint", world["ckpt"], "--corpus", raw / "test.src",
                            "--out", ro / "cache"],
        "evaluate read-only": ["evaluate", "--runs", run_dir, "--out", ro / "results", "--beam", "1"],
    }
    args = {"full": str(full), "ro": str(ro), "commands": {k: [str(a) for a in v] for k, v in commands.items()}}
    done = subprocess.run(["unshare", "-Urm", sys.executable, "-c", _FULL_AND_READ_ONLY, json.dumps(args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    needles = {
        "data full": f"disk full while writing corpus mycorpus in {full}; free space and rerun to resume",
        "evaluate full": f"in {full / 'results'}; free space and rerun to resume",
        "data read-only": f"cannot write {ro / 'corpus'}",
        "cache read-only": f"cannot write {ro / 'cache'}",
        "evaluate read-only": f"cannot write {ro / 'results'}",
    }
    for case, entry in report.items():
        assert_one_line_error((entry["code"], "", entry["stderr"]), needles[case])
        # No temp file; what a stage finished before the disk filled (a hypothesis file) is whole and reused
        assert not any(Path(p).name.startswith(".") for p in entry["left"]), (case, entry)
        if case != "evaluate full":
            assert entry["left"] == [], (case, entry)
        if "read-only" in case:
            assert "Read-only file system" in entry["stderr"] and "choose a writable location" in entry["stderr"]


# ------------------------------------------------------------------------------------------ slow: real processes


def _prlmfuse(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prlmfuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_real_processes_exit_2_with_one_line(world, damaged_train_cache, tmp_path):
    caches = {}
    for kind in KINDS:
        caches[kind] = tmp_path / kind.replace(" ", "-")
        shutil.copytree(world["caches"]["test"], caches[kind])
        needle = reliability.damage_cache(kind, caches[kind])
        done = _prlmfuse("cache", "verify", caches[kind])
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and needle in done.stderr

    needle = reliability.damage_cache("flipped byte", damaged_train_cache)
    done = _prlmfuse("train", "-p", world["pipeline"])
    reliability.assert_one_line_error((done.returncode, done.stdout, done.stderr), needle)


def test_over_long_test_sentences_are_cut_and_counted_at_evaluate(world, tmp_path, capsys, monkeypatch):
    from prlmfuse.corpora import register_text
    from prlmfuse.train_fused import train_run

    raw = world["raw"]
    (tmp_path / "test.src").write_text("In the beginning.\n" + "God created the heavens and the earth " * 250 + "\n")
    (tmp_path / "test.tgt").write_text("初めに。\n神は天と地を創造された。\n")
    corpus = register_text(tmp_path / "corpus", train_src=raw / "train.src", train_tgt=raw / "train.tgt",
                           dev_src=raw / "dev.src", dev_tgt=raw / "dev.tgt", test_src=tmp_path / "test.src",
                           test_tgt=tmp_path / "test.tgt", src_lang="en", tgt_lang="ja")
    run_dir = train_run(small_runs.tiny_run("base", max_updates=2, save_every=2), corpus, [], tmp_path / "base",
                        progress=False)
    code, _, err = run_cli(["evaluate", "--runs", run_dir, "--out", tmp_path / "results", "--beam", "1",
                            "--average-last", "1"], capsys, monkeypatch)
    assert code == 0, err
    assert "base/test: 1 source line(s) longer than 1023 BPE tokens were cut" in err
    meta = json.loads((tmp_path / "results" / "hyp.base.test.json").read_text())
    assert meta["truncated_sources"] == 1
    assert len((tmp_path / "results" / "hyp.base.test.txt").read_text().splitlines()) == 2


def test_a_cache_path_that_does_not_exist_is_named_as_such(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "no-such-cache"
    for command in ("verify", "inspect"):
        assert_one_line_error(run_cli(["cache", command, missing], capsys, monkeypatch),
                              f"cache directory not found: {missing}", "check the path")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli(["cache", "verify", tmp_path / "empty"], capsys, monkeypatch),
                          f"cache manifest not found: {tmp_path / 'empty' / 'manifest.json'}")


@pytest.mark.parametrize("args", [
    ["report", "docs/results/table3/batch-1/results.json", "--out", "{bad}/merged"],
    ["evaluate", "--runs", "{tmp}/no-run", "--out", "{bad}/results"],
    ["cache", "build", "--checkpoint", "minilm-l6", "--corpus", "README.md", "--out", "{bad}/cache"],
    ["data", "bible", "{bad}/corpus"],
    ["bundle", "{bad}/bundle"],
    ["train", "average", "{tmp}", "--out", "{bad}/average.safetensors"],
    ["run", "{tmp}/pipeline.yaml"],
    ["train", "-p", "{tmp}/pipeline.yaml"],
])
def test_an_output_path_that_cannot_be_created_is_one_line(tmp_path, capsys, monkeypatch, args):
    """A path under a file (and under /proc, where nothing can be made) gets one line and exit 2, before any work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    (tmp_path / "pipeline.yaml").write_text(f"workdir: {blocker}/work\ndata: {{kind: bible}}\n"
                                            "train: {runs: {b: {max_updates: 2}}}\n")
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    for bad in (blocker, Path("/proc/prlmfuse-test")):
        filled = [a.format(bad=bad, tmp=tmp_path) for a in args]
        assert_one_line_error(run_cli(filled, capsys, monkeypatch))
    assert blocker.read_text() == "not a directory\n"
