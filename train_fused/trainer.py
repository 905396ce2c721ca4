"""Stage two: train a (fused) Transformer from cached PrLM features. No PrLM is ever loaded here.

train_run() checks the caches against the corpus, trains the joint BPE, builds the model, and
runs the loop: Adam(0.9, 0.98) with fairseq's inverse_sqrt schedule, label-smoothed cross
entropy, optional gradient clipping and bf16 autocast, token-budget batches whose features are
read by DataLoader workers. A checkpoint (weights + optimizer as safetensors, trainer state as
JSON) is written every `save_every` updates and at every epoch end; the dev loss is computed at
each of them (best.safetensors, patience). Resuming restores the update count, the learning
rate, the position in the epoch's batch order and the RNG, so an interrupted run ends with the
weights an uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import prlmfuse
from prlmfuse.cache_features import CacheReader, verify_cache
from prlmfuse.errors import UserError
from prlmfuse.precision import cpu_has_fast_bf16
from prlmfuse.fileio import pid_lock, atomic_write_json, atomic_write_text, read_json, read_lines
from prlmfuse.train_fused import checkpointing
from prlmfuse.train_fused.bpe import PAD_ID, BPE, train_bpe
from prlmfuse.train_fused.config import PrLMUse, RunConfig
from prlmfuse.train_fused.data import Batch, FeatureSource, PairDataset, TokenBudgetBatchSampler, make_loader
from prlmfuse.distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    broadcast_parameters,
    init_distributed,
    reduce_gradients,
)
from prlmfuse.train_fused.modeling import FusedTransformer, ModelConfig, PrLMSpec

LAYER_MODES = ("dyn_cls", "dyn_aver", "dwatt", "concat")
RUN_JSON = "run.json"
BPE_JSON = "bpe.json"
METRICS = "metrics.jsonl"
# RunConfig fields that only steer when to stop, how often to log, or how to feed data: a resumed
# run may change them. Every other field defines the run and must match the run directory.
_RESUMABLE_FIELDS = {
    "max_updates", "max_epochs", "patience", "save_every", "keep_last", "log_every",
    "tensorboard", "num_workers", "in_memory_features",
}


@dataclass
class PrLMCaches:
    """The feature caches (directories or fsspec URLs) one PrLM branch reads, per split."""

    use: PrLMUse
    train: str
    dev: str
    test: str | None = None


# ------------------------------------------------------------------------------------ recipe


def inverse_sqrt_lr(update: int, lr: float, warmup: int) -> float:
    """fairseq's inverse_sqrt for the `update`-th update (1-based): linear warmup from ~0, then lr*sqrt(warmup/update)."""
    update = max(1, int(update))
    if warmup <= 0:
        return lr
    if update <= warmup:
        return lr * update / warmup
    return lr * math.sqrt(warmup / update)


