"""The run directory: the one place that knows its file names, run.json's schema and how to read it.

    run.json                                  what the run is (model, recipe, corpus, PrLM branches)
    bpe.json                                  the run's joint BPE
    metrics.jsonl                             one JSON record per log line (train) or evaluation (dev)
    checkpoints/update-00000500.safetensors   model weights
    checkpoints/optimizer-00000500.safetensors   Adam state, one tensor per (parameter, state key)
    checkpoints/update-00000500.json          trainer state of that checkpoint (written last of the three)
    trainer_state.json                        names the newest complete checkpoint; written after it
    best.safetensors                          weights with the lowest dev loss so far
    average-last{K}.safetensors               average of the newest K checkpoints (evaluation), naming
                                              the sha256 of each file it averaged
    average-epochs{K}.safetensors             the same over the newest K epoch-end checkpoints
    average-last{K}-at{U}.safetensors         the same over the run as it was at update U (evaluate --at-update)
    budgets/update-00000500/                  the saves (weights, state) up to a budget end it trained on past
    .previous-run/                            the run `train --fresh` replaces, until the new one saves

The trainer writes these (train_fused.checkpointing for the checkpoint files); the evaluator and
the pipeline only read them, through the functions here and train_fused.weights (loading, averaging).
Its lock, a `--fresh` start's set-aside run and a killed save's temp files are train_fused.run_dir_upkeep's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path


import prlmfuse
from prlmfuse.errors import UserError
from prlmfuse.evaluate.settings import AVERAGE_CHOICES
from prlmfuse.fileio import atomic_write_json, atomic_write_text, read_json
from prlmfuse.train_fused.config import FEEDING_FIELDS, defining_settings

RUN_JSON = "run.json"
BPE_JSON = "bpe.json"
METRICS = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE = "trainer_state.json"
BEST = "best.safetensors"
LOCK = ".lock"
TRAIN_LOG = "train.log"  # a training child's output under `prlmfuse train --jobs N`
TENSORBOARD_DIR = "tensorboard"
# A stop signal's resume point: weights, optimizer state and trainer state after the last finished update,
# apart from the scheduled checkpoints (no dev pass; never counted by keep_last or an average).
RESUME_DIR = "resume"
RESUME_STATE = "state.json"
BUDGETS_DIR = "budgets"  # budgets/update-N/: saves kept from a budget end the run trained on past
# `train --fresh` moves the run it replaces here; deleted once the new run has saved its first checkpoint.
PREVIOUS_RUN = ".previous-run"

_WEIGHTS_RE = re.compile(r"^update-(\d{8})\.safetensors$")
_CHECKPOINT_FILE_RE = re.compile(r"^(?:update|optimizer)-(\d{8})\.(?:safetensors|json)$")
# What a trainer state may name: files of this run's checkpoints/ folder, nothing else.
_NAMED_FILE_RE = {
    "checkpoint": re.compile(rf"^{CHECKPOINT_DIR}/update-\d{{8}}\.safetensors$"),
    "optimizer": re.compile(rf"^{CHECKPOINT_DIR}/optimizer-\d{{8}}\.safetensors$"),
}
# ...and what a resume point's state may name: files of its own folder.
_RESUME_FILE_RE = {
    "checkpoint": re.compile(rf"^{RESUME_DIR}/update-\d{{8}}\.safetensors$"),
    "optimizer": re.compile(rf"^{RESUME_DIR}/optimizer-\d{{8}}\.safetensors$"),
}
# RunConfig fields that only steer when to stop, how often to log, or how to feed data: a resumed
# run may change them. Every other field defines the run and must match the run directory.
RESUMABLE_FIELDS = FEEDING_FIELDS | {
    "max_updates", "max_epochs", "patience", "min_epochs", "save_every", "keep_last", "keep_last_epochs",
}


# ------------------------------------------------------------------------------------ file names


def weights_path(run_dir: str | os.PathLike, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"update-{update:08d}.safetensors"


def optimizer_path(run_dir: str | os.PathLike, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"optimizer-{update:08d}.safetensors"


def state_path(run_dir: str | os.PathLike, update: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"update-{update:08d}.json"


def relative_name(path: Path) -> str:
    """How a trainer state names a checkpoint or resume point file: relative to the run directory."""
    return f"{path.parent.name}/{path.name}"


def resume_paths(run_dir: str | os.PathLike, update: int) -> tuple[Path, Path, Path]:
    """The weights, optimizer state and trainer state of a resume point at `update`."""
    folder = Path(run_dir) / RESUME_DIR
    return folder / f"update-{update:08d}.safetensors", folder / f"optimizer-{update:08d}.safetensors", folder / RESUME_STATE


def checkpoint_file_update(name: str) -> int | None:
    """The update count in the name of a checkpoints/ file (weights, optimizer or state), else None."""
    m = _CHECKPOINT_FILE_RE.match(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------ run.json


def run_info(run, corpus, model_config: dict, prlms: list[dict], extra: dict) -> dict:
    """run.json's content. `prlms`: one record per branch (train_fused.branches.PrLMBranch.record
    plus its "caches": {split: {"path", "key"}})."""
    return {
        "name": run.name,
        "prlmfuse_version": prlmfuse.__version__,
        "model": model_config,
        "train": run.to_dict(),
        "corpus": {
            "root": str(Path(corpus.root).resolve()),
            "name": corpus.name,
            "task": corpus.task,
            "src_lang": corpus.src_lang,
            "tgt_lang": corpus.tgt_lang,
            "sha256": {
                split: {"src": entry["src"]["sha256"], "tgt": entry["tgt"]["sha256"]} for split, entry in corpus.splits.items()
            },
        },
        "prlms": prlms,
        "bpe": BPE_JSON,
        **extra,
    }


def write_run_info(run_dir: str | os.PathLike, info: dict) -> None:
    atomic_write_json(Path(run_dir) / RUN_JSON, info)


def read_run_info(run_dir: str | os.PathLike) -> dict:
    """run.json, checked to have the sections every reader uses (model, train, corpus with its root, prlms)."""
    path = Path(run_dir) / RUN_JSON
    info = read_json(path, what="run description")
    if not isinstance(info.get("model"), dict) or not isinstance(info.get("corpus"), dict):
        raise UserError(f"{path} lacks its model or corpus section; it was not written by prlmfuse train")
    if not info["corpus"].get("root"):
        raise UserError(f"{path} records no corpus root; it was not written by prlmfuse train")
    return upgrade_run_info(info)


def upgrade_run_info(info: dict) -> dict:
    """run.json as the current code writes it, from a file an older prlmfuse wrote: the one place
    that knows the old formats (as fairseq's upgrade_state_dict)."""
    model, train = info["model"], info.get("train")
    if "attn_dropout" in model:  # older files name the model's attention_dropout so
        model["attention_dropout"] = model.pop("attn_dropout")
    if isinstance(train, dict) and "dropnet_p" not in train:  # older runs could not set it: the model's value
        train["dropnet_p"] = model.get("dropnet_p", 0.5)
    if isinstance(train, dict):
        train.setdefault("read_window", 0)  # older runs batched the whole split
        train.setdefault("match_params", None)  # older runs could not be matched
        train.setdefault("match_by", None)  # older matched runs widened their FFN
        train.setdefault("static_shapes", False)  # older runs padded each batch to its longest sentence
        train.setdefault("max_source_tokens", None)  # older runs read whole sources
        for use in train.get("prlms") or []:
            use.setdefault("control", None)  # older runs read each sentence's own features
    return info


def check_same_run(run_dir: Path, before: dict, now: dict) -> None:
    """Refuse to resume a run directory with a configuration that defines a different run."""
    a, b = _defining(before), _defining(now)
    if a != b:
        key, then, current = first_difference(a, b)
        difference = f"{key} ({then!r} in the run directory, {current!r} now)"
        if key.rsplit(".", 1)[-1] in ("side", "position", "layer"):
            # The fusion defaults changed; a run that relied on the earlier ones resumes once it names them.
            difference += ("; a run trained with the earlier defaults resumes once its settings name them "
                           "(side: source, position: ffn, layer: -2)")
        raise UserError(
            f"{run_dir} was trained with a different configuration ({difference}); start it over with "
            f"`prlmfuse train -p PIPELINE --fresh --runs {run_dir.name}` (the old run is kept until the new one saves a checkpoint), "
            "or give the changed run a new name"
        )


def _defining(info: dict) -> dict:
    """The parts of run.json that must not change when a run is resumed."""
    fused = bool(info["prlms"])
    train = {k: v for k, v in defining_settings(info["train"], fused).items() if k not in RESUMABLE_FIELDS}
    prlms = [{k: v for k, v in p.items() if k != "caches"}
             | {"keys": {s: c["key"] for s, c in p["caches"].items() if s != "test"}} for p in info["prlms"]]
    return {"model": defining_settings(info["model"], fused), "train": train, "corpus": info["corpus"]["sha256"],
            "prlms": prlms}


def first_difference(a, b, prefix: str = "") -> tuple[str, object, object]:
    """Where two nested dicts and lists first differ: the dotted key ("train.lr") and the two values there (a search's
    study definition is compared the same way)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{prefix}{i}.")
    return prefix.rstrip("."), a, b


# ------------------------------------------------------------------------------------ trainer state


# The TrainingState fields a save adds to restore that checkpoint; a file has no key for those left unset.
CHECKPOINT_FIELDS = ("lr", "torch_rng_state", "cuda_rng_state", "grad_scaler", "checkpoint", "optimizer")


@dataclasses.dataclass
class TrainingState:
    """How far a run has trained: the trainer's running state, saved as JSON with each checkpoint
    (checkpoints/update-N.json and trainer_state.json) together with the CHECKPOINT_FIELDS."""

    update: int = 0  # optimizer updates done
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch trained on; 0 at an epoch end
    best_dev_loss: float | None = None  # lowest dev loss of any save (best.safetensors)
    best_epoch_dev_loss: float | None = None  # lowest dev loss at an epoch end, what patience compares with
    bad_epochs: int = 0  # epoch ends since the last one that lowered best_epoch_dev_loss
    last_dev_loss: float | None = None
    tokens_seen: int = 0  # target tokens trained on, summed over ranks
    wall_time: float = 0.0  # seconds in training updates, data wait included, summed over resumes
    seed: int | None = None
    batches_per_epoch: int | None = None  # a resume refuses data that forms a different number
    world_size: int | None = None  # ranks the run was started with
    oom_retries: int = 0  # updates done again in smaller batches after running out of memory (out_of_memory.py)
    oom_in_a_row: int = 0  # of those, how many in a row up to the last update
    lr: float | None = None  # learning rate of the checkpoint's last update
    torch_rng_state: list[int] | None = None
    cuda_rng_state: list[int] | None = None  # runs on a CUDA device only
    grad_scaler: dict | None = None  # fp16 runs only
    checkpoint: str | None = None  # weights file, relative to the run directory
    optimizer: str | None = None  # optimizer state file, relative to the run directory
    # Why the trainer's dev hook stopped the run before its budget (a search's "pruned"), else None: the run
    # is over, as at a budget reached (`stop_reason`), and a rerun trains nothing more.
    stopped: str | None = None
    # The updates at which the run reached a max_updates it was trained to, ascending: before a run trains on
    # past one, the saves an average there reads are linked into budget_dir, so it can still be decoded there.
    budget_ends: list[int] | None = None

    def to_dict(self) -> dict:
        """The JSON object of a trainer state file (a run never stopped by a hook has no `stopped` key, one
        that never reached a budget no `budget_ends`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items()
                if v is not None or k not in (*CHECKPOINT_FIELDS, "stopped", "budget_ends")}

    @classmethod
    def from_dict(cls, data: dict) -> TrainingState:
        """A trainer state file's object: unknown keys are ignored, a key absent or null takes the field's default."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if data.get(f.name) is not None})


def complete_checkpoints(run_dir: str | os.PathLike) -> list[int]:
    """Update counts of checkpoints whose weights, optimizer state and JSON all exist, ascending."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    updates = []
    for entry in directory.iterdir():
        m = _WEIGHTS_RE.match(entry.name)
        if m:
            u = int(m.group(1))
            if state_path(run_dir, u).is_file() and optimizer_path(run_dir, u).is_file():
                updates.append(u)
    return sorted(updates)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Weight files of the complete checkpoints of a run, oldest first."""
    return [weights_path(run_dir, u) for u in complete_checkpoints(run_dir)]


def is_epoch_end(state: TrainingState) -> bool:
    """Whether a checkpoint's trainer state was saved at the end of an epoch (none of the next one begun)."""
    return state.epoch > 0 and state.batch_in_epoch == 0


def epoch_end_checkpoints(run_dir: str | os.PathLike) -> list[int]:
    """Update counts of the complete checkpoints saved at an epoch end, ascending."""
    updates = []
    for u in complete_checkpoints(run_dir):
        try:
            state = json.loads(state_path(run_dir, u).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # unreadable: not a checkpoint an average may trust
        if isinstance(state, dict) and is_epoch_end(TrainingState.from_dict(state)):
            updates.append(u)
    return updates


def averageable_checkpoints(run_dir: str | os.PathLike, average: str) -> list[int]:
    """Update counts an average of kind `average` picks its newest from: every complete checkpoint
    ("saves"), or those saved at an epoch end ("epochs", refused when there are none)."""
    if average not in AVERAGE_CHOICES:
        raise UserError(f"average={average!r}: choose {' or '.join(AVERAGE_CHOICES)}")
    if average == "saves":
        return complete_checkpoints(run_dir)
    updates = epoch_end_checkpoints(run_dir)
    if not updates:
        raise UserError(f"{run_dir} has no checkpoint saved at an epoch end; train at least one full epoch "
                        "or average the last saves (average: saves)")
    return updates


def budget_dir(run_dir: str | os.PathLike, update: int) -> Path:
    """Where the saves an average at budget end `update` reads are linked before the run trains on past it."""
    return Path(run_dir) / BUDGETS_DIR / f"update-{update:08d}"


def budget_saves(run_dir: str | os.PathLike, update: int, average: str) -> list[Path]:
    """Weight files, oldest first, that an average of kind `average` of the run as it was at `update` picks its
    newest from: the checkpoints at the run's last update, at an earlier budget end the saves linked into
    `budget_dir` before it trained on. Refused in one line elsewhere."""
    state = latest_trainer_state(run_dir)
    folder = budget_dir(run_dir, update)
    linked = folder.is_dir()
    if not linked and state is not None and state.update == update:
        # A save past it may be complete where trainer_state.json was not yet rewritten (a kill, a full disk).
        return [weights_path(run_dir, u) for u in averageable_checkpoints(run_dir, average) if u <= update]
    if not linked:
        ends = [u for u in (state.budget_ends if state is not None else None) or [] if budget_dir(run_dir, u).is_dir()]
        kept = f"the budget ends it trained on past: {', '.join(map(str, ends))}" if ends else "it trained on past none"
        last = f"its last update, {state.update}" if state is not None else "no update yet"
        raise UserError(f"{run_dir} keeps no saves of update {update} ({kept}; {last}); a run is decoded at an "
                        "earlier update where `train --max-updates` stopped it there before it trained on")
    saves = []
    for entry in sorted(folder.iterdir()):
        m = _WEIGHTS_RE.match(entry.name)
        if m and (folder / f"update-{m.group(1)}.json").is_file():
            saves.append(entry)
    if average == "epochs":
        saves = [w for w in saves if is_epoch_end(TrainingState.from_dict(read_json(w.with_suffix(".json"), "checkpoint state")))]
        if not saves:
            raise UserError(f"{run_dir} had no checkpoint saved at an epoch end by update {update}; "
                            "average the last saves (average: saves)")
    return saves


def budget_state(run_dir: str | os.PathLike, update: int) -> TrainingState:
    """The trainer state of the run as it was at `update`: its last one, or an earlier budget end's (`budget_saves`)."""
    state = latest_trainer_state(run_dir)
    if state is not None and state.update == update and not budget_dir(run_dir, update).is_dir():
        return state
    path = budget_saves(run_dir, update, "saves")[-1].with_suffix(".json")
    return TrainingState.from_dict(read_json(path, "checkpoint state"))


def latest_trainer_state(run_dir: str | os.PathLike) -> TrainingState | None:
    """The trainer state to resume from, or None for a fresh run.

    trainer_state.json is authoritative. If it is missing (a kill between the first checkpoint's
    files and its first write), the newest complete checkpoint's own JSON is used instead.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    path = run_dir / TRAINER_STATE
    if path.is_file():
        state = _checked_state(read_json(path, "trainer state"), path)
        if not (run_dir / state.checkpoint).is_file():
            raise UserError(
                f"{path} names {state.checkpoint!r}, which is missing; "
                "restore it or start the run afresh in a new directory"
            )
        return state
    updates = complete_checkpoints(run_dir)
    if not updates:
        return None
    newest = state_path(run_dir, updates[-1])
    return _checked_state(read_json(newest, "checkpoint state"), newest)


def state_to_resume(run_dir: str | os.PathLike) -> TrainingState | None:
    """What a rerun resumes from: the resume point a stop signal left, where it is complete and newer than
    the last scheduled checkpoint (`latest_trainer_state`), else that checkpoint."""
    scheduled = latest_trainer_state(run_dir)
    path = Path(run_dir) / RESUME_DIR / RESUME_STATE
    if not path.is_file():
        return scheduled
    point = _checked_state(read_json(path, "resume point"), path, _RESUME_FILE_RE)
    complete = all((Path(run_dir) / name).is_file() for name in (point.checkpoint, point.optimizer))
    if complete and (scheduled is None or point.update > scheduled.update):
        return point
    return scheduled


def _checked_state(state: dict, path: Path, named: dict = _NAMED_FILE_RE) -> TrainingState:
    """A trainer state file's object as a TrainingState: it has an integer update, and the files it
    names are inside the run's checkpoints/ folder (a resume point's: inside resume/)."""
    if not isinstance(state, dict) or not isinstance(state.get("update"), int):
        raise UserError(f"{path} is not a trainer state written by prlmfuse (no integer 'update'); "
                        "restore it or start the run afresh in a new directory")
    for key, pattern in named.items():
        name = state.get(key)
        if not isinstance(name, str) or not pattern.match(name):
            raise UserError(f"{path}: {key} {name!r} is not a file of this run's {CHECKPOINT_DIR}/ folder; "
                            "the trainer state is corrupt, restore it or start the run afresh in a new directory")
    return TrainingState.from_dict(state)


def stop_reason(run, state: TrainingState) -> str | None:
    """Why training `run` is over at this trainer state ("max_updates", "max_epochs", "patience", or what a dev
    hook recorded, e.g. "pruned"), or None.

    patience counts epochs: the run stops once the epoch-end dev loss has not improved on its best for
    `patience` epochs in a row, and not before `min_epochs` epochs.
    """
    if state.stopped:
        return state.stopped
    if run.max_updates is not None and state.update >= run.max_updates:
        return "max_updates"
    if run.max_epochs is not None and state.epoch >= run.max_epochs:
        return "max_epochs"
    if run.patience is not None and state.bad_epochs >= run.patience and state.epoch >= (run.min_epochs or 0):
        return "patience"
    return None


def training_progress(run, state: TrainingState | None) -> tuple[str, int]:
    """What training `run` still has to do: ("new" | "resume at update N" | "done at update N", updates done)."""
    if state is None:
        return "new", 0
    if stop_reason(run, state) is not None:
        return f"done at update {state.update}" + (f" ({state.stopped})" if state.stopped else ""), state.update
    return f"resume at update {state.update}", state.update


# ------------------------------------------------------------------------------------ metrics.jsonl


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's metrics.jsonl; a line cut short by a crash mid-write is skipped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("update"), int):
            records.append(record)
    return records


def read_dev_curve(run_dir: str | os.PathLike, key: str = "dev_loss") -> list[tuple[int, float]]:
    """(update, dev loss) of every dev evaluation in a run's metrics.jsonl: the loss training minimises
    (label-smoothed), or with key="dev_nll_loss" its NLL, which runs of different label smoothing share."""
    points = {r["update"]: float(r[key]) for r in read_metrics(run_dir) if isinstance(r.get(key), (int, float))}
    return sorted(points.items())


def truncate_metrics(run_dir: str | os.PathLike, update: int) -> None:
    """Drop metric records past the checkpoint being resumed from (and a line cut by a kill)."""
    path = Path(run_dir) / METRICS
    if path.is_file():
        kept = [r for r in read_metrics(run_dir) if r["update"] <= update]
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
