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
preempted goes on where it stopped when the same command runs again.

The end: a table of every trial (workdir/search/NAME/trials.md and trials.json): its settings, trainable
parameters, updates trained, dev loss at each rung and at the full budget, pruned or finished; the best
setting; the updates spent as a share of training every setting to the full budget. `--confirm` then
trains the winner, the plain baseline and the baseline matched to the winner's parameters to the full
budget as plain runs (NAME-best, NAME-baseline, NAME-baseline-matched) and evaluates them on test once,
compared by the paired bootstrap (workdir/search/NAME/confirm/). The search itself never reads test: it
builds no test cache and evaluates on dev only.
"""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prlmfuse import signals
from prlmfuse.config import PipelineConfig
from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, atomic_write_text
from prlmfuse.launch import Task, launch, require, say
from prlmfuse.pipeline import (SPLITS, build_caches, caches_for_run, cache_jobs, ensure_data, ensure_workdir,
                               evaluate_pipeline, planned_parameters, resolve_run, run_path, train_runs)
from prlmfuse.search_space import SearchConfig
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig

logger = logging.getLogger(__name__)

JOURNAL = "journal.log"
CLAIMS = "claims"  # the lock beside the journal under which a worker claims a trial (claims.lock)
LEASES = "leases"
TABLE_MD = "trials.md"
TABLE_JSON = "trials.json"
CONFIRM = "confirm"
# A worker renews its lease this often; a lease not renewed for LEASE_STALE_S is a gone worker's.
LEASE_BEAT_S = 30.0
LEASE_STALE_S = 600.0
# The splits a search reads: never test.
TRAIN_SPLITS = ("train", "dev")


def _optuna():
    optuna = require("optuna", "prlmfuse search")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def the_search(cfg: PipelineConfig) -> SearchConfig:
    if cfg.search is None:
        raise UserError(f"{cfg.path} has no search section; add one (search: {{base: RUN, space: "
                        "{layer: [-2, concat]}, max_updates: N, min_updates: M}, docs/configuration.md)")
    return cfg.search


def search_dir(cfg: PipelineConfig) -> Path:
    return cfg.workdir / "search" / the_search(cfg).name


def with_runs(cfg: PipelineConfig, runs: list[RunConfig]) -> PipelineConfig:
    """The pipeline with `runs` in place of train.runs: what `train_runs` and `evaluate_pipeline` then train and
    evaluate (a search's trials, or the runs --confirm trains)."""
    train = dataclasses.replace(cfg.train, runs=list(runs), written_as={r.name: r.name for r in runs})
    return dataclasses.replace(cfg, train=train)


def trials_pipeline(cfg: PipelineConfig) -> PipelineConfig:
    return with_runs(cfg, the_search(cfg).trials)


# ---------------------------------------------------------------------------- the study


def _definition(search: SearchConfig) -> dict:
    """What defines the study: a rerun with another space, budget, pruner or trial recipe is refused."""
    resumable = rundir.RESUMABLE_FIELDS - {"max_updates", "max_epochs"}
    return json.loads(json.dumps({
        "space": search.space, "unit": search.unit, "full": search.full, "least": search.least,
        "pruner": search.pruner, "reduction_factor": search.reduction_factor,
        "trials": [{k: v for k, v in t.to_dict().items() if k not in resumable} for t in search.trials],
    }))


def _pruner(search: SearchConfig):
    optuna = _optuna()
    if search.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=search.least, max_resource=search.full,
                                              reduction_factor=search.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=search.least, reduction_factor=search.reduction_factor,
                                                  min_early_stopping_rate=0)


