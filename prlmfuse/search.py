"""`prlmfuse search PIPELINE`: which fusion setting pays on this corpus, found by training every setting of the
pipeline file's `search:` grid from the cache and stopping the weak ones early.

Each setting of the grid is one trial, a run directory like any other (runs/NAME-001/, with its run.json),
trained from the cache with no PrLM loaded. The study lives in a journal file
(optuna's JournalStorage(JournalFileBackend), workdir/search/NAME/journal.log): every setting is enqueued
once, in the grid's order, so none is trained twice; a trial reports its dev loss at each rung (a dev
evaluation the trainer adds there, through its dev hook) and the pruner (successive halving or hyperband)
stops it there when it is not among the best 1/reduction_factor of the trials that reached that rung so
far. A pruned run says so in its trainer state (`stopped: pruned`, `done at update N (pruned)` in the plan)
and in its train.log.

Workers (this process with --jobs 1, else --jobs child processes or SLURM array tasks, each `prlmfuse search
PIPELINE --worker`) share the journal. A worker claims a trial under a lock beside the journal and holds a
lease on it (workdir/search/NAME/leases/RUN.json, its mtime renewed every 30 s): a running trial whose
worker is gone (a dead process on this host, a lease older than 10 minutes, or the same SLURM array task
requeued) is resumed from its checkpoint or resume point by the next worker, so a search killed or
preempted goes on where it stopped when the same command runs again. Each claim puts a nonce in its lease: a
worker stalled past the lease's timeout, whose trial another worker took over meanwhile, finds another nonce at
its next dev evaluation and leaves the trial to that worker, telling the study nothing. A pruner's verdict is
kept in the trial (user attribute `pruned`) before the trainer acts on it, so a trial resumed after a crash
between the verdict and its checkpoint stops where it was pruned.

The end: a table of every trial (workdir/search/NAME/trials.md and trials.json): its settings, trainable
parameters, updates trained, dev loss at each rung and at the full budget, pruned or finished; the best
setting; the updates spent as a share of training every setting to the full budget. `--confirm` then
trains the winner, the plain baseline and the baseline matched to the winner's parameters to the full
budget as plain runs (NAME-best, NAME-baseline, NAME-baseline-matched) and evaluates them on test once,
compared by the paired bootstrap (workdir/search/NAME/confirm/). The search itself never reads test: it
builds no test cache and evaluates on dev only.

This module holds the driver (`run_search`) and the workers, and is where callers import every name of the
search from; prlmfuse.search_study holds what the workers share (the study, the claims lock, the leases),
prlmfuse.search_report the --dry-run plan, the table and --confirm.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prlmfuse import signals
from prlmfuse.config import PipelineConfig
from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json
from prlmfuse.launch import Task, launch, require, say
from prlmfuse.pipeline_inputs import (build_caches, caches_for_run, cache_jobs, ensure_data, ensure_workdir,
                                      resolve_run, run_path)
from prlmfuse.search_report import (CHECK, TABLE_JSON, TABLE_MD, check_dir, check_progress, confirm_search,
                                    dry_run_lines, pruned_to_check, summary_lines, table_markdown, train_confirm_run,
                                    write_table)
from prlmfuse.search_space import SearchConfig
from prlmfuse.search_study import (JOURNAL, LEASES, Heartbeat, amount, claims_lock, holds_lease, import_optuna,
                                   lease_path, lease_state, new_lease, open_study, read_lease, search_dir, the_search,
                                   trials_pipeline, with_runs, worker_identity)
from prlmfuse.train_fused import run_dir as rundir

# What callers import from here (the `search` command among them), wherever it is defined.
__all__ = ["TABLE_JSON", "TABLE_MD", "claim_next", "dry_run_lines", "open_study", "run_search", "search_dir",
           "summary_lines", "table_markdown", "the_search", "train_check_run", "train_confirm_run", "trials_pipeline",
           "with_runs", "work", "worker_identity", "worker_task", "write_table"]

logger = logging.getLogger(__name__)

# The splits a search reads: never test.
TRAIN_SPLITS = ("train", "dev")
# A trial's user attribute holding the pruner's verdict ({"step": N, "verdict": "pruned: ..."}), written before the
# trainer acts on it: optuna records the rung before it decides, so a trial resumed after a crash between the
# verdict and its checkpoint would not be judged at that rung again; the resumed trial stops there instead.
PRUNED_ATTR = "pruned"


class LeaseLost(Exception):
    """This worker's claim on a trial was taken over by another worker (its lease holds another nonce)."""


