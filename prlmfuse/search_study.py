"""What a search's workers share, in its folder workdir/search/NAME/: the Optuna study in its journal file
(journal.log), the lock under which a worker claims a trial (claims.lock), and the leases on the trials being
trained (leases/RUN.json); with the search section and the pipeline views its trials and --confirm's runs train
in. prlmfuse.search's workers claim and train trials here; prlmfuse.search_report reads the same state into the
table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from prlmfuse import signals
from prlmfuse.config import PipelineConfig
from prlmfuse.errors import UserError
from prlmfuse.launch import ARRAY_TASK_ENV, require
from prlmfuse.search_space import SearchConfig
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig

JOURNAL = "journal.log"
CLAIMS = "claims"  # the lock beside the journal under which a worker claims a trial (claims.lock)
LEASES = "leases"
# A worker renews its lease this often; a lease not renewed for LEASE_STALE_S is a gone worker's.
LEASE_BEAT_S = 30.0
LEASE_STALE_S = 600.0


def import_optuna():
    """optuna (or one line naming the extra to install), its INFO line per trial silenced."""
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


def amount(n: int, unit: str) -> str:
    """4 updates, 1 epoch."""
    return f"{n} {unit[:-1] if n == 1 else unit}"


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
    optuna = import_optuna()
    if search.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=search.least, max_resource=search.full,
                                              reduction_factor=search.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=search.least, reduction_factor=search.reduction_factor,
                                                  min_early_stopping_rate=0)


@contextlib.contextmanager
def claims_lock(directory: Path):
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
    optuna = import_optuna()
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
    with signals.deferred(), claims_lock(directory):
        study = optuna.create_study(study_name=search.name, storage=storage, direction="minimize", sampler=sampler,
                                    pruner=_pruner(search), load_if_exists=True)
        wanted = _definition(search)
        recorded = study.user_attrs.get("definition")
        if recorded is None:
            study.set_user_attr("definition", wanted)
        elif recorded != wanted:
            key, then, now = rundir.first_difference(recorded, wanted)
            raise UserError(f"search {search.name} was started with other settings ({key}: {then!r} then, {now!r} "
                            f"now); give the search a new name (search.name), or delete {directory} and its runs to "
                            "start over")
        if create:
            have = {t.user_attrs.get("setting") for t in study.get_trials(deepcopy=False)}
            for i, setting in enumerate(search.settings):
                if i not in have:
                    study.enqueue_trial(setting, user_attrs={"setting": i, "run": search.trial_name(i)})
    return study


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
    """Who holds a lease: the worker an array task runs itself (ChildCommand's child, named by ARRAY_TASK_ENV) keeps
    the array task's identity when SLURM requeues it; any other process, the local workers of a `search --jobs N`
    inside one array task among them, is its host, pid and start time."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    host, pid = socket.gethostname(), os.getpid()
    own = os.environ.get(ARRAY_TASK_ENV) == str(os.getppid())
    owner = f"slurm:{array}_{index}" if array and index and own else f"{host}:{pid}:{_process_start(pid)}"
    return {"owner": owner, "host": host, "pid": pid, "start": _process_start(pid)}


def new_lease(me: dict, trial: int) -> dict:
    """A lease for one claim: the worker, the trial, and a nonce no other claim has. A worker whose claim was taken
    over (it was stalled or suspended past LEASE_STALE_S, and another worker resumed the trial) finds another
    nonce there and stops (`holds_lease`)."""
    return {**me, "trial": trial, "nonce": uuid.uuid4().hex}


def holds_lease(path: Path, nonce: str) -> bool:
    """Whether the lease at `path` is still the claim whose nonce is `nonce`."""
    lease = read_lease(path)
    return lease is not None and lease.get("nonce") == nonce and not lease.get("failed")


def lease_path(cfg: PipelineConfig, run: str) -> Path:
    return search_dir(cfg) / LEASES / f"{run}.json"


def read_lease(path: Path) -> dict | None:
    try:
        lease = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) else None


def lease_state(path: Path, me: dict) -> str:
    """free (no lease, or its worker is gone), mine (this worker's, or this array task's before a requeue),
    failed (its training failed in this search's current call), held (a live worker's)."""
    lease = read_lease(path)
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


class Heartbeat:
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