@contextlib.contextmanager
def _claims_lock(directory: Path):
    """The lock workers take to enqueue and claim trials (optuna's own lock kind, as the journal's)."""
    from optuna.storages.journal import JournalFileOpenLock

    lock = JournalFileOpenLock(str(directory / CLAIMS))
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def open_study(cfg: PipelineConfig, *, create: bool = False):
    """The search's study in its journal file; `create`: made (its settings enqueued) where it is not yet."""
    optuna = _optuna()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    search = the_search(cfg)
    directory = search_dir(cfg)
    journal = directory / JOURNAL
    if not create and not journal.is_file():
        raise UserError(f"search {search.name} has not started: no {journal}; run `prlmfuse search {cfg.path}`")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LEASES).mkdir(exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    sampler = optuna.samplers.RandomSampler(seed=0)  # never asked: every trial's settings are enqueued
    with signals.deferred(), _claims_lock(directory):
        study = optuna.create_study(study_name=search.name, storage=storage, direction="minimize", sampler=sampler,
                                    pruner=_pruner(search), load_if_exists=True)
        wanted = _definition(search)
        recorded = study.user_attrs.get("definition")
        if recorded is None:
            study.set_user_attr("definition", wanted)
        elif recorded != wanted:
            difference = _first_difference(recorded, wanted)
            raise UserError(f"search {search.name} was started with other settings ({difference}); give the search a "
                            f"new name (search.name), or delete {directory} and its runs to start over")
        if create:
            have = {t.user_attrs.get("setting") for t in study.get_trials(deepcopy=False)}
            for i, setting in enumerate(search.settings):
                if i not in have:
                    study.enqueue_trial(setting, user_attrs={"setting": i, "run": search.trial_name(i)})
    return study


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{prefix}{i}.")
    return f"{prefix.rstrip('.')}: {a!r} then, {b!r} now"


# ---------------------------------------------------------------------------- leases


def _process_start(pid: int) -> str | None:
    """A process's start time (/proc/PID/stat), None where it is gone, a zombie, or /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _process_start(pid)
    if Path("/proc/self/stat").exists():
        return now is not None and (start is None or now == start)
    return True


def worker_identity() -> dict:
    """Who holds a lease: an array task keeps its identity when SLURM requeues it; a local process is its pid."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    host, pid = socket.gethostname(), os.getpid()
    owner = f"slurm:{array}_{index}" if array and index else f"{host}:{pid}:{_process_start(pid)}"
    return {"owner": owner, "host": host, "pid": pid, "start": _process_start(pid)}


def _lease_path(cfg: PipelineConfig, run: str) -> Path:
    return search_dir(cfg) / LEASES / f"{run}.json"


def _read_lease(path: Path) -> dict | None:
    try:
        lease = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) else None


def _lease_state(path: Path, me: dict) -> str:
    """free (no lease, or its worker is gone), mine (this worker's, or this array task's before a requeue),
    failed (its training failed in this search's current call), held (a live worker's)."""
    lease = _read_lease(path)
    if lease is None:
        return "free"
    if lease.get("failed"):
        return "failed"
    if lease.get("owner") == me["owner"]:
        return "mine"
    if lease.get("host") == me["host"] and not _alive(int(lease.get("pid", -1)), lease.get("start")):
        return "free"
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return "free"
    return "free" if age > LEASE_STALE_S else "held"