# ---------------------------------------------------------------------------- a worker


@dataclass
class Claim:
    trial: Any  # optuna.Trial
    index: int  # the setting's index in the grid
    resumed: bool  # a running trial whose worker was gone
    nonce: str = ""  # this claim's, in its lease


def claim_next(cfg: PipelineConfig, study, me: dict) -> Claim | None:
    """The next trial for this worker, under the claims lock: a running trial whose worker is gone (resumed from
    its checkpoint) first, else the next setting still waiting; None when neither is left."""
    optuna = import_optuna()
    from optuna.trial import TrialState

    search = the_search(cfg)
    with claims_lock(search_dir(cfg)):
        trials = study.get_trials(deepcopy=False)
        for t in trials:
            if t.state != TrialState.RUNNING:
                continue
            path = lease_path(cfg, t.user_attrs["run"])
            if lease_state(path, me) in ("free", "mine"):
                lease = new_lease(me, t.number)
                atomic_write_json(path, lease)
                return Claim(optuna.Trial(study, t._trial_id), t.user_attrs["setting"], True, lease["nonce"])
        if not any(t.state == TrialState.WAITING for t in trials):
            return None
        trial = study.ask()
        index = trial.user_attrs.get("setting")
        if index is None:  # not one of ours (the queue was emptied by another process): give it back
            study.tell(trial, state=TrialState.FAIL)
            return None
        for key, values in search.space.items():
            trial.suggest_categorical(key, values)
        lease = new_lease(me, trial.number)
        atomic_write_json(lease_path(cfg, search.trial_name(index)), lease)
        return Claim(trial, index, False, lease["nonce"])


def _rung_reporter(search: SearchConfig, trial, lease: Path | None = None, nonce: str = ""):
    """The trainer's dev hook for one trial: at every dev evaluation, check that this worker still holds the trial's
    lease (`lease`, with `nonce`; else raise LeaseLost: another worker trains it now); at each rung, report the dev
    loss and ask the pruner, its "prune" recorded in the trial (PRUNED_ATTR) before the trainer acts on it; a
    verdict recorded before (a worker that died before the checkpoint) stops the resumed trial where it was
    given."""
    rungs = set(search.rungs)
    eta = search.reduction_factor
    given = trial.user_attrs.get(PRUNED_ATTR)

    def after(evaluation) -> str | None:
        if lease is not None and not holds_lease(lease, nonce):
            raise LeaseLost(f"at update {evaluation.update}")
        if search.unit == "updates":
            step = evaluation.update
        elif evaluation.epoch_end:
            step = evaluation.epoch
        else:
            return None
        if isinstance(given, dict) and step >= int(given.get("step", step + 1)):
            return str(given["verdict"])
        if step not in rungs:
            return None
        with warnings.catch_warnings():  # a resumed trial reports a rung again: optuna keeps the first value
            warnings.simplefilter("ignore")
            trial.report(evaluation.dev_loss, step)
        if trial.should_prune():
            verdict = (f"pruned: dev loss {evaluation.dev_loss:.4f} at {amount(step, search.unit)} is not among the "
                       f"best 1/{eta} of the trials that reached it")
            trial.set_user_attr(PRUNED_ATTR, {"step": step, "verdict": verdict})
            return verdict
        return None

    from prlmfuse.train_fused.trainer import DevHook

    at = frozenset(rungs) if search.unit == "updates" else frozenset()
    return DevHook(at_updates=at, after=after)