def label_smoothed_sums(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(label-smoothed loss, plain NLL), both summed over the non-pad target tokens, in float32.

    logits [..., V] and target [...] of the same leading shape; PAD_ID targets are ignored.
    """
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum")
    with torch.no_grad():
        # NLL for the logs, from the loss itself. torch's smoothed loss of row i is
        # (1 - e)(lse_i - z_it) + e(lse_i - mean_j z_ij), so
        # nll_i = lse_i - z_it = loss_i + e(mean_j z_ij - z_it): one plain mean over the logits instead
        # of a logsumexp's four passes (max, subtract, exp, sum) over the step's widest tensor
        # (`bench/train_throughput.py --compare nll` times the two).
        keep = flat_target != PAD_ID
        target_logit = flat_logits.gather(1, flat_target.unsqueeze(1)).squeeze(1)
        nll = loss.detach() + smoothing * ((flat_logits.mean(dim=-1) - target_logit) * keep).sum()
    return loss, nll


# ------------------------------------------------------------------------------------ caches


@dataclass
class _Branch:
    """One PrLM branch resolved against its caches."""

    use: PrLMUse
    paths: dict[str, str]  # split -> cache path
    keys: dict[str, str]
    checkpoint_name: str
    identity: str
    num_layers_ckpt: int
    hidden_size: int
    cache_layers: list[int]
    selected_layers: list[int]  # absolute hidden_states indices fed to the model
    layer_rows: tuple[int, ...]
    pooled_layers: list[int]
    layer_mode: str
    dtype: str
    max_length: int | None

    def spec(self) -> PrLMSpec:
        return PrLMSpec(
            name=self.checkpoint_name,
            width=self.hidden_size,
            num_layers=len(self.layer_rows),
            num_pooled=len(self.pooled_layers),
            layer_mode=self.layer_mode,
            feature_norm=self.use.feature_norm,
            # Pooled vectors cover hidden_states 0..highest; token layers may be a subset of them.
            pooled_index=[self.pooled_layers.index(l) for l in self.selected_layers]
            if self.layer_mode in ("dyn_cls", "dyn_aver")
            else None,
        )

    def source(self, split: str, in_memory: bool) -> FeatureSource:
        return FeatureSource(
            path=self.paths[split],
            layer_rows=self.layer_rows,
            with_pooled=self.layer_mode in ("dyn_cls", "dyn_aver"),
            in_memory=in_memory,
        )


def _manifest_value(manifest: dict, *names: str, default=None):
    key_fields = manifest.get("key_fields", {}) or {}
    for name in names:
        for where in (manifest, key_fields):
            if where.get(name) is not None:
                return where[name]
    return default


def _resolve_branch(use: PrLMUse, cache: PrLMCaches, corpus) -> _Branch:
    if use.checkpoint != cache.use.checkpoint or use.layer != cache.use.layer:
        raise UserError(
            f"caches for {cache.use.checkpoint} (layer {cache.use.layer}) were passed for the run's PrLM "
            f"{use.checkpoint} (layer {use.layer}); pass the caches in the order of the run's prlms"
        )
    paths = {"train": str(cache.train), "dev": str(cache.dev)}
    if cache.test is not None:
        paths["test"] = str(cache.test)
    manifests: dict[str, dict] = {}
    shapes: dict[str, tuple] = {}
    for split, path in paths.items():
        verify_cache(path)
        reader = CacheReader(path)
        manifest = reader.manifest
        manifests[split] = manifest
        shapes[split] = (
            [int(x) for x in reader.layers],
            [int(x) for x in reader.pooled_layers],
            int(reader.hidden_size),
            str(_manifest_value(manifest, "checkpoint_identity", "identity", default="")),
        )
        num_sentences = int(reader.num_sentences)
        reader.close()
        cache_sha = _manifest_value(manifest, "corpus_sha256")
        corpus_sha = corpus.src_sha256(split)
        if cache_sha != corpus_sha:
            raise UserError(
                f"cache {path} was built from a different {split} source (cache corpus_sha256 {str(cache_sha)[:16]}, "
                f"corpus {corpus.root} {split}.src sha256 {corpus_sha[:16]}); rebuild the cache for this corpus"
            )
        lines = int(corpus.splits[split]["src"]["lines"])
        if num_sentences != lines:
            raise UserError(
                f"cache {path} holds {num_sentences} sentences but {corpus.src_path(split)} has {lines} lines; "
                "rebuild the cache for this corpus"
            )
        if use.dtype is not None and manifest.get("dtype") not in (None, use.dtype):
            raise UserError(
                f"cache {path} stores {manifest.get('dtype')} features but the run asks for dtype {use.dtype}; "
                "pass the matching cache or change the run's dtype"
            )
        if shapes[split] != shapes["train"]:
            raise UserError(
                f"cache {path} ({split}) and {paths['train']} (train) differ in checkpoint or layers; "
                "build every split's cache with the same checkpoint and layers"
            )
    train_manifest = manifests["train"]
    cache_layers, pooled_layers, hidden_size, identity = shapes["train"]
    num_layers_ckpt = int(_manifest_value(train_manifest, "num_layers", default=max(cache_layers)))
    if isinstance(use.layer, str):
        if use.layer not in LAYER_MODES:
            raise UserError(
                f"PrLM {use.checkpoint}: layer {use.layer!r} is not a layer index or one of {', '.join(LAYER_MODES)}"
            )
        layer_rows = tuple(range(len(cache_layers)))
        selected = list(cache_layers)
        layer_mode = use.layer
    else:
        layer = int(use.layer)
        absolute = layer if layer >= 0 else num_layers_ckpt + 1 + layer
        if absolute not in cache_layers:
            raise UserError(
                f"PrLM {use.checkpoint}: layer {layer} (hidden_states index {absolute} of {num_layers_ckpt} layers) is "
                f"not in cache {paths['train']}, which holds layers {cache_layers}; rebuild the cache with that layer"
            )
        layer_rows = (cache_layers.index(absolute),)
        selected = [absolute]
        layer_mode = "fixed"
    if layer_mode in ("dyn_cls", "dyn_aver") and not pooled_layers:
        raise UserError(f"cache {paths['train']} has no pooled vectors, which layer {layer_mode} needs; rebuild it")
    return _Branch(
        use=use,
        paths=paths,
        keys={split: str(m.get("key", "")) for split, m in manifests.items()},
        checkpoint_name=str(_manifest_value(train_manifest, "checkpoint_name", "checkpoint", default=use.checkpoint)),
        identity=identity,
        num_layers_ckpt=num_layers_ckpt,
        hidden_size=hidden_size,
        cache_layers=cache_layers,
        selected_layers=selected,
        layer_rows=layer_rows,
        pooled_layers=pooled_layers,
        layer_mode=layer_mode,
        dtype=str(train_manifest.get("dtype", use.dtype or "")),
        max_length=_manifest_value(train_manifest, "max_length")
        or (_manifest_value(train_manifest, "truncation", default={}) or {}).get("max_length"),
    )


# ------------------------------------------------------------------------------------ run setup


def _check_run(run: RunConfig, caches: list[PrLMCaches]) -> None:
    if run.max_updates is None and run.max_epochs is None:
        raise UserError(f"run {run.name}: set max_updates or max_epochs, or training never stops")
    if len(caches) != len(run.prlms):
        raise UserError(
            f"run {run.name} fuses {len(run.prlms)} PrLM(s) but {len(caches)} cache set(s) were given; "
            "pass one PrLMCaches per entry of the run's prlms"
        )
    if run.max_tokens < 16:
        raise UserError(f"run {run.name}: max_tokens={run.max_tokens} is too small; use a few thousand (3500)")


def build_model_config(run: RunConfig, vocab_size: int, specs: list[PrLMSpec]) -> ModelConfig:
    """The run's preset resolved to sizes, with its explicit overrides and the BPE vocabulary."""
    return ModelConfig.from_preset(
        run.preset,
        vocab_size=vocab_size,
        d_model=run.d_model,
        enc_layers=run.enc_layers,
        dec_layers=run.dec_layers,
        heads=run.heads,
        ffn=run.ffn,
        dropout=run.dropout,
        pre_ln=run.pre_ln,
        prlms=list(specs),
        merge=run.merge,
        position=run.position,
        side=run.side,
    )


def _encode_split(bpe: BPE, corpus, split: str, limit: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    src = read_lines(corpus.src_path(split))
    tgt = read_lines(corpus.tgt_path(split))
    if limit is not None:
        src, tgt = src[:limit], tgt[:limit]
    return (
        [np.asarray(ids, dtype=np.int32) for ids in bpe.encode_batch(src)],
        [np.asarray(ids, dtype=np.int32) for ids in bpe.encode_batch(tgt)],
    )


def _run_info(run: RunConfig, corpus, branches: list[_Branch], model_config: ModelConfig, extra: dict) -> dict:
    return {
        "name": run.name,
        "prlmfuse_version": prlmfuse.__version__,
        "model": dataclasses.asdict(model_config),
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
        "prlms": [
            {
                "checkpoint": b.use.checkpoint,
                "checkpoint_name": b.checkpoint_name,
                "identity": b.identity,
                "num_layers": b.num_layers_ckpt,
                "hidden_size": b.hidden_size,
                "layer": b.use.layer,
                "layers": b.selected_layers,
                "cache_layers": b.cache_layers,
                "layer_mode": b.layer_mode,
                "dtype": b.dtype,
                "max_length": b.max_length,
                "caches": {split: {"path": b.paths[split], "key": b.keys[split]} for split in b.paths},
            }
            for b in branches
        ],
        "bpe": BPE_JSON,
        **extra,
    }


# Settings added after runs were trained with prlmfuse: a run.json without one has its default.
_LATER_DEFAULTS = {"feature_norm": False}


def _without_later_defaults(value):
    if isinstance(value, dict):
        return {k: _without_later_defaults(v) for k, v in value.items()
                if not (k in _LATER_DEFAULTS and v == _LATER_DEFAULTS[k])}
    if isinstance(value, list):
        return [_without_later_defaults(v) for v in value]
    return value


def _defining(info: dict) -> dict:
    """The parts of run.json that must not change when a run is resumed."""
    train = {k: v for k, v in info["train"].items() if k not in _RESUMABLE_FIELDS}
    prlms = [{k: v for k, v in p.items() if k != "caches"} | {"keys": {s: c["key"] for s, c in p["caches"].items() if s != "test"}} for p in info["prlms"]]
    return _without_later_defaults({"model": info["model"], "train": train, "corpus": info["corpus"]["sha256"], "prlms": prlms})


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{prefix}{i}.")
    return f"{prefix.rstrip('.')} ({a!r} in the run directory, {b!r} now)"


# ------------------------------------------------------------------------------------ the loop


class _Logger:
    """metrics.jsonl (rank 0), optional TensorBoard, tqdm."""

    def __init__(self, run_dir: Path, run: RunConfig, ctx: DistContext, progress: bool, total: int | None, initial: int):
        self.enabled = ctx.is_main
        self.path = run_dir / METRICS
        self.tb = None
        self.bar = None
        if not self.enabled:
            return
        if run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                warnings.warn("run.tensorboard is set but the tensorboard package is not installed; logging to metrics.jsonl only")
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=run.name, unit="upd", dynamic_ncols=True, file=sys.stderr)
        self.file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "update" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["update"])

    def tick(self, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def _truncate_metrics(path: Path, update: int) -> None:
    """Drop metric lines past the checkpoint being resumed from (and a line cut by a kill)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("update", 0)) <= update:
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        run_dir: Path,
        model: FusedTransformer,
        train_set: PairDataset,
        dev_set: PairDataset,
        ctx: DistContext,
        *,
        progress: bool,
    ):
        self.run = run
        self.run_dir = run_dir
        self.model = model
        self.ctx = ctx
        self.progress = progress
        self.use_bf16 = bool(run.bf16) and cpu_has_fast_bf16()
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel over all parameters; torch's default on CPU is a per-tensor loop, ~4x slower.
        self.optimizer = torch.optim.Adam(
            self.params, lr=run.lr, betas=tuple(run.adam_betas), eps=1e-8, weight_decay=run.weight_decay, fused=True
        )
        workers = 0 if run.in_memory_features else run.num_workers
        self.train_sampler = TokenBudgetBatchSampler(
            train_set.src_lens, train_set.tgt_lens, run.max_tokens,
            indices=self._usable(train_set, model), seed=run.seed, rank=ctx.rank, world_size=ctx.world_size,
        )
        self.train_loader = make_loader(train_set, self.train_sampler, num_workers=workers)
        self.dev_sampler = TokenBudgetBatchSampler(
            dev_set.src_lens, dev_set.tgt_lens, run.max_tokens,
            indices=self._usable(dev_set, model), shuffle=False, seed=run.seed, rank=ctx.rank, world_size=ctx.world_size,
        )
        # Dev is read in-process: it is small, and the loop waits for it anyway.
        self.dev_loader = make_loader(dev_set, self.dev_sampler, num_workers=0)
        self.state = {
            "update": 0, "epoch": 0, "batch_in_epoch": 0, "best_dev_loss": None, "bad_evals": 0,
            "last_dev_loss": None, "tokens_seen": 0, "wall_time": 0.0, "seed": run.seed,
            "batches_per_epoch": len(self.train_sampler.batches),
            "world_size": ctx.world_size,
        }

    @staticmethod
    def _usable(dataset: PairDataset, model: FusedTransformer) -> np.ndarray:
        # Pairs longer than the position table cannot be embedded; fairseq skips them too.
        limit = int(model.config.max_positions) if hasattr(model, "config") else 1024
        ok = np.flatnonzero((dataset.src_lens <= limit) & (dataset.tgt_lens <= limit))
        if len(ok) == 0:
            raise UserError(f"every sentence pair is longer than max_positions={limit} BPE tokens; check the corpus")
        return ok

    # -- resume ------------------------------------------------------------------------------

    def restore(self, state: dict) -> None:
        checkpointing.load_checkpoint(self.run_dir, state, self.model, self.optimizer)
        for k in self.state:
            if k in state:
                self.state[k] = state[k]
        if state.get("batches_per_epoch") not in (None, len(self.train_sampler.batches)):
            raise UserError(
                f"{self.run_dir}: the training data now forms {len(self.train_sampler.batches)} batches per epoch, "
                f"the checkpoint was made with {state['batches_per_epoch']}; resume with the same data and max_tokens"
            )
        torch.set_rng_state(torch.tensor(state["torch_rng_state"], dtype=torch.uint8))

    # -- one update --------------------------------------------------------------------------

    def _forward_sums(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        scored = batch.tgt_out != PAD_ID
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.use_bf16):
            logits = self.model(batch.src_tokens, batch.tgt_in, batch.prlm, scored=scored)
        return label_smoothed_sums(logits, batch.tgt_out[scored], self.run.label_smoothing)

    def train_step(self, batch: Batch) -> tuple[float, float, int]:
        """One optimizer update on (this rank's slice of) a global batch; returns global sums."""
        self.model.train()
        lr = inverse_sqrt_lr(self.state["update"] + 1, self.run.lr, self.run.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = nll_sum = torch.zeros(())
        if batch.nsentences > 0:
            loss_sum, nll_sum = self._forward_sums(batch)
            loss_sum.backward()
        stats = torch.tensor([loss_sum.item(), nll_sum.item(), float(batch.ntokens)], dtype=torch.float64)
        stats = reduce_gradients(self.ctx, self.params, stats)
        ntokens = float(stats[2])
        if ntokens > 0:
            # Gradients of the sum, divided by the global token count: per-token mean over the global batch.
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], ntokens)
            if self.run.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.run.clip_norm)
            self.optimizer.step()
        self.state["update"] += 1
        self.state["tokens_seen"] += int(ntokens)
        return float(stats[0]), float(stats[1]), int(ntokens)

    @torch.no_grad()
    def dev_loss(self) -> tuple[float, float]:
        self.model.eval()
        stats = torch.zeros(3, dtype=torch.float64)
        for batch in self.dev_loader:
            if batch.nsentences == 0:
                continue
            loss_sum, nll_sum = self._forward_sums(batch)
            stats += torch.tensor([loss_sum.item(), nll_sum.item(), float(batch.ntokens)], dtype=torch.float64)
        stats = all_reduce_sum(self.ctx, stats)
        ntokens = max(float(stats[2]), 1.0)
        return float(stats[0]) / ntokens, float(stats[1]) / ntokens

    # -- checkpoints -------------------------------------------------------------------------

    def evaluate_and_save(self, logger: _Logger) -> None:
        dev_loss, dev_nll = self.dev_loss()
        best = self.state["best_dev_loss"]
        is_best = best is None or dev_loss < best
        if is_best:
            self.state["best_dev_loss"] = dev_loss
            self.state["bad_evals"] = 0
        else:
            self.state["bad_evals"] += 1
        self.state["last_dev_loss"] = dev_loss
        logger.log({
            "update": self.state["update"], "epoch": self.state["epoch"], "dev_loss": dev_loss, "dev_nll_loss": dev_nll,
            "best_dev_loss": self.state["best_dev_loss"], "wall_time": round(self.state["wall_time"], 3),
        })
        if self.ctx.is_main:
            state = dict(self.state)
            state["lr"] = inverse_sqrt_lr(max(self.state["update"], 1), self.run.lr, self.run.warmup)
            state["torch_rng_state"] = torch.get_rng_state().tolist()
            checkpointing.save_checkpoint(
                self.run_dir, self.model, self.optimizer, state, is_best=is_best, keep_last=self.run.keep_last
            )
        barrier(self.ctx)

    def stop_reason(self) -> str | None:
        run, s = self.run, self.state
        if run.max_updates is not None and s["update"] >= run.max_updates:
            return "max_updates"
        if run.max_epochs is not None and s["epoch"] >= run.max_epochs:
            return "max_epochs"
        if run.patience is not None and s["bad_evals"] >= run.patience:
            return "patience"
        return None

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> str:
        run, state = self.run, self.state
        batches_per_epoch = len(self.train_sampler.batches)
        total = run.max_updates if run.max_updates is not None else batches_per_epoch * (run.max_epochs or 1)
        logger = _Logger(self.run_dir, run, self.ctx, self.progress, total, state["update"])
        last_saved = state["update"] if state["update"] > 0 else -1
        window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0, "step_time": 0.0, "wait_time": 0.0}
        try:
            while (reason := self.stop_reason()) is None:
                self.train_sampler.set_epoch(state["epoch"], state["batch_in_epoch"])
                batches = iter(self.train_loader)
                while True:
                    t_wait = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        break
                    t_step = time.perf_counter()
                    loss_sum, nll_sum, ntokens = self.train_step(batch)
                    t_end = time.perf_counter()
                    state["batch_in_epoch"] += 1
                    state["wall_time"] += t_end - t_wait
                    window["loss"] += loss_sum
                    window["nll"] += nll_sum
                    window["tokens"] += ntokens
                    window["updates"] += 1
                    window["step_time"] += t_end - t_step
                    window["wait_time"] += t_step - t_wait
                    end_of_epoch = state["batch_in_epoch"] >= batches_per_epoch
                    if end_of_epoch:
                        state["epoch"] += 1
                        state["batch_in_epoch"] = 0
                    logger.tick(self._postfix(window))
                    if state["update"] % run.log_every == 0:
                        logger.log(self._train_record(window))
                        window = dict.fromkeys(window, 0)
                    if end_of_epoch or state["update"] % run.save_every == 0:
                        self.evaluate_and_save(logger)
                        last_saved = state["update"]
                    if end_of_epoch or self.stop_reason() is not None:
                        break
            if last_saved != state["update"] and state["update"] > 0:
                self.evaluate_and_save(logger)
        finally:
            logger.close()
        return reason

    def _postfix(self, window: dict) -> dict:
        elapsed = window["step_time"] + window["wait_time"]
        if elapsed <= 0:
            return {}
        return {
            "loss": f"{window['loss'] / max(window['tokens'], 1):.3f}",
            "upd/s": f"{window['updates'] / elapsed:.2f}",
            "tok/s": f"{window['tokens'] / elapsed:.0f}",
        }

    def _train_record(self, window: dict) -> dict:
        elapsed = max(window["step_time"] + window["wait_time"], 1e-9)
        return {
            "update": self.state["update"],
            "epoch": self.state["epoch"],
            "loss": window["loss"] / max(window["tokens"], 1),
            "nll_loss": window["nll"] / max(window["tokens"], 1),
            "lr": inverse_sqrt_lr(self.state["update"], self.run.lr, self.run.warmup),
            "tokens_per_s": window["tokens"] / elapsed,
            "updates_per_s": window["updates"] / elapsed,
            "data_wait_fraction": window["wait_time"] / elapsed,
            "wall_time": round(self.state["wall_time"], 3),
        }