class _Heartbeat:
    """Renews a lease's mtime while a trial trains."""

    def __init__(self, path: Path):
        self.path = path
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.done.wait(LEASE_BEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


# ---------------------------------------------------------------------------- a worker


@dataclass
class Claim:
    trial: Any  # optuna.Trial
    index: int  # the setting's index in the grid
    resumed: bool  # a running trial whose worker was gone


def claim_next(cfg: PipelineConfig, study, me: dict) -> Claim | None:
    """The next trial for this worker, under the claims lock: a running trial whose worker is gone (resumed from
    its checkpoint) first, else the next setting still waiting; None when neither is left."""
    optuna = _optuna()
    from optuna.trial import TrialState

    search = the_search(cfg)
    with _claims_lock(search_dir(cfg)):
        trials = study.get_trials(deepcopy=False)
        for t in trials:
            if t.state != TrialState.RUNNING:
                continue
            path = _lease_path(cfg, t.user_attrs["run"])
            if _lease_state(path, me) in ("free", "mine"):
                atomic_write_json(path, {**me, "trial": t.number})
                return Claim(optuna.Trial(study, t._trial_id), t.user_attrs["setting"], True)
        if not any(t.state == TrialState.WAITING for t in trials):
            return None
        trial = study.ask()
        index = trial.user_attrs.get("setting")
        if index is None:  # not one of ours (the queue was emptied by another process): give it back
            study.tell(trial, state=TrialState.FAIL)
            return None
        for key, values in search.space.items():
            trial.suggest_categorical(key, values)
        atomic_write_json(_lease_path(cfg, search.trial_name(index)), {**me, "trial": trial.number})
        return Claim(trial, index, False)


def _rung_reporter(search: SearchConfig, trial):
    """The trainer's dev hook for one trial: at each rung, report the dev loss and ask the pruner."""
    rungs = set(search.rungs)
    eta = search.reduction_factor

    def after(evaluation) -> str | None:
        if search.unit == "updates":
            step = evaluation.update
        elif evaluation.epoch_end:
            step = evaluation.epoch
        else:
            return None
        if step not in rungs:
            return None
        with warnings.catch_warnings():  # a resumed trial reports a rung again: optuna keeps the first value
            warnings.simplefilter("ignore")
            trial.report(evaluation.dev_loss, step)
        if trial.should_prune():
            return (f"pruned: dev loss {evaluation.dev_loss:.4f} at {amount(step, search.unit)} is not among the best "
                    f"1/{eta} of the trials that reached it")
        return None

    from prlmfuse.train_fused.trainer import DevHook

    at = frozenset(rungs) if search.unit == "updates" else frozenset()
    return DevHook(at_updates=at, after=after)


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
            lease = _lease_path(cfg, run.name)
            say(f"search: {run.name} ({search.describe(search.settings[claim.index])})"
                f"{' resumed' if claim.resumed else ''} -> {out}")
            try:
                with _trial_log(out / rundir.TRAIN_LOG), _Heartbeat(lease):
                    # Its train and dev caches only: a trial's run.json names no test cache, and nothing opens one.
                    caches = [{split: c[split] for split in TRAIN_SPLITS} for c in caches_for_run(run, jobs, tcfg)]
                    train_run(resolve_run(tcfg, run), corpus, caches, out, resume=True, progress=progress,
                              runtime=runtime, dev_hook=_rung_reporter(search, claim.trial))
            except signals.Stopped:
                lease.unlink(missing_ok=True)  # the trial stays running; the next worker resumes it at once
                raise
            except Exception as e:  # one trial's failure (its cache, its settings): in the table, retried by a rerun
                message = " ".join(str(e).split()) or type(e).__name__
                logger.warning("search: %s failed: %s", run.name, message)
                atomic_write_json(lease, {**me, "failed": message})
                continue
            state = rundir.state_to_resume(out)
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


# ---------------------------------------------------------------------------- the driver


def _clear_failures(cfg: PipelineConfig) -> None:
    """A new call retries the trials whose training failed before."""
    for path in (search_dir(cfg) / LEASES).glob("*.json"):
        lease = _read_lease(path)
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
            state = _lease_state(_lease_path(cfg, t.user_attrs["run"]), me)
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
               score: bool = True) -> dict | None:
    """`prlmfuse search`: the grid's trials (resumed where they stopped), then the table; with `confirm`, the
    winner and its baselines on test. Returns the table (None while SLURM workers run on, --no-wait)."""
    from prlmfuse.distributed import rank_world
    from prlmfuse.precision import resolve_runtime

    search = the_search(cfg)
    _optuna()
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
    if confirm:
        open_trials = [r["run"] for r in table["trials"]
                       if r["status"] != "finished" and not r["status"].startswith("pruned")]
        if open_trials:
            raise UserError(f"--confirm waits for every trial to end; still open: {', '.join(open_trials)}")
        table["confirm"] = confirm_search(cfg, table, parallel=jobs, wait=wait, score=score)
    return table