def _train_dev_caches(run, jobs, tcfg: PipelineConfig) -> list[dict]:
    """A trial's train and dev caches only: its run.json names no test cache, and nothing opens one."""
    return [{split: c[split] for split in TRAIN_SPLITS} for c in caches_for_run(run, jobs, tcfg)]


@contextlib.contextmanager
def _trial_log(path: Path):
    """The prlmfuse loggers' records also in the trial's train.log while it trains."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("prlmfuse")
    previous = root.level
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        handler.close()


def work(cfg: PipelineConfig, *, progress: bool = True) -> int:
    """A worker: claim and train trials until none is left; the number it trained. A stop signal ends the
    trial being trained with a resume point (the trial stays running for the next worker) and raises Stopped."""
    from optuna.trial import TrialState

    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import train_run

    search = the_search(cfg)
    tcfg = trials_pipeline(cfg)
    runtime = resolve_runtime(cfg.device, cfg.precision)
    corpus = ensure_data(tcfg, build=False)
    jobs = cache_jobs(tcfg, corpus, [t.name for t in search.trials])
    study = open_study(cfg)
    me = worker_identity()
    trained = 0
    with signals.deferred():
        while True:
            if signals.received() is not None:
                raise signals.Stopped(signals.received(), "the search stopped between trials; rerun the same command "
                                                          "to go on")
            claim = claim_next(cfg, study, me)
            if claim is None:
                return trained
            run = search.trials[claim.index]
            out = run_path(tcfg, run.name)
            lease = lease_path(cfg, run.name)
            say(f"search: {run.name} ({search.describe(search.settings[claim.index])})"
                f"{' resumed' if claim.resumed else ''} -> {out}")
            try:
                with _trial_log(out / rundir.TRAIN_LOG), Heartbeat(lease):
                    caches = _train_dev_caches(run, jobs, tcfg)
                    train_run(resolve_run(tcfg, run), corpus, caches, out, resume=True, progress=progress,
                              runtime=runtime, dev_hook=_rung_reporter(search, claim.trial, lease, claim.nonce))
            except LeaseLost as e:
                _lease_lost(run.name, lease, f"its dev evaluation {e}")
                continue
            except signals.Stopped:
                if holds_lease(lease, claim.nonce):
                    lease.unlink(missing_ok=True)  # the trial stays running; the next worker resumes it at once
                raise
            except Exception as e:  # one trial's failure (its cache, its settings): in the table, retried by a rerun
                message = " ".join(str(e).split()) or type(e).__name__
                logger.warning("search: %s failed: %s", run.name, message)
                if holds_lease(lease, claim.nonce):
                    atomic_write_json(lease, {**me, "failed": message})
                continue
            state = rundir.state_to_resume(out)
            with claims_lock(search_dir(cfg)):  # no other worker takes the trial over between the check and the tell
                if not holds_lease(lease, claim.nonce):
                    _lease_lost(run.name, lease, "its end")
                    continue
                if state is not None and state.stopped == "pruned":
                    study.tell(claim.trial, state=TrialState.PRUNED)
                    say(f"search: {run.name} pruned at update {state.update}")
                elif state is not None and state.last_dev_loss is not None:
                    study.tell(claim.trial, state.last_dev_loss)
                    say(f"search: {run.name} finished at update {state.update}, dev loss {state.last_dev_loss:.4f}")
                else:
                    atomic_write_json(lease, {**me, "failed": "training ended without a dev evaluation"})
                    continue
                lease.unlink(missing_ok=True)
            trained += 1


def _lease_lost(name: str, lease: Path, when: str) -> None:
    holder = read_lease(lease) or {}
    logger.warning("search: %s: lease lost at %s (%s holds it now): another worker took the trial over while this "
                   "one was stalled past the lease's timeout; this one leaves the trial to it and tells the study "
                   "nothing", name, when, holder.get("owner", "no worker"))


# ---------------------------------------------------------------------------- --check-pruned


def _check_copy(cfg: PipelineConfig, name: str) -> Path:
    """The check's copy of pruned trial `name`'s run directory, its pruner's stop cleared, so that training resumes
    it from the checkpoint where it was pruned; the trial's own directory stays as the search left it (the table's
    record). Copied under a temporary name and renamed, so that a copy cut short by a kill is never trained on."""
    out = check_dir(cfg, name)
    if out.is_dir():
        return out
    trial_dir = run_path(trials_pipeline(cfg), name)
    state = rundir.latest_trainer_state(trial_dir)
    if state is None or state.stopped != "pruned":
        raise UserError(f"{trial_dir} holds no pruned trial to train on; rerun `prlmfuse search {cfg.path}` to "
                        "finish the search first")
    partial = out.with_name(out.name + ".copying")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(trial_dir, partial, ignore=shutil.ignore_patterns(rundir.LOCK, rundir.RESUME_DIR))
    for path in (partial / rundir.TRAINER_STATE, rundir.state_path(partial, state.update)):
        if path.is_file():
            record = json.loads(path.read_text())
            record.pop("stopped", None)
            atomic_write_json(path, record)
    os.replace(partial, out)
    return out


def train_check_run(cfg: PipelineConfig, name: str, *, progress: bool = True) -> Path:
    """`search PIPELINE --check-run NAME`: train pruned trial NAME's copy on to the full budget, with no pruner."""
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import train_run

    search = the_search(cfg)
    run = next((t for t in search.trials if t.name == name), None)
    if run is None:
        raise UserError(f"--check-run {name!r}: search {search.name} has no such trial")
    tcfg = trials_pipeline(cfg)
    corpus = ensure_data(tcfg, build=False)
    out = _check_copy(cfg, name)
    caches = _train_dev_caches(run, cache_jobs(tcfg, corpus, [name]), tcfg)
    with _trial_log(out / rundir.TRAIN_LOG):
        return train_run(resolve_run(tcfg, run), corpus, caches, out, resume=True, progress=progress,
                         runtime=resolve_runtime(cfg.device, cfg.precision))


