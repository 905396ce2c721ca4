"""The CLI's surface through the real entry point: every command's --help, `checkpoints list`,
`checkpoints prepare` with a bad alias, and `data bible` end to end (about 2 s on the whole corpus)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from prlmfuse import cli

from helpers.reliability import assert_one_line_error, run_cli

ALIASES = ("minilm-l6", "e5-small-multilingual", "smollm2-135m")


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """Never touch the user's ~/.cache/prlmfuse, and never reach the hub."""
    monkeypatch.setenv("PRLMFUSE_HOME", str(tmp_path / "prlmfuse_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of the group, walked recursively (new commands are covered)."""
    paths = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        paths.append((*prefix, name))
        if isinstance(command, click.Group):
            paths += _command_paths(command, (*prefix, name))
    return paths


COMMAND_PATHS = [()] + _command_paths(cli.cli)


def test_walk_finds_the_known_commands():
    names = {" ".join(p) for p in COMMAND_PATHS}
    for expected in ("data bible", "data text", "checkpoints list", "checkpoints prepare", "cache build",
                     "cache verify", "cache inspect", "train", "train average", "evaluate", "translate", "run"):
        assert expected in names


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=lambda p: " ".join(p) or "prlmfuse")
def test_help_works_on_every_command(path):
    result = CliRunner().invoke(cli.cli, [*path, "--help"], prog_name="prlmfuse")
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert result.output.startswith(f"Usage: {' '.join(('prlmfuse', *path))}")
    assert "--help" in result.output


@pytest.mark.parametrize("path", COMMAND_PATHS[1:], ids=lambda p: " ".join(p))
def test_every_option_says_what_it_takes(path):
    command = cli.cli
    for name in path:
        command = command.get_command(click.Context(command), name)
    bare = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not p.help]
    assert not bare, f"options without a help text: {bare}"
    if path[0] not in ("run", "train", "search") or path == ("train", "average"):
        # Only run, train and search read a pipeline file whose `device` an option could override.
        assert "pipeline file" not in CliRunner().invoke(cli.cli, [*path, "--help"]).output


@pytest.mark.parametrize("args, option", [
    (["train", "average", ".", "--last", "0"], "--last"),
    (["evaluate", "--runs", ".", "--out", "o", "--average-last", "-1"], "--average-last"),
    (["translate", "--run", ".", "--average-last", "-2"], "--average-last"),
])
def test_counts_below_their_least_are_refused_by_option_name(args, option, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run_cli(args, capsys, monkeypatch), f"Invalid value for '{option}'")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [["run", "--dry-run"], ["run", "--only", "train"], ["train"]])
def test_the_shipped_demo_works_in_the_current_directory(command, tmp_path, capsys, monkeypatch):
    """With no ./pipeline.yaml the packaged demo runs, its workdir under the current directory, never inside
    the installed package."""
    monkeypatch.chdir(tmp_path)
    package = Path(cli.__file__).parent
    before = sorted(p.name for p in package.iterdir())
    code, out, err = run_cli(command, capsys, monkeypatch)
    if command[-1] == "--dry-run":
        assert code == 0, err
        assert f"(workdir {tmp_path / 'work' / 'demo'})" in out.splitlines()[0]
    else:  # no corpus there yet: refused before any work, naming where it looked
        assert_one_line_error((code, out, err), f"no corpus in {tmp_path / 'work' / 'demo'}")
    assert sorted(p.name for p in package.iterdir()) == before


