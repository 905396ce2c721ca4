"""Stage two under crashes, full disks, damaged caches and hostile run files.

Fast: a full disk while saving a checkpoint; damaged caches refused before anything is written;
trainer_state.json cannot name files outside the run; one trainer per run directory; temp files of
a killed save are removed on resume.
Slow: several kill -9 at seeded random moments of one run (DataLoader worker included), resumed to
the end: the weights of an uninterrupted run, and metrics.jsonl continuing the update count and
the inverse-sqrt learning rate.
"""

from __future__ import annotations

import fcntl
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from prlmfuse.errors import UserError
from prlmfuse.train_fused import PrLMUse, load_run, train_run
from prlmfuse.train_fused import checkpointing
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused import weights
from prlmfuse.train_fused.update_step import inverse_sqrt_lr

from helpers import reliability, small_runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-train")
    corpus = small_runs.small_bible(root)
    ckpt = small_runs.tiny_prlm(root / "bert")
    paths = small_runs.build_caches(ckpt, corpus, root / "cache", layers="-2,-1")
    return {"root": root, "corpus": corpus, "ckpt": ckpt, "paths": paths}


def _weights(run_dir: Path, update: int) -> dict[str, torch.Tensor]:
    return load_file(str(rundir.weights_path(run_dir, update)))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fused(world, name: str = "r", **overrides):
    use = PrLMUse(checkpoint=str(world["ckpt"]), layer=-2)
    return small_runs.tiny_run(name, prlms=[use], **overrides), [small_runs.caches_for(use, world["paths"])]


def _assert_every_checkpoint_file_is_whole(run_dir: Path) -> None:
    """Whatever carries a final name loads completely: weights, optimizer state, JSON states."""
    directory = run_dir / "checkpoints"
    for path in sorted(directory.iterdir() if directory.is_dir() else []):
        if path.name.startswith("."):
            continue  # a temp file: never trusted, removed on resume
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                assert f.metadata()["update"] == str(int(path.stem.split("-")[1]))
                for key in f.keys():
                    f.get_tensor(key)
        else:
            assert json.loads(path.read_text())["update"] == int(path.stem.split("-")[1])
    state = rundir.latest_trainer_state(run_dir)
    if state is not None:
        assert (run_dir / state.checkpoint).is_file() and (run_dir / state.optimizer).is_file()


# ------------------------------------------------------------------------------------------ full disk


def test_disk_full_while_saving_a_checkpoint_then_rerun(world, tmp_path, monkeypatch):
    run, caches = _fused(world, max_updates=12, save_every=4)
    straight = train_run(run, world["corpus"], caches, tmp_path / "straight", progress=False)

    original = checkpointing.save_model

    def save_model(model, filename, metadata=None):
        if metadata and metadata.get("update") == "8":
            Path(filename).write_bytes(b"half a checkpoint")  # what a full disk leaves: a torn temp file
            # safetensors reports the failed write like this (seen on a full tmpfs)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return original(model, filename, metadata=metadata)

    monkeypatch.setattr(checkpointing, "save_model", save_model)
    out = tmp_path / "full"
    with pytest.raises(UserError) as failed:
        train_run(run, world["corpus"], caches, out, progress=False)
    assert str(failed.value) == (
        f"disk full while writing checkpoint update-00000008 in {out}; free space and rerun to resume"
    )
    # The previous checkpoint is whole and still the one to resume from; no torn file anywhere.
    assert rundir.latest_trainer_state(out).update == 4
    assert rundir.complete_checkpoints(out) == [4]
    assert reliability.temp_leftovers(out) == []
    _assert_every_checkpoint_file_is_whole(out)

    monkeypatch.setattr(checkpointing, "save_model", original)  # space is back
    train_run(run, world["corpus"], caches, out, progress=False)
    a, b = _weights(straight, 12), _weights(out, 12)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ damaged caches


@pytest.mark.parametrize("kind", ["flipped byte", "missing shard", "truncated manifest"])
def test_train_refuses_a_damaged_cache_before_writing_anything(world, tmp_path, kind):
    damaged = tmp_path / "damaged"
    shutil.copytree(world["paths"]["train"], damaged)
    needle = reliability.damage_cache(kind, damaged)
    use = PrLMUse(checkpoint=str(world["ckpt"]), layer=-2)
    run = small_runs.tiny_run("d", prlms=[use])
    caches = [small_runs.caches_for(use, {**world["paths"], "train": str(damaged)})]
    with pytest.raises(UserError) as refused:
        train_run(run, world["corpus"], caches, tmp_path / "run", progress=False)
    assert needle in str(refused.value) and str(damaged) in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ run directory


