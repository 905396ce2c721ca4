"""The stop signals of a shared cluster on real small data: SIGTERM and SIGUSR1 (SLURM's) end a training
run after its update with a resume point, and the resumed run trains exactly as an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prlmfuse import signals
from prlmfuse.train_fused import run_dir as rundir

from helpers import small_runs

torch.set_num_threads(1)
pytestmark = pytest.mark.slow

UPDATES = 300


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    corpus = small_runs.small_bible(root)
    ckpt = small_runs.tiny_prlm(root / "bert")
    return root, corpus, ckpt


def _pipeline(path: Path, corpus, ckpt: Path, *, jobs: int = 1, workers: int = 0) -> Path:
    files = {f"{s}_{side}": str(getattr(corpus, f"{side}_path")(s)) for s in ("train", "dev", "test") for side in ("src", "tgt")}
    path.write_text(textwrap.dedent(f"""
        workdir: {path.parent / 'work'}
        data: {{kind: text, src: en, tgt: ja, files: {json.dumps(files)}}}
        cache: {{checkpoints: [{{name: {ckpt}, layers: [-2]}}]}}
        train:
          jobs: {jobs}
          defaults: {{preset: tiny, bpe_vocab: 600, max_tokens: 300, max_updates: {UPDATES}, max_epochs: null,
                      save_every: 100, keep_last: 2, log_every: 2, warmup: 4, dropout: 0.1, seed: 3,
                      num_workers: {workers}}}
          runs:
            baseline: {{}}
            fused: {{prlms: [{{checkpoint: {ckpt}, layer: -2}}]}}
        evaluate: {{baseline: baseline, beam: 1, average_last: 2}}
    """))
    return path


def _cli(*args, **popen) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "prlmfuse.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen)


def _cached(folder: Path, corpus, ckpt: Path, workers: int) -> Path:
    """A pipeline file in `folder` with its data and caches built."""
    folder.mkdir()
    pipeline = _pipeline(folder / "p.yaml", corpus, ckpt, workers=workers)
    for stage in ("data", "cache"):
        built = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "run", pipeline, "--only", stage],
                               env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
    return pipeline


def _wait_for_update(run_dir: Path, update: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / rundir.METRICS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stdout.read()}")
        if metrics.is_file():
            records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if any(r.get("update", 0) >= update for r in records):
                return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} did not reach update {update} in {timeout} s")


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(rundir.weights_path(run_dir, UPDATES)))


def _group_gone(pgid: int, grace: float = 5.0) -> bool:
    """No process of the job's group is alive (multiprocessing's helpers exit once the trainer has)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize("signum, to_group, workers", [(signal.SIGTERM, False, 0), (signal.SIGUSR1, True, 2)])
def test_a_stopped_run_saves_a_resume_point_and_resumes_as_if_never_stopped(world, tmp_path, signum, to_group, workers):
    root, corpus, ckpt = world
    straight = _cached(tmp_path / "straight", corpus, ckpt, workers)
    done = _cli("train", "-p", straight, "--runs", "fused")
    assert done.wait(300) == 0, done.stdout.read()

    stopped = _cached(tmp_path / "stopped", corpus, ckpt, workers)
    run_dir = tmp_path / "stopped" / "work" / "runs" / "fused"
    proc = _cli("train", "-p", stopped, "--runs", "fused")
    _wait_for_update(run_dir, 120, proc)  # past the first scheduled save (100), before the second (200)
    sent = time.monotonic()
    if to_group:  # as SLURM and a terminal send it: the trainer and its loader workers alike
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    out = proc.communicate(timeout=60)[0]
    elapsed = time.monotonic() - sent
    assert proc.returncode == signals.PREEMPTED_EXIT, out
    assert f"stopped by {signal.Signals(signum).name}: run fused saved at update" in out
    assert "Traceback" not in out and elapsed < 20, out
    assert _group_gone(proc.pid)  # no worker of the run is left

    # A resume point apart from the checkpoints: no dev pass, not among what keep_last and averages count.
    resumed_at = rundir.state_to_resume(run_dir).update
    saves = [r["update"] for r in rundir.read_metrics(run_dir) if "dev_loss" in r]
    assert resumed_at >= 120 and saves[-1] < resumed_at or resumed_at == saves[-1]
    if resumed_at != saves[-1]:  # (a signal that lands on a scheduled save needs no resume point)
        point = json.loads((run_dir / rundir.RESUME_DIR / rundir.RESUME_STATE).read_text())
        assert point["update"] == resumed_at and resumed_at not in rundir.complete_checkpoints(run_dir)

    again = _cli("train", "-p", stopped, "--runs", "fused")
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    source = "last checkpoint" if resumed_at == saves[-1] else "a stop signal's resume point"
    assert f"train: fused resumes at update {resumed_at} from {'its ' if resumed_at == saves[-1] else ''}{source}" in out
    assert not (run_dir / rundir.RESUME_DIR).exists()  # the next scheduled save made it stale
    reference = tmp_path / "straight" / "work" / "runs" / "fused"
    a, b = _final_weights(reference), _final_weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The same checkpoints kept, the same dev passes logged: it saves and averages as the uninterrupted run.
    assert rundir.complete_checkpoints(run_dir) == rundir.complete_checkpoints(reference)
    dev = [(r["update"], r["dev_loss"]) for r in rundir.read_metrics(run_dir) if "dev_loss" in r]
    assert dev == [(r["update"], r["dev_loss"]) for r in rundir.read_metrics(reference) if "dev_loss" in r]