# ------------------------------------------------------------------------------------ public API


def train_run(
    run: RunConfig,
    corpus,
    caches: list[PrLMCaches],
    out_dir: str | os.PathLike,
    *,
    resume: bool = True,
    progress: bool = True,
) -> Path:
    """Train one run into `out_dir` (the run directory); resume=True continues a run already there."""
    run_dir = Path(out_dir)
    _check_run(run, caches)
    ctx = init_distributed()
    branches = [_resolve_branch(use, cache, corpus) for use, cache in zip(run.prlms, caches)]
    with contextlib.ExitStack() as stack:
        if ctx.is_main:
            stack.enter_context(_run_dir_lock(run_dir))
            # Safe only under the lock: a killed save's temp file is nobody's now.
            checkpointing.remove_stale_temps(run_dir)
        return _train_locked(run, corpus, branches, run_dir, ctx, resume=resume, progress=progress)


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path):
    """One training process per run directory: a second one would interleave checkpoints."""

    def refuse(pid: str) -> None:
        raise UserError(
            f"{run_dir} is being trained by another process (pid {pid}); wait for it to finish "
            "(a rerun then resumes or finds the run done) or choose another directory"
        )

    with pid_lock(run_dir / ".lock", when_held=refuse):
        yield


def _train_locked(run: RunConfig, corpus, branches: list[_Branch], run_dir: Path, ctx: DistContext, *, resume: bool,
                  progress: bool) -> Path:
    existing = checkpointing.latest_trainer_state(run_dir) if run_dir.is_dir() else None
    if existing is not None and not resume:
        raise UserError(
            f"{run_dir} already holds a trained run (update {existing['update']}); resume it or choose a new directory"
        )

    bpe_path = run_dir / BPE_JSON
    if ctx.is_main and (existing is None or not bpe_path.is_file()):
        if existing is not None:
            raise UserError(f"{bpe_path} is missing from a run with checkpoints; restore it or start in a new directory")
        src = read_lines(corpus.src_path("train"))
        tgt = read_lines(corpus.tgt_path("train"))
        if run.max_train_pairs is not None:
            src, tgt = src[: run.max_train_pairs], tgt[: run.max_train_pairs]
        train_bpe(src + tgt, run.bpe_vocab).save(bpe_path)
    barrier(ctx)
    bpe = BPE.load(bpe_path)

    torch.manual_seed(run.seed)
    model_config = build_model_config(run, bpe.vocab_size, [b.spec() for b in branches])
    model = FusedTransformer(model_config)
    broadcast_parameters(ctx, model)

    train_src, train_tgt = _encode_split(bpe, corpus, "train", run.max_train_pairs)
    dev_src, dev_tgt = _encode_split(bpe, corpus, "dev", None)
    train_set = PairDataset(train_src, train_tgt, [b.source("train", run.in_memory_features) for b in branches])
    dev_set = PairDataset(dev_src, dev_tgt, [b.source("dev", run.in_memory_features) for b in branches])
    trainer = Trainer(run, run_dir, model, train_set, dev_set, ctx, progress=progress)

    info = _run_info(run, corpus, branches, model_config, {
        "bf16": trainer.use_bf16,
        "world_size": ctx.world_size,
        "train_pairs": len(train_set),
        "train_pairs_used": int(sum(len(b) for b in trainer.train_sampler.batches)),
    })
    run_json = run_dir / RUN_JSON
    if existing is not None and run_json.is_file():
        before = read_json(run_json, "run.json")
        if _defining(before) != _defining(info):
            raise UserError(
                f"{run_dir} was trained with a different configuration ({_first_difference(_defining(before), _defining(info))}); "
                "use a new output directory or resume=False after removing it"
            )
    if ctx.is_main:
        atomic_write_json(run_json, info)

    if existing is not None:
        trainer.restore(existing)
    if ctx.is_main:
        _truncate_metrics(run_dir / METRICS, int(existing["update"]) if existing is not None else 0)
    barrier(ctx)
    trainer.fit()
    return run_dir