def check_pruned(cfg: PipelineConfig, table: dict, count: int, *, jobs: int, wait: bool) -> bool:
    """--check-pruned COUNT: train the COUNT pruned trials with the best dev loss at the last rung they reached on to
    the full budget, each from a copy of its run directory, to see whether the pruner stopped a setting better than
    the winner. False while SLURM tasks run on (--no-wait)."""
    chosen = [r["run"] for r in pruned_to_check(table, count)]
    if not chosen:
        say(f"search: {table['search']} pruned no trial: nothing to check")
        return True
    say(f"search: training {', '.join(chosen)} on to {amount(table['full_budget'], table['unit'])} from where they were "
        f"pruned, to check the pruner -> {search_dir(cfg) / CHECK}")
    for name in chosen:  # in the driver, before any child starts
        _check_copy(cfg, name)
    # A copy trained to the full budget by an earlier call is not launched again (a --no-wait rerun goes on).
    chosen = [name for name in chosen if not check_progress(cfg, name)[1]]
    if not chosen:
        return True
    on_cluster = cfg.launcher.kind != "local"
    if len(chosen) == 1 and not on_cluster:
        train_check_run(cfg, chosen[0])
        return True
    argv = ("search", os.path.abspath(cfg.path), "--device", cfg.device, "--precision", cfg.precision, "--launcher",
            "local", "--check-run")
    tasks = [Task(f"check-{name}", (*argv, name), search_dir(cfg) / CHECK / f"{name}.log", check_dir(cfg, name))
             for name in chosen]
    launch(tasks, cfg.launcher, workdir=cfg.workdir, parallel=min(jobs, len(tasks)), wait=wait, label="check",
           what="checks of pruned trials")
    return wait


# ---------------------------------------------------------------------------- the driver


def _clear_failures(cfg: PipelineConfig) -> None:
    """A new call retries the trials whose training failed before."""
    for path in (search_dir(cfg) / LEASES).glob("*.json"):
        lease = read_lease(path)
        if lease is not None and lease.get("failed"):
            path.unlink(missing_ok=True)