# ---------------------------------------------------------------------------- the table


def _trial_rows(cfg: PipelineConfig, study) -> list[dict]:
    from optuna.trial import TrialState

    search = the_search(cfg)
    tcfg = trials_pipeline(cfg)
    by_setting = {t.user_attrs.get("setting"): t for t in study.get_trials(deepcopy=False)}
    rows = []
    me = worker_identity()
    for i, setting in enumerate(search.settings):
        run = search.trials[i]
        out = run_path(tcfg, run.name)
        trial = by_setting.get(i)
        try:
            state = rundir.state_to_resume(out)
        except UserError:
            state = None
        try:
            params = int(rundir.read_run_info(out)["trainable_parameters"])
        except (UserError, KeyError, TypeError, ValueError):
            params = planned_parameters(tcfg, run)
        updates = state.update if state is not None else 0
        rungs = {}
        if trial is not None:
            values = trial.intermediate_values
            rungs = {str(step): values[step] for step in search.rungs if step in values}
        status, dev_loss = "waiting", None
        if trial is not None and trial.state == TrialState.COMPLETE:
            status, dev_loss = "finished", trial.value
        elif trial is not None and trial.state == TrialState.PRUNED:
            status = f"pruned at {amount(max(int(s) for s in rungs) if rungs else updates, search.unit)}"
        elif trial is not None and trial.state == TrialState.RUNNING:
            lease = _read_lease(_lease_path(cfg, run.name))
            if lease is not None and lease.get("failed"):
                status = f"failed: {lease['failed']}"
            else:
                held = _lease_state(_lease_path(cfg, run.name), me) == "held"
                status = "running" if held else f"stopped at update {updates}, resumes"
        elif trial is not None and trial.state == TrialState.FAIL:
            status = "failed"
        rows.append({"run": run.name, "setting": setting, "trainable_parameters": params, "updates": updates,
                     "epochs": state.epoch if state is not None else 0, "dev_loss_at_rungs": rungs,
                     "dev_loss": dev_loss, "status": status, "log": str(out / rundir.TRAIN_LOG),
                     "updates_per_epoch": _updates_per_epoch(state, run)})
    return rows