def test_a_grid_forwards_the_signal_to_every_run_and_does_not_evaluate(world, tmp_path):
    root, corpus, ckpt = world
    pipeline = _pipeline(tmp_path / "p.yaml", corpus, ckpt, jobs=2)
    proc = _cli("run", pipeline)
    runs = tmp_path / "work" / "runs"
    _wait_for_update(runs / "fused", 30, proc, timeout=300)
    _wait_for_update(runs / "baseline", 30, proc)
    proc.send_signal(signal.SIGTERM)  # the parent alone: it forwards the signal to its children
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == signals.PREEMPTED_EXIT, out
    assert "stopped by SIGTERM" in out and "Traceback" not in out
    for name in ("baseline", "fused"):
        assert f"train: {name} stopped" in out
        # A resume point, or none because the signal landed on a save (scheduled or an epoch's end).
        saves = [r["update"] for r in rundir.read_metrics(runs / name) if "dev_loss" in r]
        assert (runs / name / rundir.RESUME_DIR / rundir.RESUME_STATE).is_file() or \
            rundir.state_to_resume(runs / name).update == saves[-1]
    assert not (tmp_path / "work" / "results").exists()
    assert _group_gone(proc.pid)


# `prlmfuse` with small cache shards (a shard per few sentences), so a signal lands between shards.
_SMALL_SHARDS = ("import sys; from prlmfuse.cache_features import builder; "
                 "builder.build_cache.__kwdefaults__['shard_bytes'] = 3000; "
                 "from prlmfuse.cli import main; sys.argv[0] = 'prlmfuse'; main()")