def test_trainer_state_cannot_name_files_outside_the_run(world, tmp_path):
    run = small_runs.tiny_run("base", max_updates=2, save_every=2)
    run_dir = train_run(run, world["corpus"], [], tmp_path / "base", progress=False)
    state_file = run_dir / "trainer_state.json"
    state = json.loads(state_file.read_text())
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(run_dir / state["checkpoint"], outside)
    for key, value in (("checkpoint", "../elsewhere.safetensors"), ("optimizer", str(outside)),
                       ("checkpoint", "checkpoints/../../elsewhere.safetensors")):
        state_file.write_text(json.dumps({**state, key: value}))
        with pytest.raises(UserError, match=rf"{key} '.*' is not a file of this run's checkpoints/ folder"):
            train_run(small_runs.tiny_run("base", max_updates=4, save_every=2), world["corpus"], [], run_dir,
                      progress=False)
        with pytest.raises(UserError, match="is not a file of this run's checkpoints/ folder"):
            load_run(run_dir, "last")


def test_a_second_trainer_on_the_same_run_directory_is_refused(world, tmp_path):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    with open(run_dir / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        with pytest.raises(UserError, match=r"is being trained by another process \(pid 4242\); wait for it"):
            train_run(small_runs.tiny_run("base", max_updates=2), world["corpus"], [], run_dir, progress=False)
    assert not (run_dir / "checkpoints").exists()
    train_run(small_runs.tiny_run("base", max_updates=2, save_every=2), world["corpus"], [], run_dir, progress=False)
    assert rundir.complete_checkpoints(run_dir) == [2]


def test_temp_files_of_a_killed_save_are_removed_on_resume(world, tmp_path):
    run_dir = train_run(small_runs.tiny_run("base", max_updates=2, save_every=2), world["corpus"], [],
                        tmp_path / "base", progress=False)
    torn = [run_dir / "checkpoints" / ".update-00000004.safetensors.k2j3h4.tmp",
            run_dir / "checkpoints" / ".optimizer-00000004.safetensors.a1b2c3.tmp",
            run_dir / ".trainer_state.json.x7y8z9.tmp", run_dir / ".best.safetensors.q1w2e3.tmp",
            run_dir / "checkpoints" / ".tmpC3cHOz", run_dir / ".tmpLvMaVs"]  # safetensors' own temp files
    for path in torn:
        path.write_bytes(b"torn")
    mine = run_dir / ".notes"  # not a name prlmfuse writes: left alone
    mine.write_text("keep")
    train_run(small_runs.tiny_run("base", max_updates=4, save_every=2), world["corpus"], [], run_dir, progress=False)
    assert not any(p.exists() for p in torn) and mine.read_text() == "keep"
    assert rundir.latest_trainer_state(run_dir).update == 4


# ------------------------------------------------------------------------------------------ slow: kill -9


@pytest.mark.slow
def test_several_kill_9_at_random_moments_then_resume(world, tmp_path):
    overrides = dict(max_updates=40, save_every=5, dropout=0.1, num_workers=1, max_tokens=200, log_every=2)
    job = dict(corpus=str(world["corpus"].root), ckpt=str(world["ckpt"]), paths=world["paths"], run=overrides)
    zygote = reliability.Zygote()
    try:
        status, duration = zygote.run("job_train", tmp_path / "straight.log", out=str(tmp_path / "straight"), **job)
        assert status == 0, (tmp_path / "straight.log").read_text()[-3000:]
        killed = tmp_path / "killed"
        rng = random.Random(7)
        at_kill = []
        # Three kills at least; more (up to six) while they have not yet struck mid-run at two different saved
        # points: a resumed run spends the first part of its clock starting up, so two kills can land alike.
        while len(at_kill) < 3 or len({k[2] for k in at_kill if k[1] == -9 and k[2] < 40}) < 2 and len(at_kill) < 6:
            offset = rng.uniform(0.35, 0.9) * duration
            status = zygote.run_and_kill("job_train", tmp_path / "killed.log", offset, out=str(killed), **job)
            state = rundir.latest_trainer_state(killed) if killed.is_dir() else None
            at_kill.append((round(offset, 2), status, state.update if state else 0))
            if status == -9:
                _assert_every_checkpoint_file_is_whole(killed)
        status, _ = zygote.run("job_train", tmp_path / "killed.log", out=str(killed), **job)
        assert status == 0, (tmp_path / "killed.log").read_text()[-3000:]
    finally:
        zygote.close()
    print(at_kill)
    mid_run = [k for k in at_kill if k[1] == -9 and k[2] < 40]
    assert len(mid_run) >= 2 and len({k[2] for k in mid_run}) >= 2, at_kill  # killed at different points

    straight = tmp_path / "straight"
    a, b = _weights(straight, 40), _weights(killed, 40)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    assert reliability.temp_leftovers(killed) == []
    # The update count and the learning-rate schedule continue across every resume: the same
    # records as the uninterrupted run, each lr on fairseq's inverse_sqrt curve, nothing twice.
    resumed, reference = _metrics(killed), _metrics(straight)
    train_rows = [r for r in resumed if "loss" in r]
    assert [r["update"] for r in train_rows] == list(range(2, 41, 2))
    for row in train_rows:
        assert row["lr"] == inverse_sqrt_lr(row["update"], 7e-4, 4)
    assert [r["lr"] for r in train_rows] == [r["lr"] for r in reference if "loss" in r]
    assert [r["update"] for r in resumed if "dev_loss" in r] == list(range(5, 41, 5))
    state = json.loads((killed / "trainer_state.json").read_text())
    assert state["update"] == 40 and state["lr"] == inverse_sqrt_lr(40, 7e-4, 4)


# A child in its own mount namespace: for each case, train into a tmpfs too small for the file named,
# then give the tmpfs room and train again (the "rerun once there is space").
_TMPFS_TRAINER = r"""
import json, os, subprocess, sys
import torch
torch.set_num_threads(1)
from prlmfuse.corpora import load_corpus
from prlmfuse.errors import UserError
from prlmfuse.train_fused import train_run
from prlmfuse.train_fused import run_dir as rundir
sys.path.insert(0, {tests!r})
from helpers import small_runs
args = json.loads(sys.argv[1])
corpus = load_corpus(args["corpus"])
run = small_runs.tiny_run("full", max_updates=4, save_every=4)
report = {{}}
for case, size in args["sizes"].items():
    mnt = os.path.join(args["root"], case)
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={{size}}", "tmpfs", mnt], check=True)
    out = os.path.join(mnt, "run")
    entry = report[case] = {{}}
    try:
        train_run(run, corpus, [], out, progress=False)
        entry["first"] = "completed"
    except UserError as e:
        entry["first"] = str(e)
    entry["files"] = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    metrics = os.path.join(out, rundir.METRICS)
    entry["metrics"] = open(metrics, "rb").read().decode() if os.path.exists(metrics) else None
    subprocess.run(["mount", "-o", "remount,size=64m", mnt], check=True)  # space is back
    train_run(run, corpus, [], out, progress=False)
    entry["resumed_update"] = rundir.latest_trainer_state(out).update
print(json.dumps(report))
"""


def test_real_full_disk_while_writing_bpe_run_json_and_metrics(world, tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    reliability.skip_without_private_mounts(tmp_path)
    # Room for exactly the files written before the one named (tmpfs counts whole pages).
    reference = train_run(small_runs.tiny_run("full", max_updates=4, save_every=4), world["corpus"], [],
                          tmp_path / "reference", progress=False)
    pages = {name: -(-(reference / name).stat().st_size // 4096) for name in (".lock", "bpe.json", "run.json")}
    pages[".lock"] = max(pages[".lock"], 1)
    sizes = {"bpe.json": pages[".lock"], "run.json": pages[".lock"] + pages["bpe.json"],
             "metrics.jsonl": pages[".lock"] + pages["bpe.json"] + pages["run.json"]}
    args = {"corpus": str(world["corpus"].root), "root": str(tmp_path / "mnt"),
            "sizes": {case: f"{n * 4}k" for case, n in sizes.items()}}
    done = subprocess.run(["unshare", "-Urm", sys.executable, "-c",
                           textwrap.dedent(_TMPFS_TRAINER.format(tests=str(reliability.TESTS))), json.dumps(args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for case, entry in report.items():
        assert entry["first"] == (f"disk full while writing {case} in {tmp_path / 'mnt' / case / 'run'}; "
                                  "free space and rerun to resume"), (case, entry)
        assert not any(Path(f).name.startswith(".") and f != ".lock" for f in entry["files"]), entry  # no temp file
        assert case not in entry["files"] or case == "metrics.jsonl", entry  # no torn bpe.json or run.json
        assert entry["metrics"] in (None, ""), entry  # no torn record
        assert entry["resumed_update"] == 4


# ------------------------------------------------------------------------------------------ --fresh


def test_fresh_starts_over_and_keeps_the_old_run_until_the_new_one_saves(world, tmp_path, monkeypatch):
    out = tmp_path / "run"
    old = train_run(small_runs.tiny_run("r", max_updates=8, save_every=4, lr=1e-3), world["corpus"], [], out,
                    progress=False)
    old_weights = _weights(old, 8)

    # A fresh start (another lr: another run) that fails before its first checkpoint ...
    original = checkpointing.save_model

    def save_model(model, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpointing, "save_model", save_model)
    fresh = small_runs.tiny_run("r", max_updates=4, save_every=4)
    with pytest.raises(UserError, match="disk full while writing checkpoint update-00000004"):
        train_run(fresh, world["corpus"], [], out, resume=False, progress=False)
    # ... has lost nothing: the old run is set aside whole, and resuming brings it back.
    assert rundir.latest_trainer_state(out) is None
    assert rundir.latest_trainer_state(out / rundir.PREVIOUS_RUN).update == 8
    monkeypatch.setattr(checkpointing, "save_model", original)
    train_run(small_runs.tiny_run("r", max_updates=8, save_every=4, lr=1e-3), world["corpus"], [], out, progress=False)
    assert not (out / rundir.PREVIOUS_RUN).exists() and rundir.complete_checkpoints(out) == [4, 8]
    assert all(torch.equal(t, _weights(out, 8)[n]) for n, t in old_weights.items())

    # A fresh start that saves: the new run's files only, the old run gone.
    train_run(fresh, world["corpus"], [], out, resume=False, progress=False)
    assert rundir.complete_checkpoints(out) == [4] and rundir.latest_trainer_state(out).update == 4
    assert not (out / rundir.PREVIOUS_RUN).exists() and reliability.temp_leftovers(out) == []
    assert json.loads((out / "run.json").read_text())["train"]["lr"] == fresh.lr
    assert [r["update"] for r in _metrics(out)] == sorted(r["update"] for r in _metrics(out))
    assert max(r["update"] for r in _metrics(out)) == 4
    straight = train_run(fresh, world["corpus"], [], tmp_path / "straight", progress=False)
    assert all(torch.equal(t, _weights(out, 4)[n]) for n, t in _weights(straight, 4).items())


# ------------------------------------------------------------------------------------------ averages and the lock


def test_averages_are_written_under_the_run_directory_lock(world, tmp_path, capsys, monkeypatch, caplog):
    import logging

    run_dir = train_run(small_runs.tiny_run("base", max_updates=4, save_every=2), world["corpus"], [],
                        tmp_path / "base", progress=False)
    # A trainer holds the run (another process): `train average` and evaluate refuse, writing nothing.
    trainer = reliability.hold_lock(run_dir / ".lock", "", 120)
    try:
        result = reliability.run_cli(["train", "average", run_dir, "--last", "2"], capsys, monkeypatch)
        reliability.assert_one_line_error(result, f"{run_dir} is being trained by another process (pid {trainer.pid})",
                                          "once training has finished")
        result = reliability.run_cli(["evaluate", "--runs", run_dir, "--out", tmp_path / "results", "--beam", "1",
                                      "--average-last", "2"], capsys, monkeypatch)
        reliability.assert_one_line_error(result, f"{run_dir} is being trained by another process")
        assert not (run_dir / "average-last2.safetensors").exists() and reliability.temp_leftovers(run_dir) == []
    finally:
        trainer.kill()
        trainer.wait()
    # Another averager holds it: this one waits for it, then averages.
    averager = reliability.hold_lock(run_dir / ".lock", "averaging", 1.5)
    caplog.set_level(logging.INFO, logger="prlmfuse")
    path = weights.average_checkpoints(run_dir, last=2)
    averager.wait()
    assert f"waiting for pid {averager.pid} to finish averaging" in caplog.text
    assert path == run_dir / "average-last2.safetensors" and path.is_file()
    # A trainer waits for an averager too (averaging takes seconds), then resumes.
    averager = reliability.hold_lock(run_dir / ".lock", "averaging", 1.5)
    train_run(small_runs.tiny_run("base", max_updates=6, save_every=2), world["corpus"], [], run_dir, progress=False)
    averager.wait()
    assert rundir.latest_trainer_state(run_dir).update == 6