def _updates_per_epoch(state, run: RunConfig) -> int | None:
    if state is None or not state.batches_per_epoch:
        return None
    return -(-state.batches_per_epoch // run.update_freq)


def write_table(cfg: PipelineConfig, study) -> dict:
    """trials.json and trials.md in the search's folder: every trial, the best setting, the updates spent."""
    search = the_search(cfg)
    rows = _trial_rows(cfg, study)
    finished = [r for r in rows if r["status"] == "finished"]
    best = min(finished, key=lambda r: r["dev_loss"]) if finished else None
    spent = sum(r["updates"] for r in rows)
    if search.unit == "updates":
        full_grid = len(rows) * search.full
    else:
        per_epoch = next((r["updates_per_epoch"] for r in rows if r["updates_per_epoch"]), None)
        full_grid = len(rows) * search.full * per_epoch if per_epoch else None
    table = {
        "search": search.name, "pipeline": str(cfg.path), "base": search.base or "train.defaults",
        "space": search.space, "unit": search.unit, "full_budget": search.full, "least_budget": search.least,
        "pruner": search.pruner, "reduction_factor": search.reduction_factor, "rungs": search.rungs,
        "trials": rows, "best": best, "updates_spent": spent, "full_grid_updates": full_grid,
        "share_of_full_grid": (spent / full_grid) if full_grid else None,
        "counts": {s: sum(r["status"].startswith(s) for r in rows)
                   for s in ("finished", "pruned", "running", "stopped", "waiting", "failed")},
        "test_read": False,
    }
    directory = search_dir(cfg)
    atomic_write_json(directory / TABLE_JSON, table)
    atomic_write_text(directory / TABLE_MD, table_markdown(table))
    return table


def amount(n: int, unit: str) -> str:
    """4 updates, 1 epoch."""
    return f"{n} {unit[:-1] if n == 1 else unit}"


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def table_markdown(table: dict) -> str:
    keys = list(table["space"])
    rungs = table["rungs"]
    unit = table["unit"]
    lines = [f"# Search {table['search']}", "",
             f"Base run `{table['base']}`, {len(table['trials'])} settings over {', '.join(keys)}; full budget "
             f"{table['full_budget']} {unit}, least {table['least_budget']}; {table['pruner'].replace('_', ' ')} "
             f"(reduction factor {table['reduction_factor']}), rungs at {', '.join(map(str, rungs)) or 'none'} {unit}. "
             "Dev loss: label-smoothed cross entropy per target token, lower is better. Test was not read.", "",
             "| trial | " + " | ".join(keys) + f" | trainable params | updates | "
             + " | ".join(f"dev loss @{r}" for r in rungs) + f" | dev loss @{table['full_budget']} | status |",
             "|" + "---|" * (len(keys) + len(rungs) + 5)]
    for r in table["trials"]:
        cells = [r["run"], *(str(r["setting"][k]) for k in keys), f"{r['trainable_parameters']:,}", str(r["updates"]),
                 *(_fmt(r["dev_loss_at_rungs"].get(str(s))) for s in rungs), _fmt(r["dev_loss"]), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += summary_lines(table)
    return "\n".join(lines) + "\n"


def summary_lines(table: dict) -> list[str]:
    counts = table["counts"]
    parts = [f"{counts[k]} {k}" for k in ("finished", "pruned", "running", "stopped", "waiting", "failed") if counts[k]]
    lines = [f"search {table['search']}: {len(table['trials'])} settings, {', '.join(parts)}"]
    best = table["best"]
    if best is not None:
        setting = ", ".join(f"{k} {v}" for k, v in best["setting"].items())
        lines.append(f"best: {best['run']} ({setting}): dev loss {best['dev_loss']:.4f} at "
                     f"{amount(table['full_budget'], table['unit'])}")
    if table["full_grid_updates"]:
        full = amount(table["full_budget"], table["unit"])
        lines.append(f"spent: {table['updates_spent']:,} of the {table['full_grid_updates']:,} updates that train "
                     f"every setting to {full} ({100 * table['share_of_full_grid']:.0f}%)")
    return lines


# ---------------------------------------------------------------------------- --dry-run


def _bracket_counts(search: SearchConfig, numbers: list[int]) -> dict[int, int]:
    """Trials per hyperband bracket, as optuna's HyperbandPruner assigns them (crc32 of study name and trial
    number); successive halving has one bracket, 0."""
    if search.pruner != "hyperband":
        return {0: len(numbers)}
    eta = search.reduction_factor
    n = math.floor(math.log(search.full / search.least, eta)) + 1
    budgets = [math.ceil(n * eta ** (n - 1 - s) / (n - s)) for s in range(n)]
    counts: dict[int, int] = {}
    for number in numbers:
        left = binascii.crc32(f"{search.name}_{number}".encode()) % sum(budgets)
        for s, b in enumerate(budgets):
            left -= b
            if left < 0:
                counts[s] = counts.get(s, 0) + 1
                break
    return counts


def planned_updates(search: SearchConfig) -> tuple[int, int]:
    """(updates if each rung keeps 1/reduction_factor of the trials that reach it, as synchronous successive
    halving would; the full grid's). In epochs for an epoch budget."""
    eta = search.reduction_factor
    total = 0
    for bracket, n in _bracket_counts(search, list(range(len(search.settings)))).items():
        rungs = [r for r in search.rungs if r >= search.least * eta ** bracket]
        reached, spent_to = n, 0
        for r in rungs:
            total += reached * (r - spent_to)
            spent_to = r
            reached = max(1, reached // eta)
        total += reached * (search.full - spent_to)
    return total, len(search.settings) * search.full


def dry_run_lines(cfg: PipelineConfig) -> list[str]:
    """What `search --dry-run` prints: the space, its size, each trial's state and parameters, the budget."""
    search = the_search(cfg)
    tcfg = trials_pipeline(cfg)
    unit = search.unit
    lines = [f"search {search.name} (pipeline {cfg.path}, workdir {cfg.workdir}): base run "
             f"{search.base or 'train.defaults'}, {search.pruner.replace('_', ' ')} (reduction factor "
             f"{search.reduction_factor}), {cfg.launcher.kind} launcher",
             "space: " + "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in search.space.items())
             + f" -> {len(search.settings)} settings",
             f"budget: {search.full} {unit} each; rungs at {', '.join(map(str, search.rungs))} {unit} (a dev evaluation "
             "at each; the pruner stops a trial there that is not among the best 1/"
             f"{search.reduction_factor} of those that reached it)"]
    for i, setting in enumerate(search.settings):
        run = search.trials[i]
        try:
            state, _ = rundir.training_progress(run, rundir.state_to_resume(run_path(tcfg, run.name)))
        except UserError as e:
            state = f"unreadable: {e}"
        lines.append(f"  {run.name}  {search.describe(setting):<40} {planned_parameters(tcfg, run):>12,} trainable "
                     f"parameters  [{state}]")
    pruned, full = planned_updates(search)
    lines.append(f"budget: at most {full:,} {unit} if no trial is pruned (the full grid: {len(search.settings)} × "
                 f"{search.full}); {pruned:,} ({100 * pruned / full:.0f}%) if each rung keeps 1/{search.reduction_factor}"
                 " of the trials that reach it")
    return lines


# ---------------------------------------------------------------------------- --confirm


def confirm_pipeline(cfg: PipelineConfig, table: dict | None = None) -> PipelineConfig:
    """The pipeline whose runs are the winner, the plain baseline and the matched baseline (--confirm's), its
    evaluation compared with the plain baseline and written to the search's confirm/ folder."""
    search = the_search(cfg)
    if table is None:
        try:
            table = json.loads((search_dir(cfg) / TABLE_JSON).read_text())
        except (OSError, ValueError):
            raise UserError(f"search {search.name} has no table yet; run `prlmfuse search {cfg.path}` first") from None
    if not table.get("best"):
        raise UserError(f"search {search.name} has no finished trial to confirm")
    runs = search.confirm_runs(table["best"]["setting"])
    confirmed = with_runs(cfg, runs)
    out = str(Path("search") / search.name / CONFIRM)
    return dataclasses.replace(confirmed, evaluate=dataclasses.replace(cfg.evaluate, baseline=runs[1].name, out=out))


def confirm_search(cfg: PipelineConfig, table: dict, *, parallel: int, wait: bool, score: bool):
    """Train the winner and its two baselines to the full budget as plain runs, then evaluate them on test once."""
    ccfg = confirm_pipeline(cfg, table)
    names = [r.name for r in ccfg.train.runs]
    best = table["best"]
    say(f"search: confirming {best['run']}'s setting as {names[0]}, beside {names[1]} and {names[2]} "
        f"({table['full_budget']} {table['unit']} each), on test")
    corpus = ensure_data(ccfg, build=False)
    build_caches(ccfg, corpus, names, splits=SPLITS)  # the test cache, first needed now
    abspath = os.path.abspath(cfg.path)
    train_runs(ccfg, names, parallel=parallel, wait=wait,
               task_argv=lambda run: ["search", abspath, "--train-run", run.name])
    if not wait:
        return None
    return evaluate_pipeline(ccfg, names, score=score)


def train_confirm_run(cfg: PipelineConfig, name: str) -> None:
    """`search PIPELINE --train-run NAME`: a child of --confirm trains one of its runs here."""
    ccfg = confirm_pipeline(cfg)
    if name not in [r.name for r in ccfg.train.runs]:
        raise UserError(f"--train-run {name!r}: --confirm trains {', '.join(r.name for r in ccfg.train.runs)}")
    ccfg.launcher.kind = "local"
    train_runs(ccfg, [name])