def test_a_stopped_cache_build_keeps_its_finished_shards_and_the_rerun_completes_it(world, tmp_path):
    from prlmfuse.cache_features import build_cache

    from helpers import reliability, tiny_prlms

    root, corpus, ckpt = world
    lines = tiny_prlms.write_corpus(tmp_path / "train.src", reliability.distinct_sentences(600))
    reference = build_cache(str(ckpt), lines, tmp_path / "reference", layers="-2,-1", max_tokens=256,
                            precision="fp32", backend="hdf5", shard_bytes=3000, progress=False)
    out = tmp_path / "stopped"
    command = [sys.executable, "-c", _SMALL_SHARDS, "cache", "build", "--checkpoint", str(ckpt), "--corpus", str(lines),
               "--out", str(out), "--layers", "-2,-1", "--max-tokens", "256", "--precision", "fp32", "--backend", "hdf5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(list(out.glob("shards/*"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == signals.PREEMPTED_EXIT, output
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    kept = list(out.glob("shards/*"))
    assert kept and not (out / "manifest.json").exists()  # finished shards kept; the cache not yet trusted
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]  # the shard being written was discarded
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    reliability.assert_same_cache(out, Path(reference.path))


def test_the_cluster_pages_slurm_script_passes_the_signal_on_and_requeues(world, tmp_path):
    """docs/cluster.md's job script, with `scontrol requeue` replaced by an echo: USR1 to the script (as SLURM
    sends it with --signal=B:USR1) reaches prlmfuse, which saves and exits 75, and the script asks for a requeue."""
    root, corpus, ckpt = world
    page = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text(encoding="utf-8")
    block = page[page.index("```bash\n#!/bin/bash"):]
    script = block[len("```bash\n"): block.index("```\n", 10)]
    pipeline = _cached(tmp_path / "job", corpus, ckpt, 0)
    script = script.replace("prlmfuse run pipeline.yaml", f"{sys.executable} -m prlmfuse.cli train -p {pipeline} --runs fused")
    script = script.replace('scontrol requeue "$SLURM_JOB_ID"', "echo REQUEUE")
    assert "echo REQUEUE" in script and "-m prlmfuse.cli train" in script
    (tmp_path / "job.sh").write_text(script)
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _wait_for_update(tmp_path / "job" / "work" / "runs" / "fused", 30, job)
    job.send_signal(signal.SIGUSR1)
    out = job.communicate(timeout=60)[0]
    assert job.returncode == signals.PREEMPTED_EXIT, out
    assert "stopped by SIGUSR1" in out and out.rstrip().endswith("REQUEUE")
    assert rundir.state_to_resume(tmp_path / "job" / "work" / "runs" / "fused").update >= 30


def test_a_grid_names_a_killed_run_and_the_same_command_resumes_only_what_did_not_finish(world, tmp_path):
    root, corpus, ckpt = world
    pipeline = _cached(tmp_path / "grid", corpus, ckpt, 0)
    text = pipeline.read_text().replace("jobs: 1", "jobs: 2").replace("baseline: {}", "baseline: {max_updates: 40}")
    pipeline.write_text(text)
    runs = tmp_path / "grid" / "work" / "runs"
    proc = _cli("run", pipeline, "--only", "train")
    _wait_for_update(runs / "fused", 120, proc, timeout=300)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    (child,) = [int(pid) for pid in children
                if b"\0--runs\0fused\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(child, signal.SIGKILL)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "1 of 2 runs failed: fused (killed by SIGKILL" in out, out
    assert "train: baseline finished" in out
    finished = (runs / "baseline" / "trainer_state.json").stat().st_mtime_ns
    killed_at = rundir.state_to_resume(runs / "fused").update

    again = _cli("run", pipeline, "--only", "train")
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    assert (runs / "baseline" / "trainer_state.json").stat().st_mtime_ns == finished  # not started again
    log = (runs / "fused" / "train.log").read_text()
    assert f"train: fused resumes at update {killed_at} from its last checkpoint" in log
    assert rundir.state_to_resume(runs / "fused").update == UPDATES
    dev = [r["update"] for r in rundir.read_metrics(runs / "fused") if "dev_loss" in r]
    assert dev == sorted(set(dev))  # no update logged twice after the resume


def test_torchrun_a_rank_killed_ends_the_group_and_torchrun_again_resumes_without_gaps(world, tmp_path):
    root, corpus, ckpt = world
    pipeline = _cached(tmp_path / "ddp", corpus, ckpt, 0)
    run_dir = tmp_path / "ddp" / "work" / "runs" / "fused"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "prlmfuse.cli", "train", "-p", str(pipeline), "--runs", "fused"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _wait_for_update(run_dir, 120, proc, timeout=300)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    (rank_1,) = [int(pid) for pid in workers if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]
    killed = time.monotonic()
    os.kill(rank_1, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - killed < 90  # the group ends; rank 0 is not left waiting
    assert _group_gone(proc.pid)

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    state = rundir.state_to_resume(run_dir)
    assert state.update == UPDATES and state.world_size == 2
    logged = [r["update"] for r in rundir.read_metrics(run_dir) if "loss" in r]
    assert logged == list(range(2, UPDATES + 1, 2))  # every log point once: no gap, no duplicate
    dev = [r["update"] for r in rundir.read_metrics(run_dir) if "dev_loss" in r]
    assert dev == sorted(set(dev)) and dev[-1] == UPDATES