def average_checkpoints(run_dir: str | os.PathLike, last: int = 5, out: str | os.PathLike | None = None) -> Path:
    """Safetensors average of the newest `last` checkpoints of a run (run_dir/average-last{K}.safetensors)."""
    return checkpointing.average_checkpoints(run_dir, last=last, out=out)


def load_run(
    run_dir: str | os.PathLike, weights: str = "average", *, last: int = 5
) -> tuple[FusedTransformer, BPE, dict]:
    """(model in eval mode with the chosen weights, the run's BPE, run.json + "weights" path).

    weights: "best" (lowest dev loss), "last" (newest checkpoint) or "average" (of the last `last`).
    """
    run_dir = Path(run_dir)
    info = read_json(run_dir / RUN_JSON, "run.json")
    bpe = BPE.load(run_dir / BPE_JSON)
    model = FusedTransformer(ModelConfig.from_dict(info["model"]))
    if weights == "best":
        path = run_dir / checkpointing.BEST
    elif weights == "last":
        state = checkpointing.latest_trainer_state(run_dir)
        if state is None:
            raise UserError(f"{run_dir} has no checkpoint yet; train the run first")
        path = run_dir / state["checkpoint"]
    elif weights == "average":
        path = checkpointing.average_checkpoints(run_dir, last=last)
    else:
        raise UserError(f"weights={weights!r}: choose best, last or average")
    checkpointing.load_weights(model, path)
    model.eval()
    info = dict(info)
    info["weights"] = str(path)
    return model, bpe, info
