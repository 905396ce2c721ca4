"""`prlmfuse search` on real small data (the Bible's first verses, a random 2-layer BERT cached once): the settings
that cannot learn are pruned at the first rung, test is never read, a killed search resumes with no trial trained
twice, two searches share one journal, workers run as submitit array tasks, and the search section's refusals."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import search_world as sw
from prlmfuse.errors import UserError

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return sw.build_world(tmp_path_factory.mktemp("search-world"))


def _one_trial_per_setting(workdir: Path) -> dict[int, object]:
    trials = sw.study_trials(workdir)
    settings = [t.user_attrs["setting"] for t in trials]
    assert sorted(settings) == [0, 1, 2, 3], settings  # each setting enqueued and trained once
    return {t.user_attrs["setting"]: t for t in trials}


def _started(run_dir: Path) -> int:
    """How often a trial's training started: its train.log's `train: NAME -> ...` lines."""
    return (run_dir / "train.log").read_text().count(f"train: {run_dir.name} -> ")


def _dev_updates(run_dir: Path) -> list[int]:
    from prlmfuse.train_fused import run_dir as rundir

    return [r["update"] for r in rundir.read_metrics(run_dir) if "dev_loss" in r]


# ---------------------------------------------------------------------------- a whole search, in this process


def test_a_search_prunes_the_settings_that_cannot_learn_and_never_reads_test(world, tmp_path, monkeypatch):
    from prlmfuse import search as searching
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import corpus_dir, ensure_data
    from prlmfuse.train_fused import run_dir as rundir

    cfg = load_pipeline(sw.write_pipeline(tmp_path, world))
    # The dry run: the space, its size, the budget against the full grid's (4 x 16). With a reduction factor of 2,
    # synchronous successive halving would train 4 x 4 + 2 x 4 + 1 x 8 = 32 updates.
    plan = "\n".join(searching.dry_run_lines(cfg))
    assert "lr 0.003, 1e-07; layer -2, concat -> 4 settings" in plan
    assert "rungs at 4, 8 updates" in plan and plan.count("[new]") == 4
    assert "at most 64 updates if no trial is pruned (the full grid: 4 × 16); 32 (50%)" in plan

    ensure_data(cfg)  # the corpus is registered (prlmfuse run --only data); from here on test is not to be read
    corpus = corpus_dir(cfg)
    test_files = {os.path.realpath(p) for p in (*world["raw"].glob("test.*"), *corpus.glob("test.*"))}
    assert len(test_files) == 4
    read_as_text: list[str] = []
    real_open = builtins.open

    def spying_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and "b" not in mode and os.path.realpath(file) in test_files:
            read_as_text.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spying_open)
    monkeypatch.setattr(io, "open", spying_open)

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the search evaluated on test")

    monkeypatch.setattr("prlmfuse.evaluate.evaluate_runs", no_evaluation)

    table = searching.run_search(cfg)
    assert read_as_text == [], f"the search read test sentences: {read_as_text}"
    runs = cfg.workdir / "runs"
    for i in range(1, 5):
        info = rundir.read_run_info(runs / f"s-00{i}")
        assert set(info["prlms"][0]["caches"]) == {"train", "dev"}  # a trial never opens a test cache

    rows = {r["run"]: r for r in table["trials"]}
    # lr 1e-7 cannot learn: both such settings lose to the first trial at the first rung (4 updates) and stop there.
    for name in ("s-003", "s-004"):
        assert rows[name]["status"] == "pruned at 4 updates" and rows[name]["updates"] == 4, rows[name]
        state = rundir.state_to_resume(runs / name)
        assert state.stopped == "pruned" and state.update == 4
        log = (runs / name / "train.log").read_text()
        assert f"train: {name} pruned at update 4: dev loss" in log and f"train: {name} done at update 4 (pruned)" in log
        assert rows[name]["dev_loss_at_rungs"].keys() == {"4"}
    assert rows["s-001"]["status"] == "finished" and rows["s-001"]["updates"] == 16
    assert set(rows["s-001"]["dev_loss_at_rungs"]) == {"4", "8"}
    # Every dev loss at the first rung of a learning setting is below every one of a setting that cannot learn.
    learning = [rows[n]["dev_loss_at_rungs"]["4"] for n in ("s-001", "s-002")]
    stuck = [rows[n]["dev_loss_at_rungs"]["4"] for n in ("s-003", "s-004")]
    assert max(learning) < min(stuck)
    best = table["best"]
    assert best["setting"]["lr"] == 0.003 and best["dev_loss"] == min(r["dev_loss"] for r in rows.values()
                                                                       if r["dev_loss"] is not None)
    assert table["updates_spent"] == sum(r["updates"] for r in rows.values()) < table["full_grid_updates"] == 64
    assert table["share_of_full_grid"] == table["updates_spent"] / 64
    trials = _one_trial_per_setting(cfg.workdir)
    assert [trials[i].state for i in (2, 3)] == [TrialState.PRUNED, TrialState.PRUNED]
    assert trials[0].state == TrialState.COMPLETE and trials[0].value == rows["s-001"]["dev_loss"]
    md = (cfg.workdir / "search" / "s" / "trials.md").read_text()
    assert "| s-003 | 1e-07 | -2 |" in md and "pruned at 4 updates" in md and f"best: {best['run']}" in md
    written = json.loads((cfg.workdir / "search" / "s" / "trials.json").read_text())
    assert written["updates_spent"] == table["updates_spent"]

    # The same command again trains nothing.
    stamps = {p: p.stat().st_mtime_ns for p in runs.glob("s-00*/trainer_state.json")}
    again = searching.run_search(cfg)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and again["trials"] == table["trials"]

    # --confirm: the winner and its two baselines at the full budget, then test, once, by the pipeline's evaluation.
    monkeypatch.undo()
    confirmed = searching.run_search(cfg, confirm=True)
    results = json.loads((cfg.workdir / "search" / "s" / "confirm" / "results.json").read_text())
    rows = {r["run"]: r for r in results["rows"]}
    assert set(rows) == {"s-best", "s-baseline", "s-baseline-matched"}
    assert rows["s-best"]["compared_with"] == "s-baseline" and confirmed["confirm"] is not None
    best_info = rundir.read_run_info(runs / "s-best")
    matched_info = rundir.read_run_info(runs / "s-baseline-matched")
    assert best_info["train"]["lr"] == best["setting"]["lr"] and not matched_info["prlms"]
    assert abs(matched_info["trainable_parameters"] / best_info["trainable_parameters"] - 1) < 0.01
    assert rundir.state_to_resume(runs / "s-best").update == 16


def test_check_pruned_trains_the_nearest_pruned_trials_on_from_copies_and_leaves_the_search_as_it_was(world, tmp_path):
    from prlmfuse import search as searching
    from prlmfuse.config import load_pipeline
    from prlmfuse.train_fused import run_dir as rundir

    cfg = load_pipeline(sw.write_pipeline(tmp_path, world))
    table = searching.run_search(cfg)
    runs = cfg.workdir / "runs"
    rows = {r["run"]: r for r in table["trials"]}
    pruned = [r["run"] for r in table["trials"] if r["status"].startswith("pruned")]
    assert {"s-003", "s-004"} <= set(pruned) and "checked" not in table
    # The nearest to going on: the highest rung reached, then the lowest dev loss there. Which rung a learning
    # trial is pruned at depends on the order the trials report in, so each is read from its own row.
    rung = {name: max(rows[name]["dev_loss_at_rungs"], key=int) for name in pruned}
    nearest = sorted(pruned, key=lambda name: (-int(rung[name]), rows[name]["dev_loss_at_rungs"][rung[name]]))[:2]
    stamps = {p: p.stat().st_mtime_ns for p in runs.glob("s-00*/**/*") if p.is_file()}

    # Two children at once: each resumes its copy from the checkpoint where its trial was pruned.
    table = searching.run_search(cfg, check=2, jobs=2)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the trials' own directories are untouched
    checked = {c["run"]: c for c in table["checked"]}
    assert sorted(checked) == sorted(nearest)
    for name, c in checked.items():
        copy = cfg.workdir / "search" / "s" / "check" / name
        state = rundir.state_to_resume(copy)
        assert state.update == c["updates"] == 16 and state.stopped is None and c["pruned_at"] == int(rung[name])
        assert c["dev_loss"] == state.last_dev_loss and c["status"] == "trained to the full budget"
        assert c["dev_loss_when_pruned"] == rows[name]["dev_loss_at_rungs"][rung[name]]
        assert f"train: {name} resumes at update {rung[name]}" in (copy / "train.log").read_text()
        assert rundir.state_to_resume(runs / name).stopped == "pruned"
    added = sum(16 - c["updates_when_pruned"] for c in checked.values())
    assert table["check_updates"] == added and table["updates_spent"] < table["full_grid_updates"]
    lines = searching.summary_lines(table)
    best = table["best"]["dev_loss"]
    for name, c in checked.items():
        side = "below" if c["dev_loss"] < best else "above"
        assert (f"check: {name} (pruned at {c['pruned_at']} updates) trained on to 16 updates: dev loss "
                f"{c['dev_loss']:.4f}, {side} the best's {best:.4f}") in " ".join(lines)
    assert lines[-1] == f"check spent {added} updates more"
    md = (cfg.workdir / "search" / "s" / "trials.md").read_text()
    for name, c in checked.items():
        setting = rows[name]["setting"]
        assert (f"| {name} | {setting['lr']} | {setting['layer']} | {c['pruned_at']} | {c['dev_loss_when_pruned']:.4f} "
                "| 16 |") in md

    # The same command again trains nothing more; asking for fewer checks keeps the ones done.
    copies = {p: p.stat().st_mtime_ns for p in (cfg.workdir / "search" / "s" / "check").glob("*/trainer_state.json")}
    again = searching.run_search(cfg, check=1)
    assert {p: p.stat().st_mtime_ns for p in copies} == copies and again["checked"] == table["checked"]


def test_the_check_lines_say_when_the_pruner_stopped_a_setting_better_than_the_best():
    from prlmfuse.search_report import summary_lines

    table = {"search": "s", "trials": [{}, {}], "counts": {"finished": 1, "pruned": 1, "running": 0, "stopped": 0,
                                                           "waiting": 0, "failed": 0},
             "best": {"run": "s-001", "setting": {"layer": "concat"}, "dev_loss": 4.40}, "full_budget": 3000,
             "unit": "updates", "full_grid_updates": None, "check_updates": 2400,
             "checked": [{"run": "s-002", "pruned_at": 600, "updates": 3000, "dev_loss": 4.35},
                         {"run": "s-003", "pruned_at": 600, "updates": 1200, "dev_loss": None}]}
    assert summary_lines(table)[2:] == [
        "check: s-002 (pruned at 600 updates) trained on to 3000 updates: dev loss 4.3500, below the best's 4.4000: "
        "the pruner stopped a setting better than the best",
        "check: s-003 (pruned at 600 updates) is training on, at update 1200; rerun the same command to finish it",
        "check spent 2,400 updates more"]


# ---------------------------------------------------------------------------- kill and resume


def test_a_killed_search_resumes_its_running_trial_and_trains_no_trial_twice(world, tmp_path):
    # A first rung at 32 updates: the second trial trains for a while before anything can prune it, so the stop
    # lands before that rung even where this process is slow to see the trial start.
    path = sw.write_pipeline(tmp_path, world, full=64, least=32)
    workdir = tmp_path / "work"
    runs = workdir / "runs"
    proc = sw.start("search", path)
    sw.wait_for(lambda: (runs / "s-001" / "trainer_state.json").is_file() and sw.updates_logged(runs / "s-002") >= 1,
                proc, what="the first trial to finish and the second to start")
    first_done = (runs / "s-001" / "trainer_state.json").stat().st_mtime_ns
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out
    assert "stopped by SIGTERM" in out and "Traceback" not in out
    from prlmfuse.train_fused import run_dir as rundir

    stopped_at = rundir.state_to_resume(runs / "s-002").update
    assert 1 <= stopped_at < 32
    trials = _one_trial_per_setting(workdir)
    assert [trials[i].state for i in range(4)] == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING,
                                                     TrialState.WAITING]

    again = sw.cli("search", path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "s-002 (lr 0.003, layer concat) resumed" in again.stderr
    assert f"train: s-002 resumes at update {stopped_at} from a stop signal's resume point" in \
        (runs / "s-002" / "train.log").read_text()
    assert (runs / "s-001" / "trainer_state.json").stat().st_mtime_ns == first_done  # finished: not trained again
    trials = _one_trial_per_setting(workdir)
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials.values())
    assert [trials[i].state for i in (2, 3)] == [TrialState.PRUNED, TrialState.PRUNED]
    for i in range(1, 5):
        dev = _dev_updates(runs / f"s-00{i}")
        assert dev == sorted(set(dev)), dev  # no update evaluated twice
    assert [_started(runs / f"s-00{i}") for i in (1, 3, 4)] == [1, 1, 1]
    assert "search s: 4 settings" in again.stdout and "pruned" in again.stdout


# ---------------------------------------------------------------------------- workers sharing a journal


def test_two_searches_share_one_journal_and_split_the_trials_between_them(world, tmp_path):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import ensure_data

    path = sw.write_pipeline(tmp_path, world)
    ensure_data(load_pipeline(path))
    runs, folder = tmp_path / "work" / "runs", tmp_path / "work" / "search" / "s"
    # The second search starts while the first trains s-001, held still (SIGSTOP) outside the journal's and the
    # claims' locks, and goes on once the second has claimed a trial of its own: each trains a share, whatever
    # either's start-up costs on a loaded machine.
    first = sw.start("search", path)
    second = None
    try:
        sw.wait_for(lambda: "train: s-001 -> " in _read(runs / "s-001" / "train.log"), first, what="the first to train")
        os.killpg(first.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while list(folder.glob("*.lock")) and time.monotonic() < deadline:  # stopped inside a lock: let it out first
            os.killpg(first.pid, signal.SIGCONT)
            time.sleep(0.01)
            os.killpg(first.pid, signal.SIGSTOP)
        assert not list(folder.glob("*.lock")), list(folder.glob("*.lock"))
        second = sw.start("search", path)
        sw.wait_for(lambda: any((runs / f"s-00{i}" / "train.log").is_file() for i in (2, 3, 4)), second,
                    what="the second to claim a trial")
        os.killpg(first.pid, signal.SIGCONT)
    except BaseException:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    outs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert "1 running elsewhere (s-001)" in outs[1], outs[1]
    claimed = [{n for n in ("s-001", "s-002", "s-003", "s-004") if f"search: {n} (" in out} for out in outs]
    assert "s-001" in claimed[0] and claimed[1], claimed  # each trained a share of the trials...
    assert not claimed[0] & claimed[1] and claimed[0] | claimed[1] == {"s-001", "s-002", "s-003", "s-004"}, claimed
    trials = _one_trial_per_setting(tmp_path / "work")  # ...and no trial twice
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials.values())
    assert [_started(runs / f"s-00{i}") for i in range(1, 5)] == [1, 1, 1, 1]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_search_workers_run_as_submitit_array_tasks(world, tmp_path):
    path = sw.write_pipeline(tmp_path, world, launcher="launcher: {time: 30}\n")
    done = sw.cli("search", path, "--launcher", "slurm", "--jobs", "2", PRLMFUSE_SUBMITIT_CLUSTER="local",
                  PRLMFUSE_SUBMITIT_POLL_S="0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "search: 2 task(s) submitted as submitit local jobs" in done.stderr
    assert "search: worker-1 finished in" in done.stderr and "search: worker-2 finished in" in done.stderr
    search = tmp_path / "work" / "search" / "s"
    logs = [(search / f"worker-{k}.log").read_text() for k in (1, 2)]
    # Which worker takes which trial depends on which started first; between them each trial once.
    claimed = [{n for n in ("s-001", "s-002", "s-003", "s-004") if f"search: {n} (" in log} for log in logs]
    assert not claimed[0] & claimed[1] and claimed[0] | claimed[1] == {"s-001", "s-002", "s-003", "s-004"}, claimed
    trials = _one_trial_per_setting(tmp_path / "work")
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials.values())
    counts = json.loads((search / "trials.json").read_text())["counts"]
    assert counts["finished"] >= 1 and counts["finished"] + counts["pruned"] == 4, counts


# ---------------------------------------------------------------------------- leases, verdicts, the trials' recipe


@pytest.mark.parametrize("taken", ["before its first dev evaluation", "after its last"])
def test_a_worker_whose_lease_was_taken_over_stops_and_tells_the_study_nothing(world, tmp_path, monkeypatch, caplog,
                                                                                taken):
    import dataclasses
    import logging

    from prlmfuse import search as searching
    from prlmfuse.config import load_pipeline
    from prlmfuse.fileio import atomic_write_json
    from prlmfuse.pipeline_inputs import build_caches, ensure_data
    from prlmfuse.train_fused import run_dir as rundir

    cfg = load_pipeline(sw.write_pipeline(tmp_path, world))
    tcfg = searching.trials_pipeline(cfg)
    build_caches(tcfg, ensure_data(tcfg), [t.name for t in cfg.search.trials], splits=searching.TRAIN_SPLITS)
    searching.open_study(cfg, create=True)
    # This worker stalls past the lease's timeout, and another worker takes s-001 over (its own lease, another
    # nonce): just before this one's first dev evaluation, or after its last (before it tells the study).
    theirs = {"owner": "node9:4242:1", "host": "node9", "pid": 4242, "start": "1", "trial": 0, "nonce": "theirs"}
    real_reporter, real_claim = searching._rung_reporter, searching.claim_next

    def taken_over(search, trial, lease, nonce):
        hook = real_reporter(search, trial, lease, nonce)

        def after(evaluation):
            if taken.startswith("before"):
                atomic_write_json(lease, theirs)
            verdict = hook.after(evaluation)
            if evaluation.update == 16:
                atomic_write_json(lease, theirs)
            return verdict

        return dataclasses.replace(hook, after=after)

    claims = []

    def first_claim_only(*args):
        claims.append(None if claims else real_claim(*args))
        return claims[-1]

    monkeypatch.setattr(searching, "_rung_reporter", taken_over)
    monkeypatch.setattr(searching, "claim_next", first_claim_only)
    with caplog.at_level(logging.INFO, logger="prlmfuse"):
        assert searching.work(cfg, progress=False) == 0
    run = cfg.workdir / "runs" / "s-001"
    trial = _one_trial_per_setting(cfg.workdir)[0]
    assert trial.state == TrialState.RUNNING and trial.value is None  # the study was told nothing
    if taken.startswith("before"):
        assert "search: s-001: lease lost at its dev evaluation at update 4 (node9:4242:1 holds it now)" in caplog.text
        assert rundir.state_to_resume(run) is None and _dev_updates(run) == []  # nothing saved at that evaluation
        assert trial.intermediate_values == {}
    else:
        assert "search: s-001: lease lost at its end (node9:4242:1 holds it now)" in caplog.text
        assert rundir.state_to_resume(run).update == 16
    assert json.loads((cfg.workdir / "search" / "s" / "leases" / "s-001.json").read_text()) == theirs


def test_a_prune_verdict_lost_by_a_crash_stops_the_resumed_trial_at_that_rung(world, tmp_path):
    # optuna records a trial's rung before it decides: asked again at that rung (a worker died after the verdict,
    # before the checkpoint), it finds the rung done and says go on. The verdict is kept in the trial instead.
    from types import SimpleNamespace

    from prlmfuse import search as searching
    from prlmfuse.train_fused.trainer import DevEvaluation

    search = SimpleNamespace(rungs=[4, 8], reduction_factor=2, unit="updates")
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(
        min_resource=4, reduction_factor=2, min_early_stopping_rate=0))

    def at(update: int, loss: float) -> DevEvaluation:
        return DevEvaluation(update=update, epoch=0, epoch_end=False, dev_loss=loss)

    good = study.ask()
    assert searching._rung_reporter(search, good).after(at(4, 1.0)) is None
    study.tell(good, 1.0)
    weak = study.ask()
    verdict = searching._rung_reporter(search, weak).after(at(4, 2.0))
    assert verdict.startswith("pruned: dev loss 2.0000 at 4 updates")
    # The worker died; the trial resumes from a checkpoint before the rung and reaches it again.
    resumed = searching._rung_reporter(search, optuna.Trial(study, weak._trial_id))
    assert resumed.after(at(2, 2.5)) is None
    assert resumed.after(at(4, 1.5)) == verdict


def test_only_the_array_tasks_own_worker_keeps_its_slurm_identity(monkeypatch):
    from prlmfuse.launch import ARRAY_TASK_ENV
    from prlmfuse.search_study import worker_identity

    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv(ARRAY_TASK_ENV, str(os.getppid()))  # this process is the command the array task runs
    assert worker_identity()["owner"] == "slurm:77_2"
    # One of the local workers of a `search --jobs N` the array task runs: its own host, pid and start time.
    monkeypatch.setenv(ARRAY_TASK_ENV, str(os.getppid() + 1))
    local = worker_identity()
    assert local["owner"] == f"{local['host']}:{os.getpid()}:{local['start']}"
    monkeypatch.delenv(ARRAY_TASK_ENV)
    assert worker_identity()["owner"] == local["owner"]


def test_trials_train_to_the_full_budget_whatever_the_base_runs_patience(world, tmp_path):
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world)
    fused = "fused: {prlms: [{checkpoint: tiny, layer: -2}]"
    path.write_text(path.read_text().replace(fused + "}", fused + ", patience: 1, min_epochs: 1}"))
    cfg = load_pipeline(path)
    assert cfg.train.runs[0].patience == 1
    assert {(t.patience, t.min_epochs, t.max_updates) for t in cfg.search.trials} == {(None, None, 16)}
    assert {(r.patience, r.min_epochs) for r in cfg.search.confirm_runs(cfg.search.settings[0])} == {(None, None)}


def test_a_first_rung_inside_the_warmup_is_warned_about(world, tmp_path, monkeypatch, caplog):
    import logging

    from prlmfuse import search as searching
    from prlmfuse.config import load_pipeline

    warning = ("min_updates 3 is below twice the trials' warmup (2 updates): the first rung ranks the trials near the "
               "learning rate's peak, which says little about where they end; set min_updates to 4 or more (or a "
               "shorter warmup)")
    cfg = load_pipeline(sw.write_pipeline(tmp_path, world, least=3))
    assert f"warning: {warning}" in searching.dry_run_lines(cfg)

    def stop(*args, **kwargs):
        raise RuntimeError("stopped here")

    monkeypatch.setattr(searching, "open_study", stop)
    with caplog.at_level(logging.WARNING, logger="prlmfuse"), pytest.raises(RuntimeError, match="stopped here"):
        searching.run_search(cfg)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"search: s: {warning}"]
    fine = load_pipeline(sw.write_pipeline(tmp_path / "fine", world, least=4))
    assert not [line for line in searching.dry_run_lines(fine) if line.startswith("warning:")]


def test_the_dry_run_names_hyperbands_brackets_and_warns_of_a_single_trial_one(world, tmp_path):
    from prlmfuse import search as searching
    from prlmfuse.config import load_pipeline

    # Study "h": optuna's HyperbandPruner puts h-003 alone in bracket 2 (crc32 of the study's name and the number).
    path = sw.write_pipeline(tmp_path, world, search_extra="  pruner: hyperband\n")
    path.write_text(path.read_text().replace("  name: s\n", "  name: h\n"))
    plan = searching.dry_run_lines(load_pipeline(path))
    assert ("hyperband brackets (each prunes among its own trials): 0: 3 trials, first rung at 4 updates; 2: 1 trial, "
            "first rung at 16 updates") in plan
    assert ("warning: hyperband bracket 2 holds a single trial (h-003): nothing is compared with it, so it is never "
            "pruned") in plan
    # optuna's own assignment
    pruner = optuna.pruners.HyperbandPruner(min_resource=4, max_resource=16, reduction_factor=2)
    study = optuna.create_study(study_name="h", pruner=pruner)
    trials = [study.ask() for _ in range(4)]
    pruner._try_initialization(study)
    assert [pruner._get_bracket_id(study, t) for t in trials] == [0, 0, 2, 0]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("change, where, message", [
    ({"space: {lr": "space: {lrr"}, "search.space.lrr", "unknown setting; did you mean 'lr'?"),
    ({"min_updates: 4": "min_updates: 16"}, "search.min_updates", "expected an integer from 1 to 15"),
    ({"layer: [-2, concat]": "layer: [-2, contact]"}, "search.space.layer.1",
     "setting 2 (lr 0.003, layer contact): 'contact' is not a layer index"),
    ({"layer: [-2, concat]": "layer: [-2, -2]"}, "search.space.layer.1", "-2 appears twice"),
    ({"base: fused": "base: fuzed"}, "search.base", "no run named 'fuzed' in train.runs; did you mean 'fused'?"),
    ({"base: fused": "base: base"}, "search.base", "run 'base' has no PrLM; add checkpoint to search.space"),
    ({"reduction_factor: 2": "reduction_factr: 2"}, "search.reduction_factr", "did you mean 'reduction_factor'?"),
    ({"reduction_factor: 2": "reduction_factor: 2\n  pruner: median"}, "search.pruner", "'median' is not one of"),
    ({"min_updates: 4": "min_epochs: 4"}, "search.min_epochs", "min_epochs goes with max_epochs"),
    ({"name: s": "name: fused"}, "search.name", "'fused-best' is also a run of train.runs"),
])
def test_the_search_section_is_refused_where_it_is_wrong(world, tmp_path, change, where, message):
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world)
    text = path.read_text()
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    if "name: fused" in text:
        text = text.replace("    base: {}\n", "    base: {}\n    fused-best: {}\n")
    path.write_text(text)
    with pytest.raises(UserError) as refused:
        load_pipeline(path)
    line = str(refused.value)
    located = re.match(rf"^{re.escape(str(path))}:(\d+):(\d+): {re.escape(where)}: (.*)$", line)
    assert located and message in located.group(3), line
    row, col = int(located.group(1)), int(located.group(2))
    assert text.splitlines()[row - 1][col - 1:].strip(), line  # the place named holds the value or key


def test_a_layer_the_cache_does_not_hold_is_refused_at_the_value(world, tmp_path):
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world, space="{layer: [-2, dwatt]}")
    path.write_text(path.read_text().replace("layers: all", "layers: [-2]"))
    with pytest.raises(UserError, match=r"pipeline.yaml:\d+:\d+: search.space.layer.1: 'dwatt' combines the cached "
                                        r"layers, but cache.checkpoints.0 \(tiny\) stores only \[-2\]"):
        load_pipeline(path)
    path.write_text(path.read_text().replace("{layer: [-2, dwatt]}", "{layer: [-2, -3]}"))
    with pytest.raises(UserError, match=r"search.space.layer.1: layer -3 is not cached"):
        load_pipeline(path)


def test_search_without_optuna_says_what_to_install_in_one_line(world, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "optuna.py").write_text("raise ImportError('optuna is not installed here')\n")
    path = sw.write_pipeline(tmp_path, world)
    done = sw.cli("search", path, PYTHONPATH=str(blocked))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("error: prlmfuse search needs optuna, which is not installed: "
                                                    "pip install 'prlmfuse[search]' (optuna and submitit)")
    assert not (tmp_path / "work" / "search").exists()
