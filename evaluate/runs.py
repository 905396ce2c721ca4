"""A trained run as evaluation sees it: run.json, its corpus, its checkpoints, its weights and its PrLM branches.

File names and run.json's schema belong to train_fused.run_dir; this module reads through it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from safetensors import safe_open

from prlmfuse.corpora import Corpus, load_corpus
from prlmfuse.errors import UserError
from prlmfuse.evaluate.settings import AVERAGE
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused import weights as weights_of_runs
from prlmfuse.train_fused.branches import PrLMBranch, open_branch
from prlmfuse.train_fused.config import RunConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunView:
    """The parts of a run directory evaluation needs: run.json, its corpus, its checkpoints."""

    run_dir: Path
    name: str
    record: dict  # run.json as the trainer wrote it
    corpus: Corpus
    checkpoints: tuple[Path, ...]  # complete checkpoints/update-*.safetensors, oldest first

    @property
    def task(self) -> str:
        return self.corpus.task

    @property
    def tgt_lang(self) -> str:
        return self.corpus.tgt_lang

    @property
    def prlms(self) -> list[dict]:
        return list(self.record.get("prlms") or [])

    @property
    def model_config(self) -> dict:
        return dict(self.record.get("model") or {})

    @property
    def max_source_tokens(self) -> int | None:
        """The run's source cap (RunConfig.max_source_tokens): decoding cuts the source as training did."""
        return (self.record.get("train") or {}).get("max_source_tokens")

    def budget(self, at_update: int | None = None) -> dict:
        """What training cost and how it ended, from the trainer state: updates, target tokens seen, wall
        seconds, `stopped_by` (max_updates, max_epochs, patience; "" while unfinished) and
        `epoch_dev_losses`, the dev loss at each epoch end, oldest first. at_update: as the run was at that
        budget end (its checkpoint's own state), though it trained on."""
        try:
            state = rundir.latest_trainer_state(self.run_dir)
        except UserError:
            state = None
        earlier = at_update is not None and (state is None or state.update != at_update)
        if earlier:
            state = rundir.budget_state(self.run_dir, at_update)
        if state is None:
            return {"updates": 0, "train_tokens": 0, "train_seconds": float("nan"), "stopped_by": "",
                    "epoch_dev_losses": []}
        spent = {"updates": state.update, "train_tokens": state.tokens_seen, "train_seconds": state.wall_time}
        if not state.batches_per_epoch:
            return {**spent, "stopped_by": "max_updates" if earlier else "", "epoch_dev_losses": []}
        run = RunConfig.from_dict(self.record.get("train") or {"name": self.name})
        # An epoch ends with an update of its own, so epoch ends fall every ceil(batches / update_freq) updates.
        per_epoch = -(-state.batches_per_epoch // run.update_freq)
        curve = [(u, loss) for u, loss in rundir.read_dev_curve(self.run_dir) if not earlier or u <= at_update]
        return {**spent, "stopped_by": "max_updates" if earlier else rundir.stop_reason(run, state) or "",
                "epoch_dev_losses": [loss for update, loss in curve if update % per_epoch == 0]}

    def corpus_digest(self) -> str:
        """One sha256 over the digests of every file of the corpus the run trained on."""
        digests = json.dumps((self.record.get("corpus") or {}).get("sha256") or {}, sort_keys=True)
        return hashlib.sha256(digests.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        """The columns of the paper's tables: PrLM, layer, merge, position, side."""
        if not self.prlms:
            return {"prlm": "-", "layer": "-", "merge": "-", "position": "-", "side": "-"}
        model = self.model_config
        # A local checkpoint directory is shown by its folder name; aliases and hub ids as written.
        names = [_short_checkpoint(str(p["checkpoint"])) for p in self.prlms]
        layers = [str(p["layer"]) for p in self.prlms]
        return {
            "prlm": " + ".join(names),
            "layer": " + ".join(layers),
            "merge": str(model.get("merge", "?")),
            "position": str(model.get("position", "?")),
            "side": str(model.get("side", "?")),
        }

    def open_branches(self, paths: Sequence[str], *, source: str, source_name: str, source_sha256: str,
                      source_lines: int, in_memory: bool = True) -> list[PrLMBranch]:
        """One PrLMBranch per PrLM of the run, over the caches at `paths` (one each, in order), each checked
        against the run's training cache and against `source`, the text it must encode."""
        run = RunConfig.from_dict(self.record.get("train") or {"name": self.name})
        uses = run.prlms
        if len(uses) != len(self.prlms) or len(paths) != len(self.prlms):
            raise UserError(f"{self.run_dir / rundir.RUN_JSON} lists {len(self.prlms)} PrLM records for "
                            f"{len(uses)} configured PrLMs; the file is inconsistent")
        # Test sets are small and read once: one bulk read per cache (in_memory) rather than a read
        # per sentence from zarr/HDF5, which would count against the fused model's sentences/s.
        return [open_branch(use, str(path), trained=record, source=source, source_name=source_name,
                            source_sha256=source_sha256, source_lines=source_lines, seed=run.seed, in_memory=in_memory)
                for use, record, path in zip(uses, self.prlms, paths)]

    def test_cache_paths(self, split: str) -> list[str]:
        """The cache of `split` that run.json records for each PrLM branch."""
        paths = []
        for prlm in self.prlms:
            entry = (prlm.get("caches") or {}).get(split) or {}
            if not entry.get("path"):
                raise UserError(
                    f"run {self.name} records no {split!r} cache for PrLM {prlm.get('checkpoint', '?')}; build it "
                    "(prlmfuse run --only cache) and retrain or pass a run whose run.json lists it"
                )
            paths.append(str(entry["path"]))
        return paths


def _short_checkpoint(name: str) -> str:
    if os.path.isabs(name) or name.startswith((".", "~")):
        return Path(name).name or name
    return name


def open_run(run_dir: str | os.PathLike) -> RunView:
    """Read run.json and the corpus it trained on; refuse a directory that has nothing to decode with."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}; pass a directory written by `prlmfuse train`")
    checkpoints = tuple(rundir.list_checkpoints(run_dir))
    if not checkpoints and not (run_dir / rundir.BEST).is_file():
        raise UserError(
            f"run directory {run_dir} has no checkpoints (no complete {rundir.CHECKPOINT_DIR}/update-*.safetensors, "
            f"no {rundir.BEST}); train it first (prlmfuse train, or prlmfuse run --only train)"
        )
    record = rundir.read_run_info(run_dir)
    corpus = load_corpus(record["corpus"]["root"])
    return RunView(run_dir, str(record.get("name") or run_dir.name), record, corpus, checkpoints)


def select_weights(run: RunView, average_last: int, average: str = AVERAGE, at_update: int | None = None) -> list[Path]:
    """The weight files a decode uses: the newest `average_last` complete checkpoints (average "saves")
    or epoch-end checkpoints (average "epochs"), fewer if fewer exist; or best.safetensors for
    average_last=0 (and, for "saves", when no checkpoint is complete). at_update: the newest of the run as it
    was at that update, its last or a budget end it trained on past (`rundir.budget_saves`)."""
    if average_last < 0:
        raise UserError(f"average_last must be >= 0 (0 = best checkpoint), got {average_last}")
    if at_update is not None:
        if average_last == 0:
            raise UserError(f"--at-update {at_update} decodes the saves up to that update; best.safetensors "
                            "(average_last 0) is the lowest dev loss of the whole run, so give average_last >= 1")
        return rundir.budget_saves(run.run_dir, at_update, average)[-average_last:]
    best = run.run_dir / rundir.BEST
    if average_last > 0 and average != "saves":
        ends = rundir.averageable_checkpoints(run.run_dir, average)
        if len(ends) < average_last:
            logger.warning("run %s keeps %d epoch-end checkpoint(s); averaging those, not %d",
                           run.name, len(ends), average_last)
        return [rundir.weights_path(run.run_dir, u) for u in ends[-average_last:]]
    if average_last == 0 or not run.checkpoints:
        if not best.is_file():
            raise UserError(f"{best} not found; train the run first or choose average_last >= 1")
        return [best]
    return list(run.checkpoints[-average_last:])


def load_model(run: RunView, weights: Sequence[Path], average: str = AVERAGE, at_update: int | None = None):
    """(model in eval mode, BPE) with exactly the weights `select_weights(run, K, average, at_update)` chose.

    Several checkpoints go through the run's average (kept as run_dir/average-last{K}.safetensors,
    or average-epochs{K}.safetensors, and rewritten only when the set changes).
    """
    if len(weights) == 1 and Path(weights[0]).name == rundir.BEST:
        model, bpe, _ = weights_of_runs.load_run(run.run_dir, "best")
    elif len(weights) == 1:
        model, bpe, info = weights_of_runs.load_run(run.run_dir, "last")
        if Path(info["weights"]).resolve() != Path(weights[0]).resolve():
            weights_of_runs.load_weights(model, weights[0])
    else:
        model, bpe, info = weights_of_runs.load_run(run.run_dir, "average", last=len(weights), average=average,
                                                    at_update=at_update)
        # The average is picked again by name and count: it must hold exactly the checkpoints chosen.
        chosen = [Path(w).name for w in weights]
        averaged = [name for name, _sha256 in json.loads(_metadata(Path(info["weights"])).get("averaged", "[]"))]
        if averaged != chosen:
            raise UserError(f"{info['weights']} averages {averaged}, not the checkpoints chosen for decoding {chosen}; "
                            "the run is still saving checkpoints, evaluate it once training is done")
    return model.eval(), bpe


def weights_fingerprint(paths: Sequence[Path]) -> list[list]:
    """Identity of a checkpoint set without hashing gigabytes: name, size, mtime (ns)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def _metadata(path: Path) -> dict:
    """The metadata of a safetensors file (an average records the checkpoints it averages)."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