def _open_work(cfg: PipelineConfig, study) -> tuple[int, list[str]]:
    """(trials a worker started now could take, names of trials running under a live worker elsewhere)."""
    from optuna.trial import TrialState

    me = worker_identity()
    takeable, elsewhere = 0, []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            takeable += 1
        elif t.state == TrialState.RUNNING:
            state = lease_state(lease_path(cfg, t.user_attrs["run"]), me)
            if state in ("free", "mine"):
                takeable += 1
            elif state == "held":
                elsewhere.append(t.user_attrs["run"])
    return takeable, elsewhere


def worker_task(cfg: PipelineConfig, index: int) -> Task:
    directory = search_dir(cfg)
    argv = ("search", os.path.abspath(cfg.path), "--worker", "--device", cfg.device, "--precision", cfg.precision,
            "--launcher", "local")
    return Task(f"worker-{index}", argv, directory / f"worker-{index}.log")


def run_search(cfg: PipelineConfig, *, jobs: int | None = None, wait: bool = True, confirm: bool = False,
               score: bool = True, check: int = 0) -> dict | None:
    """`prlmfuse search`: the grid's trials (resumed where they stopped), then the table; with `check`, that many
    pruned trials trained on to the full budget; with `confirm`, the winner and its baselines on test. Returns the
    table (None while SLURM tasks run on, --no-wait)."""
    from prlmfuse.distributed import rank_world
    from prlmfuse.precision import resolve_runtime

    search = the_search(cfg)
    import_optuna()
    on_cluster = cfg.launcher.kind != "local"
    if on_cluster:
        require("submitit", "--launcher slurm")
    if rank_world()[1] > 1:
        raise UserError("prlmfuse search trains one trial per process; run it without torchrun (--jobs N: N at once)")
    jobs = jobs or search.jobs
    if not on_cluster:
        resolve_runtime(cfg.device, cfg.precision)  # a device this machine lacks fails before any work
    tcfg = trials_pipeline(cfg)
    ensure_workdir(tcfg)
    corpus = ensure_data(tcfg)
    # The trials' train and dev caches only: the search never reads test.
    build_caches(tcfg, corpus, [t.name for t in search.trials], splits=TRAIN_SPLITS)
    for warning in search.warnings():
        logger.warning("search: %s: %s", search.name, warning)
    study = open_study(cfg, create=True)
    _clear_failures(cfg)
    takeable, elsewhere = _open_work(cfg, study)
    say(f"search: {search.name}: {len(search.settings)} settings, {takeable} to train or resume"
        + (f", {len(elsewhere)} running elsewhere ({', '.join(elsewhere)})" if elsewhere else "")
        + f"; journal {search_dir(cfg) / JOURNAL}")
    if takeable:
        workers = min(jobs, takeable)
        if not on_cluster and workers == 1:
            work(cfg)
        else:
            tasks = [worker_task(cfg, k + 1) for k in range(workers)]
            launch(tasks, cfg.launcher, workdir=cfg.workdir, parallel=workers, wait=wait, label="search",
                   what="search workers")
            if not wait:
                return None
    table = write_table(cfg, study)
    failed = [r for r in table["trials"] if r["status"].startswith("failed")]
    if failed:
        raise UserError(f"{len(failed)} of {len(table['trials'])} trials failed: "
                        + "; ".join(f"{r['run']} ({r['status']}; log {r['log']})" for r in failed)
                        + f"; the table so far is {search_dir(cfg) / TABLE_MD}; rerun the same command to retry them")
    if check or confirm:
        open_trials = [r["run"] for r in table["trials"]
                       if r["status"] != "finished" and not r["status"].startswith("pruned")]
        if open_trials:
            option = "--check-pruned" if check else "--confirm"
            raise UserError(f"{option} waits for every trial to end; still open: {', '.join(open_trials)}")
    if check:
        if not check_pruned(cfg, table, check, jobs=jobs, wait=wait):
            return None
        table = write_table(cfg, study)
    if confirm:
        table["confirm"] = confirm_search(cfg, table, parallel=jobs, wait=wait, score=score)
    return table

