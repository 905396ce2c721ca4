"""`prlmfuse run` end to end on a tiny pipeline, then again to show the second run is a no-op."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prlmfuse.errors import UserError

from helpers import reliability, small_runs

PIPELINE = """\
workdir: work
data:
  kind: text
  src: en
  tgt: ja
  files:
    train_src: {raw}/train.src
    train_tgt: {raw}/train.tgt
    dev_src: {raw}/dev.src
    dev_tgt: {raw}/dev.tgt
    test_src: {raw}/test.src
    test_tgt: {raw}/test.tgt
precision: fp32
cache:
  backend: {backend}
  checkpoints:
    - name: {prlm}
      layers: [-2]
train:
  defaults: {{preset: tiny, bpe_vocab: 400, max_tokens: 400, max_updates: 6, max_epochs: null, warmup: 3,
             save_every: 3, keep_last: 3, num_workers: 0, dropout: 0.0}}
  runs:
    baseline: {{}}
    fused: {{prlms: [{{checkpoint: {prlm}, layer: -2}}]}}
evaluate: {{baseline: baseline, beam: 2, average_last: 2, max_len_b: 5}}
"""


def _tree_state(root: Path) -> dict[str, int]:
    """Every file under root with its modification time (ns): what a no-op must leave untouched."""
    # Lock files are not content: taking a lock may touch them.
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def _prlmfuse(*args, cwd):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "prlmfuse.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    corpus = small_runs.small_bible(root / "corpus", train=200, dev=16, test=16)
    prlm = small_runs.tiny_prlm(root / "prlm", layers=3, width=32)
    path = root / "pipeline.yaml"
    path.write_text(PIPELINE.format(raw=root / "corpus" / "raw", prlm=prlm, backend="zarr"), encoding="utf-8")
    return root, path, corpus


@pytest.mark.slow
def test_run_end_to_end_then_again_is_a_no_op(tiny_pipeline):
    root, path, _ = tiny_pipeline
    plan = _prlmfuse("run", str(path), "--dry-run", cwd=root)
    assert plan.returncode == 0, plan.stderr
    assert "to build" in plan.stdout and "[new]" in plan.stdout

    first = _prlmfuse("run", str(path), cwd=root)
    assert first.returncode == 0, first.stderr[-3000:]
    work = root / "work"
    # The output ends with the summary a person reads: results file, scores, examples, plots.
    summary = first.stdout.splitlines()
    assert f"results: {work / 'results' / 'results.md'}" in summary and sum(x.startswith("example: test line ") for x in summary) == 2
    assert summary[-1] == f"plots: {work / 'results' / 'scores.png'}, {work / 'results' / 'dev_loss.png'}"
    results = (work / "results" / "results.md").read_text(encoding="utf-8")
    assert "baseline" in results and "fused" in results and "BLEU" in results
    for run in ("baseline", "fused"):
        assert (work / "runs" / run / "run.json").is_file()
        assert list((work / "runs" / run / "checkpoints").glob("update-*.safetensors"))
    before = _tree_state(work)

    second = _prlmfuse("run", str(path), cwd=root)
    assert second.returncode == 0, second.stderr[-3000:]
    after = _tree_state(work)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"a second run of a finished pipeline must change nothing, but touched {changed}"

    plan = _prlmfuse("run", str(path), "--dry-run", cwd=root)
    assert plan.returncode == 0, plan.stderr
    assert "to build" not in plan.stdout and plan.stdout.count("[done at update 6]") == 2

    # Evaluating one fused run still compares it with the (trained) baseline.
    only = _prlmfuse("run", str(path), "--runs", "fused", "--only", "evaluate", cwd=root)
    assert only.returncode == 0, only.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads((work / "results" / "results.json").read_text())["rows"]}
    assert set(rows) == {"baseline", "fused"} and rows["fused"]["compared_with"] == "baseline"

    # A node without the metric's tokenizer decodes only; `prlmfuse score` gives the same table elsewhere.
    decoded = _prlmfuse("run", str(path), "--only", "evaluate", "--no-score", cwd=root)
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    assert f"without scoring: prlmfuse score {work / 'results'}" in decoded.stdout
    unscored = json.loads((work / "results" / "results.json").read_text())
    assert unscored["settings"]["scored"] is False and all(r["bleu"] is None for r in unscored["rows"])
    scored = _prlmfuse("score", str(work / "results"), cwd=root)
    assert scored.returncode == 0, scored.stderr[-3000:]
    again = {r["run"]: r for r in json.loads((work / "results" / "results.json").read_text())["rows"]}
    for run in rows:
        assert (again[run]["bleu"], again[run]["p_value"]) == (rows[run]["bleu"], rows[run]["p_value"])


@pytest.mark.slow
def test_jobs_trains_runs_in_their_own_processes_and_names_the_one_that_failed(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    pipe = tmp_path / "pipeline.yaml"
    pipe.write_text(path.read_text().replace("workdir: work", f"workdir: {tmp_path / 'work'}"))
    for stage in ("data", "cache"):
        built = _prlmfuse("run", str(pipe), "--only", stage, cwd=tmp_path)
        assert built.returncode == 0, built.stderr[-3000:]
    from prlmfuse.train_fused.run_dir import latest_trainer_state

    # The fused run's cache damaged: that run fails in its own process, the baseline still trains
    # in another, and the parent's one line names the failed run with the child's own error line.
    train_cache = next(p.parent for p in (tmp_path / "work" / "cache").rglob("manifest.json")
                       if p.parent.name.startswith("train-"))
    shutil.copytree(train_cache, tmp_path / "intact")
    needle = reliability.damage_cache("flipped byte", train_cache)
    failed = _prlmfuse("run", str(pipe), "--only", "train", "--jobs", "2", cwd=tmp_path)
    assert failed.returncode == 2, failed.stderr[-3000:]
    # Progress is logged to stderr; the error is one line, the last.
    *progress, line = failed.stderr.strip().splitlines()
    assert not any(p.startswith("error: ") for p in progress), failed.stderr
    assert line.startswith("error: 1 of 2 runs failed: fused (exit 2: error: ") and needle in line, line
    assert failed.stderr.count("(own process, 1 thread(s);") == 2 and "baseline finished in" in failed.stderr
    runs = tmp_path / "work" / "runs"
    assert latest_trainer_state(runs / "baseline").update == 6
    assert "train: baseline -> " in (runs / "baseline" / "train.log").read_text(encoding="utf-8")

    shutil.rmtree(train_cache)
    shutil.copytree(tmp_path / "intact", train_cache)
    # The pipeline file's train.jobs does what --jobs does.
    assert "\ntrain:\n" in pipe.read_text()
    pipe.write_text(pipe.read_text().replace("\ntrain:\n", "\ntrain:\n  jobs: 2\n", 1))
    repaired = _prlmfuse("run", str(pipe), "--only", "train", cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert repaired.stderr.count("finished in") == 2 and repaired.stderr.count("(own process, 1 thread(s);") == 2
    assert latest_trainer_state(runs / "fused").update == 6


@pytest.mark.slow
def test_max_updates_trains_a_run_on_in_steps_to_the_weights_of_one_straight_run(tiny_pipeline, tmp_path):
    from safetensors.torch import load_file

    from prlmfuse.train_fused import run_dir as rundir

    root, path, _ = tiny_pipeline
    trained = {}
    for name in ("straight", "steps"):
        pipe = tmp_path / name / "pipeline.yaml"
        pipe.parent.mkdir()
        # A save every update, two kept: a step's average (of 2) reads saves that training on prunes.
        pipe.write_text(path.read_text().replace("workdir: work", f"workdir: {tmp_path / name / 'work'}")
                        .replace("save_every: 3, keep_last: 3", "save_every: 1, keep_last: 2"))
        for stage in ("data", "cache"):
            built = _prlmfuse("run", str(pipe), "--only", stage, cwd=tmp_path)
            assert built.returncode == 0, built.stderr[-3000:]
        trained[name] = (pipe, tmp_path / name / "work" / "runs")
    pipe, runs = trained["straight"]
    # Every step as the straight run trains: two children of one thread each (threads change fp32 sums).
    straight = _prlmfuse("train", "-p", str(pipe), "--runs", "baseline,fused", "-j", "2", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]

    # Two steps of a budget curve: 3 updates (each run its own child, told the budget), then the file's 6.
    pipe, runs = trained["steps"]
    first = _prlmfuse("run", str(pipe), "--only", "train", "--runs", "baseline,fused", "-j", "2", "--max-updates", "3",
                      cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("(own process, 1 thread(s);") == 2
    for run in ("baseline", "fused"):
        assert rundir.state_to_resume(runs / run).update == 3
    decode = ["--beam", "2", "--max-len-b", "5", "--average-last", "2", "--split", "dev"]
    at_three = _prlmfuse("evaluate", "--runs", str(runs / "baseline"), str(runs / "fused"), "--out",
                         str(tmp_path / "at-3"), *decode, cwd=tmp_path)
    assert at_three.returncode == 0, at_three.stderr[-3000:]
    plan = _prlmfuse("run", str(pipe), "--dry-run", "--max-updates", "3", cwd=tmp_path)
    assert plan.stdout.count("[done at update 3]") == 2 and "budget 3 updates" in plan.stdout, plan.stdout
    assert _prlmfuse("run", str(pipe), "--dry-run", cwd=tmp_path).stdout.count("budget 6 updates") == 2
    second = _prlmfuse("train", "-p", str(pipe), "--runs", "baseline,fused", "-j", "2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    for run in ("baseline", "fused"):
        assert f"train: {run} resumes at update 3 from its last checkpoint" in (runs / run / "train.log").read_text()
        a = load_file(str(rundir.weights_path(trained["straight"][1] / run, 6)))
        b = load_file(str(rundir.weights_path(runs / run, 6)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), run

    # The first step's saves outlived training on: decoded at update 3, the runs write what they wrote there.
    again = _prlmfuse("evaluate", "--runs", str(runs / "baseline"), str(runs / "fused"), "--out",
                      str(tmp_path / "again-3"), "--at-update", "3", *decode, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    first, later = (json.loads((tmp_path / out / "results.json").read_text())["rows"] for out in ("at-3", "again-3"))
    assert [(r["run"], r["hyp_sha256"], r["updates"], r["checkpoints"]) for r in later] == \
        [(r["run"], r["hyp_sha256"], r["updates"], r["checkpoints"]) for r in first]
    assert {r["updates"] for r in later} == {3} and {r["stopped_by"] for r in later} == {"max_updates"}
    assert {tuple(r["checkpoints"]) for r in later} == {("update-00000002.safetensors", "update-00000003.safetensors")}
    assert rundir.complete_checkpoints(runs / "fused") == [5, 6]  # pruned as ever; 2 and 3 kept in budgets/
    assert rundir.latest_trainer_state(runs / "fused").budget_ends == [3, 6]
    assert rundir.latest_trainer_state(trained["straight"][1] / "fused").budget_ends == [6]
    assert "up to update 3 " in (tmp_path / "again-3" / "results.md").read_text()
    dev_loss = [json.loads((tmp_path / out / "dev_loss.json").read_text()) for out in ("at-3", "again-3")]
    assert dev_loss[1] == dev_loss[0] and max(u for u, _ in dev_loss[1]["nll"]["fused"]) == 3
    # A run trained straight to 6 never stopped at 3: one line, exit 2.
    straight = trained["straight"][1] / "fused"
    refused = _prlmfuse("evaluate", "--runs", str(straight), "--out", str(tmp_path / "refused"), "--at-update", "3",
                        *decode, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: {straight} keeps no saves of update 3 (it trained on past none; its last update, 6); a run is "
        "decoded at an earlier update where `train --max-updates` stopped it there before it trained on"), refused.stderr

    # A budget below where a run already is: one line, and its run.json keeps the budget it trained to.
    info = (runs / "fused" / rundir.RUN_JSON).read_text()
    back = _prlmfuse("train", "-p", str(pipe), "--runs", "fused", "--max-updates", "2", cwd=tmp_path)
    assert back.returncode == 2 and back.stderr.strip().splitlines()[-1] == (
        f"error: --max-updates 2: run fused is already at update 6 ({runs / 'fused'}); give a budget of at least 6, "
        "or leave fused out of --runs"), back.stderr
    assert (runs / "fused" / rundir.RUN_JSON).read_text() == info


def _two_line_corpus_files(raw: Path) -> Path:
    """Six two-line corpus files in `raw`, for plans that never build the corpus."""
    raw.mkdir()
    for split in ("train", "dev", "test"):
        (raw / f"{split}.src").write_text("a b\nc d\n", encoding="utf-8")
        (raw / f"{split}.tgt").write_text("x\ny\n", encoding="utf-8")
    return raw


def test_dry_run_on_a_fresh_pipeline_writes_nothing(tmp_path):
    raw = _two_line_corpus_files(tmp_path / "raw")
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(raw=raw, prlm="minilm-l6", backend="hdf5"), encoding="utf-8")
    from prlmfuse.config import load_pipeline
    from prlmfuse.plan import plan_lines

    cfg = load_pipeline(path)
    lines = plan_lines(cfg, None)
    assert not (tmp_path / "work").exists()
    assert any("[to build once the corpus exists]" in line for line in lines) and any("[new]" in line for line in lines)
    assert lines[1].startswith("runtime: device ") and lines[1].endswith(", precision fp32 (cache and train; evaluate decodes in fp32)")
    if not torch.cuda.is_available():  # the plan refuses the device the run would refuse
        cfg.device = "cuda"
        with pytest.raises(UserError, match="no CUDA GPU"):
            plan_lines(cfg, None)


def test_dry_run_estimate_counts_runs_trained_at_once(tmp_path):
    raw = _two_line_corpus_files(tmp_path / "raw")
    path = tmp_path / "pipeline.yaml"
    text = PIPELINE.format(raw=raw, prlm="minilm-l6", backend="zarr").replace("max_updates: 6,", "max_updates: 600,")
    path.write_text(text, encoding="utf-8")
    from prlmfuse.config import load_pipeline
    from prlmfuse.plan import plan_lines

    cfg = load_pipeline(path)
    # A rate each run logged earlier: 1,200 updates left at 1 update/s is 20 minutes one after the other.
    for run in ("baseline", "fused"):
        (tmp_path / "work" / "runs" / run).mkdir(parents=True)
        (tmp_path / "work" / "runs" / run / "metrics.jsonl").write_text('{"update": 1, "updates_per_s": 1.0}\n')
    assert "estimate: about 20 min at each run's measured batches/s" in plan_lines(cfg, None)
    assert "estimate: about 10 min at each run's measured batches/s, 2 runs at once" in plan_lines(cfg, None, 2)
    assert "estimate: about 10 min at each run's measured batches/s" in plan_lines(cfg, ["fused"], 2)

    # A run of two batches an update takes twice the time per update: it logs half the updates/s, the same
    # batches/s, and its 600 updates count as 1,200 batches.
    path.write_text(text.replace("fused: {prlms:", "fused: {update_freq: 2, prlms:"), encoding="utf-8")
    (tmp_path / "work" / "runs" / "fused" / "metrics.jsonl").write_text('{"update": 1, "updates_per_s": 0.5}\n')
    lines = plan_lines(load_pipeline(path), None)
    assert "estimate: 1200 updates left (1800 batches), at most 0.7M tokens" in lines
    assert "estimate: about 30 min at each run's measured batches/s" in lines

    # Each run at its own rate: the baseline at 4 batches/s takes 2.5 minutes for its 600, the fused run at
    # 1 batch/s (its last records, not its first) 20 for its 1,200.
    (tmp_path / "work" / "runs" / "baseline" / "metrics.jsonl").write_text('{"update": 1, "updates_per_s": 4.0}\n')
    records = [{"update": i, "updates_per_s": 3.0 if i < 10 else 0.5} for i in range(40)]
    (tmp_path / "work" / "runs" / "fused" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "estimate: about 22 min at each run's measured batches/s" in plan_lines(load_pipeline(path), None)
    # A run not yet timed takes the rate of timed runs of its kind: the fused run without its log is timed
    # at no baseline's rate (there is no other fused run), so at the baseline's, the only one timed.
    (tmp_path / "work" / "runs" / "fused" / "metrics.jsonl").unlink()
    assert ("estimate: about 8 min at each run's measured batches/s (1 not yet timed: at the mean rate of timed "
            "runs of their kind, with or without a PrLM)") in plan_lines(load_pipeline(path), None)


def test_training_before_the_cache_exists_says_what_to_run(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.errors import UserError
    from prlmfuse.pipeline import train_runs

    cfg = load_pipeline(path)
    cfg.workdir = tmp_path / "elsewhere"
    with pytest.raises(UserError, match=r"--only data"):
        train_runs(cfg)


def test_only_train_and_only_evaluate_say_which_stage_to_run_first(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.errors import UserError
    from prlmfuse.pipeline import run_pipeline
    from prlmfuse.pipeline_inputs import ensure_data

    cfg = load_pipeline(path)
    cfg.workdir = tmp_path / "work"
    ensure_data(cfg)
    with pytest.raises(UserError, match=r"is not built; run `prlmfuse run .* --only cache` first"):
        run_pipeline(cfg, only="train", names=["fused"])
    # Evaluation reads the caches its run directories name: it never resolves the pipeline's checkpoints.
    prlm = Path(cfg.cache.checkpoints[0].name)
    prlm.rename(prlm.with_name("hidden"))
    try:
        with pytest.raises(UserError, match=r"not trained yet: fused .*--only train` first"):
            run_pipeline(cfg, only="evaluate", names=["fused"])
    finally:
        prlm.with_name("hidden").rename(prlm)


@pytest.mark.slow
def test_a_batch_of_another_seed_is_compared_with_the_baseline_of_that_seed(tiny_pipeline, tmp_path, monkeypatch):
    """evaluate.baseline names seed 1's baseline, which this workdir never trained: `--runs` of seed 2's batch
    compares each of its runs (fused, and a baseline of another recipe) with seed 2's baseline, and a later
    `--runs fused.seed-3` with seed 3's, though seed 2's is trained too."""
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline import run_pipeline

    text = path.read_text().replace("workdir: work", f"workdir: {tmp_path / 'work'}")
    fused = next(line for line in text.splitlines() if line.startswith("    fused: "))
    batch = [fused, "    wide.seed-2: {ffn: 96, seed: 2}"]
    for seed in (2, 3):
        batch += [f"    baseline.seed-{seed}: {{seed: {seed}}}",
                  fused.replace("fused:", f"fused.seed-{seed}:").replace("]}", f"], seed: {seed}}}")]
    seeds = tmp_path / "pipeline.yaml"
    seeds.write_text(text.replace(fused, "\n".join(batch)), encoding="utf-8")
    cfg = load_pipeline(seeds)
    results = run_pipeline(cfg, names=["baseline.seed-2", "wide.seed-2", "fused.seed-2"])
    assert results.baseline == "baseline.seed-2"
    assert {r.run: r.compared_with for r in results.rows} == {
        "baseline.seed-2": None, "wide.seed-2": "baseline.seed-2", "fused.seed-2": "baseline.seed-2"}
    assert not (tmp_path / "work" / "runs" / "baseline").exists()

    run_pipeline(cfg, only="train", names=["baseline.seed-3"])
    results = run_pipeline(cfg, names=["fused.seed-3"])
    assert results.baseline == "baseline.seed-3"
    assert {r.run: r.compared_with for r in results.rows} == {
        "baseline.seed-3": None, "baseline.seed-2": "baseline.seed-3", "fused.seed-3": "baseline.seed-3"}

    # A baseline seed still training (another batch, beside this one) is not decoded from its checkpoints so far.
    import dataclasses

    from prlmfuse.train_fused import run_dir as rundir

    real = rundir.state_to_resume

    def seed_2_mid_training(run_dir):
        state = real(run_dir)
        return dataclasses.replace(state, update=1) if Path(run_dir).name == "baseline.seed-2" else state

    monkeypatch.setattr(rundir, "state_to_resume", seed_2_mid_training)
    results = run_pipeline(cfg, only="evaluate", names=["fused.seed-3"])
    assert {r.run for r in results.rows} == {"baseline.seed-3", "fused.seed-3"}


@pytest.mark.slow
def test_the_same_pipeline_file_runs_under_torchrun(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    distributed = tmp_path / "pipeline.yaml"
    distributed.write_text(path.read_text().replace("workdir: work", f"workdir: {tmp_path / 'work'}"))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "prlmfuse.cli", "run", str(distributed)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    work = tmp_path / "work"
    for run in ("baseline", "fused"):
        info = json.loads((work / "runs" / run / "run.json").read_text())
        assert info["world_size"] == 2
    assert "fused" in (work / "results" / "results.md").read_text(encoding="utf-8")


def test_selected_runs_build_only_the_caches_they_read(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import build_caches, ensure_data

    second_prlm = small_runs.tiny_prlm(tmp_path / "other", layers=2, width=16)
    text = path.read_text(encoding="utf-8").replace(
        "      layers: [-2]\n", f"      layers: [-2]\n    - name: {second_prlm}\n      layers: [-1]\n", 1)
    other = tmp_path / "pipeline.yaml"
    other.write_text(text.replace("workdir: work", f"workdir: {tmp_path / 'work'}"), encoding="utf-8")
    cfg = load_pipeline(other)
    corpus = ensure_data(cfg)

    def built() -> set[str]:
        return {p.parent.parent.name for p in (tmp_path / "work").rglob("manifest.json")}

    # Until the second checkpoint exists, resolving it fails: the selected runs must not touch it
    # (an offline alias would be converted by resolving it).
    hidden = second_prlm.with_name("other-hidden")
    second_prlm.rename(hidden)
    build_caches(cfg, corpus, ["baseline"])
    assert built() == set()  # the baseline reads no cache
    build_caches(cfg, corpus, ["fused"])
    assert len(built()) == 1  # the fused run's checkpoint only, not the unused second one
    hidden.rename(second_prlm)
    build_caches(cfg, corpus)
    assert len(built()) == 2


def test_a_cached_layer_the_prlm_lacks_names_the_entry_before_any_cache_is_built(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.errors import UserError
    from prlmfuse.pipeline_inputs import build_caches, ensure_data

    second_prlm = small_runs.tiny_prlm(tmp_path / "other", layers=2, width=16)
    text = path.read_text(encoding="utf-8").replace(
        "      layers: [-2]\n", f"      layers: [-2]\n    - name: {second_prlm}\n      layers: [-1, -9]\n", 1)
    other = tmp_path / "pipeline.yaml"
    other.write_text(text.replace("workdir: work", f"workdir: {tmp_path / 'work'}"), encoding="utf-8")
    cfg = load_pipeline(other)
    corpus = ensure_data(cfg)
    with pytest.raises(UserError) as e:
        build_caches(cfg, corpus)
    assert str(e.value).startswith(f"{other}: cache.checkpoints.1.layers ({second_prlm}): layer index -9 is outside")
    assert "valid range is -3..2" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "work").rglob("manifest.json"))  # not even the first entry's caches
    # the plan (--dry-run) checks the same before it sizes any model, and a run's own layer names the run
    from prlmfuse.plan import plan_lines

    with pytest.raises(UserError, match=r"cache\.checkpoints\.1\.layers .*layer index -9 is outside"):
        plan_lines(cfg, None)
    out_of_range = tmp_path / "run-layer.yaml"
    out_of_range.write_text(path.read_text(encoding="utf-8").replace("layer: -2}", "layer: 7}")
                            .replace("workdir: work", f"workdir: {tmp_path / 'work'}"), encoding="utf-8")
    with pytest.raises(UserError) as e:
        plan_lines(load_pipeline(out_of_range), None)
    assert str(e.value).startswith(f"{out_of_range}: train.runs.fused.prlms.0.layer: ") and "-4..3" in str(e.value)


def test_a_bleu_tokenizer_that_cannot_run_here_stops_the_run_before_any_cache_or_training(tiny_pipeline, tmp_path,
                                                                                          monkeypatch):
    # Scoring is the last stage: a tokenizer missing here (MeCab for ja-mecab, mecab-ko for ko-mecab) must stop
    # the command before hours of caching and training, not after; --no-score goes on, as on an offline node.
    root, path, _ = tiny_pipeline
    from prlmfuse import pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.errors import UserError
    from prlmfuse.evaluate import metrics

    def no_mecab(tokenize, **kwargs):  # what sacrebleu raises where MeCab or its dictionary is missing
        raise RuntimeError("Please install MeCab:\n    pip install mecab-python3")

    monkeypatch.setattr(metrics, "BLEU", no_mecab)
    cfg = load_pipeline(path)
    cfg.workdir = tmp_path / "work"
    with pytest.raises(UserError) as e:
        pipeline.run_pipeline(cfg)
    message = str(e.value)
    assert "\n" not in message and "is not usable here (Please install MeCab: pip install mecab-python3)" in message
    assert f"`prlmfuse run {path} --no-score`" in message and "`prlmfuse score`" in message
    assert not list((tmp_path / "work").rglob("manifest.json")) and not (tmp_path / "work" / "runs").exists()

    class PastTheCheck(Exception):
        pass

    def caches(*args, **kwargs):
        raise PastTheCheck

    monkeypatch.setattr(pipeline, "build_caches", caches)
    with pytest.raises(PastTheCheck):
        pipeline.run_pipeline(cfg, score=False)
    with pytest.raises(PastTheCheck):
        pipeline.run_pipeline(cfg, only="cache")


def test_a_stage_run_before_the_one_it_needs_names_the_command_and_trains_nothing(tiny_pipeline, tmp_path):
    root, path, _ = tiny_pipeline
    from prlmfuse.config import load_pipeline
    from prlmfuse.errors import UserError
    from prlmfuse.pipeline import run_pipeline

    cfg = load_pipeline(path)
    cfg.workdir = tmp_path / "work"
    run_pipeline(cfg, only="data")
    # The baseline reads no cache, yet trains no more than the fused run before the caches exist.
    with pytest.raises(UserError, match=rf"cache .* is not built; run `prlmfuse run {path} --only cache` first"):
        run_pipeline(cfg, only="train")
    assert not (tmp_path / "work" / "runs").exists()
    with pytest.raises(UserError) as e:
        run_pipeline(cfg, only="evaluate")
    assert str(e.value) == (f"not trained yet: baseline, fused (no checkpoint under {tmp_path / 'work' / 'runs'}); "
                            f"run `prlmfuse run {path} --only train` first")
    assert not (tmp_path / "work" / "results").exists()


def test_features_held_in_memory_are_counted_per_run_at_once_and_refused_past_what_is_available(
        tiny_pipeline, tmp_path, monkeypatch):
    """in_memory_features: each run's process holds its own copy of the layers it reads of its train and dev
    caches (one layer of an every-layer cache for a fixed layer, all of them for concat); the plan says how much
    the runs trained at once hold, and a plan or a training that would not fit is refused first."""
    root, path, _ = tiny_pipeline
    from prlmfuse import pipeline, pipeline_inputs
    from prlmfuse.cache_features import CacheReader, in_memory_bytes
    from prlmfuse.config import load_pipeline
    from prlmfuse.plan import plan_lines

    text = path.read_text(encoding="utf-8").replace("num_workers: 0,", "num_workers: 0, in_memory_features: true,")
    text = text.replace("layers: [-2]", "layers: all")
    text = text.replace("    fused: {", "    fused2: {prlms: [{checkpoint: PRLM, layer: -2}], seed: 2}\n"
                                       "    concat: {prlms: [{checkpoint: PRLM, layer: concat}]}\n    fused: {")
    prlm = str(small_runs.tiny_prlm(tmp_path / "prlm", layers=3, width=32))
    other = tmp_path / "pipeline.yaml"
    other.write_text(text.replace("PRLM", prlm).replace("workdir: work", f"workdir: {tmp_path / 'work'}")
                     .replace(str(root / "prlm"), prlm), encoding="utf-8")
    cfg = load_pipeline(other)
    corpus = pipeline_inputs.ensure_data(cfg)
    jobs = pipeline_inputs.build_caches(cfg, corpus)
    caches = pipeline_inputs.caches_for_run(cfg.run("fused"), jobs, cfg)[0]
    assert caches == pipeline_inputs.caches_for_run(cfg.run("concat"), jobs, cfg)[0]  # one every-layer cache
    # layer -2 of hidden states 0..3; neither run reads the pooled rows
    one_layer = sum(in_memory_bytes(caches[split], [2], pooled=False) for split in ("train", "dev"))
    every_layer = sum(in_memory_bytes(caches[split], pooled=False) for split in ("train", "dev"))
    assert 0 < one_layer < every_layer / 3

    # What the reader really holds, train split: every array, or the index and one layer.
    everything = CacheReader(caches["train"], in_memory=True)
    held = lambda reader: sum(a.nbytes for arrays in reader._memory.values() for a in arrays.values())  # noqa: E731
    assert held(everything) == in_memory_bytes(caches["train"])
    layer_two = CacheReader(caches["train"])
    layer_two.hold_in_memory([2], pooled=False)
    assert held(layer_two) == in_memory_bytes(caches["train"], [2], pooled=False) < held(everything)
    row = everything.layers.index(2)
    indices = list(range(0, len(everything), 7))
    for a, b in zip(layer_two.features_many(indices, [row]), everything.features_many(indices, [row])):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"layer 1 is not held in memory, only layers \[2\]; hold what"):
        layer_two.features(0, [everything.layers.index(1)])
    with pytest.raises(ValueError, match="its pooled rows are not held in memory"):
        layer_two.pooled(0)

    lines = plan_lines(cfg, None, parallel=2)
    memory = next(line for line in lines if line.startswith("memory:"))
    assert f"fused2 {one_layer / 2**20:.1f} MiB" in memory and f"concat {every_layer / 2**20:.1f} MiB" in memory
    assert f"2 at once hold up to {(every_layer + one_layer) / 2**20:.1f} MiB" in memory
    monkeypatch.setattr(pipeline, "_available_memory", lambda: every_layer + one_layer - 1)
    with pytest.raises(UserError, match=r"concat, fused2? at once hold .*one copy per run.*--jobs"):
        plan_lines(cfg, None, parallel=2)
    assert any(line.startswith("memory:") for line in plan_lines(cfg, None, parallel=1))  # one at a time fits
    with pytest.raises(UserError, match="in_memory_features: false"):
        pipeline.train_runs(cfg, None, jobs=jobs, parallel=2)
    assert not (tmp_path / "work" / "runs").exists()  # refused before any run was set up
    # A run directory too damaged to resume counts as left to train, and is not read past that: --fresh starts
    # it over (train_run's own rule), so the memory check must not refuse it first.
    damaged = tmp_path / "work" / "runs" / "fused"
    damaged.mkdir(parents=True)
    (damaged / "trainer_state.json").write_text("{trunc", encoding="utf-8")
    assert pipeline._left_to_train(cfg, cfg.run("fused"), corpus)
    monkeypatch.setattr(pipeline, "_available_memory", lambda: 10 * every_layer)
    assert pipeline.features_in_memory(cfg, [cfg.run("fused")], jobs, 1).startswith("memory: features held")