def test_run_names_after_runs_without_a_pipeline_file_first_say_how_to_write_them(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipeline.yaml").write_text("train: {runs: {a: {max_updates: 1}, b: {max_updates: 1}, c: {max_updates: 1}}}\n")
    assert_one_line_error(run_cli(["run", "--runs", "a", "b", "c", "--dry-run"], capsys, monkeypatch),
                          "pipeline file not found: b;", "`prlmfuse run pipeline.yaml --runs a b c`", "`--runs a,b,c`")
    code, out, err = run_cli(["run", "--runs", "a,b", "--dry-run"], capsys, monkeypatch)
    assert code == 0 and "train: a " in out and "train: b " in out and "train: c " not in out, err
    assert_one_line_error(run_cli(["run", "absent.yaml"], capsys, monkeypatch), "pipeline file not found: absent.yaml")


def test_checkpoints_list_shows_headers_and_aliases(capsys, monkeypatch):
    code, out, err = run_cli(["checkpoints", "list"], capsys, monkeypatch)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["alias", "prepared", "family", "layers", "width", "package"]
    assert [line.split()[0] for line in lines[1:]] == list(ALIASES)


def test_checkpoints_prepare_unknown_alias_lists_all_aliases(capsys, monkeypatch):
    result = run_cli(["checkpoints", "prepare", "no-such-model"], capsys, monkeypatch)
    assert_one_line_error(result, "no-such-model", *ALIASES)


def test_data_bible_through_the_cli(tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "en-ja"
    code, out, err = run_cli(["data", "bible", "--src", "en", "--tgt", "ja", out_dir], capsys, monkeypatch)
    assert code == 0, err
    assert "corpus bible-en-ja (translation, en->ja)" in out
    meta = json.loads((out_dir / "corpus.json").read_text(encoding="utf-8"))
    assert (meta["src_lang"], meta["tgt_lang"], meta["task"]) == ("en", "ja", "translation")
    assert sorted(meta["splits"]) == ["dev", "test", "train"]
    for split, sides in meta["splits"].items():
        counts = []
        for side in ("src", "tgt"):
            path = out_dir / f"{split}.{side}"
            assert sides[side]["file"] == path.name
            data = path.read_bytes()
            lines = data.decode("utf-8").splitlines()
            assert all(lines), (split, side)
            assert sides[side]["lines"] == len(lines)
            assert sides[side]["sha256"] == hashlib.sha256(data).hexdigest()
            counts.append(len(lines))
        assert counts[0] == counts[1], split  # line-aligned
        assert f"{split:<5} {counts[0]:>8} pairs" in out
    assert meta["splits"]["test"]["src"]["lines"] == 678  # the verses of Mark
    test_src = (out_dir / "test.src").read_text(encoding="utf-8").splitlines()
    assert test_src[0] == "The beginning of the Gospel of Jesus Christ, the Son of God."


@pytest.mark.parametrize("flags, level", [((), logging.INFO), (("--quiet",), logging.WARNING),
                                          (("-q",), logging.WARNING), (("--verbose",), logging.DEBUG)])
def test_library_log_records_reach_stderr_at_the_chosen_level(flags, level, capsys):
    stage = logging.getLogger("prlmfuse.pipeline")  # any library module's logger
    with cli.logging_to_stderr():  # what main() wraps every command in
        cli.cli.main([*flags, "checkpoints", "list"], prog_name="prlmfuse", standalone_mode=False)
        stage.debug("a debug line")
        stage.info("an info line")
        stage.warning("a warning line")
    out, err = capsys.readouterr()
    assert "minilm-l6" in out
    expected = ["a debug line"] * (level <= logging.DEBUG) + ["an info line"] * (level <= logging.INFO)
    assert err.splitlines() == [*expected, "warning: a warning line"]
    # Afterwards the records go back to where they went before the command.
    assert not logging.getLogger("prlmfuse").handlers and logging.getLogger("prlmfuse").level == logging.NOTSET


def test_quiet_and_verbose_together_is_a_one_line_error(capsys, monkeypatch):
    assert_one_line_error(run_cli(["--quiet", "--verbose", "checkpoints", "list"], capsys, monkeypatch),
                          "--quiet", "--verbose")


@pytest.mark.parametrize("command", [["train"], ["run", "--only", "train"]])
def test_device_option_overrides_the_file_and_is_checked(command, tmp_path, capsys, monkeypatch):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"workdir: {tmp_path / 'w'}\ndevice: cpu\ntrain: {{runs: {{b: {{max_updates: 2}}}}}}\n")
    args = [*command, *(["--pipeline"] if command == ["train"] else []), pipeline]
    assert_one_line_error(run_cli([*args, "--device", "tpu"], capsys, monkeypatch), "device 'tpu' unknown")
    if not torch.cuda.is_available():
        assert_one_line_error(run_cli([*args, "--device", "cuda"], capsys, monkeypatch), "no CUDA GPU")
    # The file's own cpu passes the device check and fails later, on the missing corpus.
    assert_one_line_error(run_cli(args, capsys, monkeypatch), "no corpus")


def test_cache_build_refuses_a_device_this_machine_lacks(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a line\n")
    args = ["cache", "build", "--checkpoint", "minilm-l6", "--corpus", corpus, "--out", tmp_path / "out"]
    assert_one_line_error(run_cli([*args, "--device", "cuda:x"], capsys, monkeypatch), "device 'cuda:x' unknown")
    if not torch.cuda.is_available():
        assert_one_line_error(run_cli([*args, "--device", "cuda"], capsys, monkeypatch), "no CUDA GPU")
    assert_one_line_error(run_cli([*args, "--precision", "fp16", "--device", "cpu"], capsys, monkeypatch), "fp16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given, expected", [(None, "64 64"), ("1024", "1024 64")])
def test_cli_bounds_onednn_kernel_caches_before_torch_loads(given, expected):
    """The prlmfuse command caps oneDNN's and ideep's per-shape kernel caches before torch is imported
    (they grew training's memory with every new batch shape), and leaves a value the user set alone."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if given is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = given
    code = (
        "import os, sys; import prlmfuse.cli; "
        "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [*expected.split(), "False"]


def test_the_demo_shipped_in_the_package_is_the_repository_pipeline():
    # `prlmfuse run` without a file in the working directory runs the packaged copy: it must not drift.
    shipped = Path(cli.__file__).with_name("pipeline.yaml")
    repository = Path(__file__).resolve().parents[1] / "pipeline.yaml"
    assert shipped.read_text(encoding="utf-8") == repository.read_text(encoding="utf-8")
