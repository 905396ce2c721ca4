"""The training loop: Adam(0.9, 0.98) with fairseq's inverse_sqrt schedule, label-smoothed cross
entropy, optional gradient clipping, autocast at the runtime's precision (fp16 with a gradient
scaler), gradient accumulation over `update_freq` batches, token-budget batches whose features are
read by DataLoader workers. No PrLM is ever loaded here (train_fused.run_setup builds what it trains).
One update's arithmetic (schedule, loss, accumulation, out-of-memory retry) is train_fused.update_step's.

On a CUDA device batches arrive in pinned memory and are copied to the GPU on a side stream one
batch ahead of the step that reads them.

A checkpoint (weights + optimizer as safetensors, trainer state as JSON) is written every
`save_every` updates and at every epoch end; the dev loss is computed at each of them
(best.safetensors), and patience counts the epochs whose end-of-epoch dev loss beat no earlier
one. Resuming restores the update count, the learning rate, the position in the epoch's batch
order and the RNG, so an interrupted run ends with the weights an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from prlmfuse import signals
from prlmfuse.distributed import DistContext, barrier
from prlmfuse.errors import UserError
from prlmfuse.precision import Runtime, grad_scaler, prepare_device, resolve_runtime
from prlmfuse.train_fused import checkpointing, run_dir as rundir
from prlmfuse.train_fused.batch_samplers import StorageWindowBatchSampler, TokenBudgetBatchSampler
from prlmfuse.train_fused.buckets import BatchShapes, BucketBatchSampler, prlm_lengths
from prlmfuse.train_fused.config import RunConfig
from prlmfuse.train_fused.data import Batch, PairDataset, make_loader
from prlmfuse.train_fused.metrics_log import MetricsLog
from prlmfuse.train_fused.modeling import FusedTransformer
from prlmfuse.train_fused.update_step import UpdateStepMixin, inverse_sqrt_lr

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ loader workers


def loader_workers(num_workers: int | str, device: torch.device) -> int:
    """DataLoader workers for `num_workers` ("auto" or a count). auto: on a GPU half the CPU threads this run
    has (train.jobs shares the cores out), between 2 and 8, since the GPU step outpaces two workers reading a
    disk cache (`python bench/gpu.py --only train`: fused_disk against fused_disk_more_workers); on a CPU 2,
    which leave the step its cores."""
    if num_workers != "auto":
        return int(num_workers)
    if device.type != "cuda":
        return 2
    return max(2, min(8, torch.get_num_threads() // 2))


# ------------------------------------------------------------------------------------ the dev hook


@dataclasses.dataclass(frozen=True)
class DevEvaluation:
    """One dev evaluation, as a dev hook sees it."""

    update: int
    epoch: int  # epochs completed
    epoch_end: bool  # taken at an epoch's end
    dev_loss: float


@dataclasses.dataclass(frozen=True)
class DevHook:
    """What a caller adds to a run's dev evaluations (prlmfuse's search: a pruner's rungs), without the trainer
    knowing who asks.

    at_updates: updates with a dev evaluation (and a checkpoint) beside save_every's and the epoch ends.
    after: called after every dev evaluation, before its checkpoint is written; None goes on, a string stops
    the run there: "reason" or "reason: detail" (e.g. "pruned: ..."). The reason is saved in the trainer
    state (`stopped`), so the run is over, as at a budget reached, and a rerun trains nothing more."""

    at_updates: frozenset[int] = frozenset()
    after: Callable[[DevEvaluation], str | None] | None = None


# ------------------------------------------------------------------------------------ the loop


class Trainer(UpdateStepMixin):
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
        runtime: Runtime | None = None,
        dev_hook: DevHook | None = None,
    ):
        self.run = run
        self.run_dir = run_dir
        if dev_hook is not None and ctx.enabled:
            raise UserError(f"run {run.name}: a dev hook (a search's pruning) needs one training process, not torchrun")
        self.dev_hook = dev_hook
        self.runtime = runtime if runtime is not None else resolve_runtime()
        self.device = self.runtime.device
        prepare_device(self.device)  # a runtime resolved in another process did not set this one up
        self.model = model.to(self.device)
        # compile: the forward and the loss as one graph (its backward another), checkpoints keep the plain module.
        # On CUDA in reduce-overhead mode, so each batch shape is captured once and replayed as a CUDA graph.
        self.padded_sums = self._compiled_sums() if run.compile else None
        if run.compile and not run.static_shapes and self.device.type == "cuda":
            logger.warning("train: %s compiles without static_shapes: each new batch shape is compiled and captured "
                           "again; set static_shapes: true", run.name)
        self.ctx = ctx
        self.progress = progress
        self.scaler = grad_scaler(self.runtime)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel over all parameters instead of torch's per-tensor loop (CPU and CUDA alike).
        self.optimizer = torch.optim.Adam(
            self.params, lr=run.lr, betas=tuple(run.adam_betas), eps=1e-8, weight_decay=run.weight_decay, fused=True
        )
        workers = 0 if run.in_memory_features else loader_workers(run.num_workers, self.device)
        on_gpu = self.device.type == "cuda"
        shapes = None
        if run.static_shapes:
            usable, prlm_lens = self._usable(train_set, model), prlm_lengths(train_set)
            shapes = BatchShapes.fit(train_set.src_lens[usable], train_set.tgt_lens[usable],
                                     None if prlm_lens is None else prlm_lens[usable], run.max_tokens, ctx.world_size)
            train_set.shapes = dev_set.shapes = shapes
            self.train_sampler = BucketBatchSampler(
                train_set.src_lens, train_set.tgt_lens, shapes, prlm_lens=prlm_lens, indices=usable, seed=run.seed,
                rank=ctx.rank, world_size=ctx.world_size,
            )
        elif run.read_window and train_set.branches:
            self.train_sampler = StorageWindowBatchSampler(
                train_set.src_lens, train_set.tgt_lens, run.max_tokens, train_set.branches[0].reader.stored_order(),
                window=run.read_window, indices=self._usable(train_set, model), seed=run.seed, rank=ctx.rank,
                world_size=ctx.world_size,
            )
        else:
            self.train_sampler = TokenBudgetBatchSampler(
                train_set.src_lens, train_set.tgt_lens, run.max_tokens,
                indices=self._usable(train_set, model), seed=run.seed, rank=ctx.rank, world_size=ctx.world_size,
            )
        self.train_loader = make_loader(train_set, self.train_sampler, num_workers=workers, pin_memory=on_gpu)
        dev_order = dict(indices=self._usable(dev_set, model), shuffle=False, seed=run.seed, rank=ctx.rank,
                         world_size=ctx.world_size)
        self.dev_sampler = (
            BucketBatchSampler(dev_set.src_lens, dev_set.tgt_lens, shapes, prlm_lens=prlm_lengths(dev_set), **dev_order)
            if shapes is not None else TokenBudgetBatchSampler(dev_set.src_lens, dev_set.tgt_lens, run.max_tokens, **dev_order)
        )
        # Dev is read in-process: it is small, and the loop waits for it anyway.
        self.dev_loader = make_loader(dev_set, self.dev_sampler, num_workers=0, pin_memory=on_gpu)
        self.stop_signalled = False  # set by train_step when a stop signal reached any rank
        self.last_oom_retries = 0  # times train_step's last update was split after running out of memory
        self.restored_resume_point = False  # restore() read a stop signal's resume point
        self.last_logged_loss: float | None = None  # the progress bar's loss
        self.state = rundir.TrainingState(
            seed=run.seed, batches_per_epoch=len(self.train_sampler.batches), world_size=ctx.world_size
        )

    @staticmethod
    def _usable(dataset: PairDataset, model: FusedTransformer) -> np.ndarray:
        # Pairs longer than the position table cannot be embedded; fairseq skips them too.
        limit = int(model.config.max_positions) if hasattr(model, "config") else 1024
        ok = np.flatnonzero((dataset.src_lens <= limit) & (dataset.tgt_lens <= limit))
        if len(ok) == 0:
            raise UserError(f"every sentence pair is longer than max_positions={limit} BPE tokens; check the corpus")
        return ok

    # -- resume ------------------------------------------------------------------------------

    def restore(self, state: rundir.TrainingState) -> None:
        checkpointing.load_checkpoint(self.run_dir, state, self.model, self.optimizer)
        self.restored_resume_point = state.checkpoint.startswith(f"{rundir.RESUME_DIR}/")
        # The checkpoint's progress; a field it lacks keeps this run's value, and the next save writes its own
        # CHECKPOINT_FIELDS (learning rate, RNG, file names).
        for field in dataclasses.fields(state):
            value = getattr(state, field.name)
            if value is not None and field.name not in rundir.CHECKPOINT_FIELDS:
                setattr(self.state, field.name, value)
        if state.batches_per_epoch not in (None, len(self.train_sampler.batches)):
            raise UserError(
                f"{self.run_dir}: the training data now forms {len(self.train_sampler.batches)} batches per epoch, "
                f"the checkpoint was made with {state.batches_per_epoch}; resume with the same data and max_tokens"
            )
        torch.set_rng_state(torch.tensor(state.torch_rng_state, dtype=torch.uint8))
        if self.device.type == "cuda" and state.cuda_rng_state is not None:
            torch.cuda.set_rng_state(torch.tensor(state.cuda_rng_state, dtype=torch.uint8), self.device)
        if self.scaler.is_enabled() and state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)

    # -- batches on the device -----------------------------------------------------------------

    def _on_device(self, batches):
        """The loader's batches on the model's device, each copied while the step before it runs.

        On the CPU they pass through untouched. On CUDA the pinned batch is copied on a side stream
        one batch ahead; the compute stream waits for that copy only when it reads the batch.
        """
        if self.device.type != "cuda":
            yield from batches
            return
        copy_stream = torch.cuda.Stream(self.device)

        def issue(batch: Batch) -> Batch:
            with torch.cuda.stream(copy_stream):
                return batch.to(self.device, non_blocking=True)

        def ready(batch: Batch) -> Batch:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(copy_stream)
            # The tensors were allocated on the copy stream: tell the allocator the compute stream uses them.
            batch._map(lambda t: t.record_stream(current) or t)
            return batch

        iterator = iter(batches)
        pending = next(iterator, None)
        pending = None if pending is None else issue(pending)
        while pending is not None:
            following = next(iterator, None)
            following = None if following is None else issue(following)
            yield ready(pending)
            pending = following

    # -- checkpoints -------------------------------------------------------------------------

    def evaluate_and_save(self, metrics: MetricsLog) -> None:
        dev_loss, dev_nll = self.dev_loss()
        state = self.state
        is_best = state.best_dev_loss is None or dev_loss < state.best_dev_loss
        if is_best:
            state.best_dev_loss = dev_loss
        if rundir.is_epoch_end(state):
            if state.best_epoch_dev_loss is None or dev_loss < state.best_epoch_dev_loss:
                state.best_epoch_dev_loss = dev_loss
                state.bad_epochs = 0
            else:
                state.bad_epochs += 1
        state.last_dev_loss = dev_loss
        record = {
            "update": state.update, "epoch": state.epoch, "dev_loss": dev_loss, "dev_nll_loss": dev_nll,
            "best_dev_loss": state.best_dev_loss, "wall_time": round(state.wall_time, 3),
        }
        verdict = self._ask_dev_hook(dev_loss) if self.dev_hook is not None and self.dev_hook.after else None
        if verdict:
            reason, _, detail = verdict.partition(":")
            state.stopped = record["stopped"] = reason.strip()
            logger.info("train: %s %s at update %d%s", self.run.name, state.stopped, state.update,
                        f": {detail.strip()}" if detail.strip() else "")
        metrics.log(record)
        if self.stop_reason() == "max_updates" and state.update not in (state.budget_ends or []):
            # Recorded with the save, so that a run trained on later keeps what an average here reads.
            state.budget_ends = [*(state.budget_ends or []), state.update]
        if self.ctx.is_main:
            checkpointing.save_checkpoint(
                self.run_dir, self.model, self.optimizer, self._state_to_save(), is_best=is_best,
                keep_last=self.run.keep_last, keep_last_epochs=self.run.keep_last_epochs,
            )
        barrier(self.ctx)

    def _ask_dev_hook(self, dev_loss: float) -> str | None:
        state = self.state
        return self.dev_hook.after(DevEvaluation(update=state.update, epoch=state.epoch,
                                                 epoch_end=rundir.is_epoch_end(state), dev_loss=dev_loss))

    def _state_to_save(self) -> rundir.TrainingState:
        """The trainer state with what restoring it needs: learning rate, RNG states, the gradient scaler."""
        state = self.state
        return dataclasses.replace(
            state,
            lr=inverse_sqrt_lr(max(state.update, 1), self.run.lr, self.run.warmup),
            torch_rng_state=torch.get_rng_state().tolist(),
            cuda_rng_state=torch.cuda.get_rng_state(self.device).tolist() if self.device.type == "cuda" else None,
            grad_scaler=self.scaler.state_dict() if self.scaler.is_enabled() else None,
        )

    def stop_for_signal(self, last_saved: int) -> None:
        """A stop signal reached a rank: every rank has finished the same update; write the resume point
        (unless that update was just saved) and raise `signals.Stopped`."""
        update = self.state.update
        if last_saved != update and update > 0:
            if self.ctx.is_main:
                checkpointing.save_resume_point(self.run_dir, self.model, self.optimizer, self._state_to_save())
            barrier(self.ctx)
        signum = signals.received() or signal.SIGTERM  # a rank the signal did not reach stops with the others
        logger.info("train: %s stopped by %s at update %d; rerun the same command to resume from there",
                    self.run.name, signal.Signals(signum).name, update)
        raise signals.Stopped(signum, f"run {self.run.name} saved at update {update}; rerun the command (without "
                                      "--fresh) to resume")

    def stop_reason(self) -> str | None:
        return rundir.stop_reason(self.run, self.state)

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> str:
        run, state = self.run, self.state
        batches_per_epoch = len(self.train_sampler.batches)
        updates_per_epoch = -(-batches_per_epoch // run.update_freq)
        total = run.max_updates if run.max_updates is not None else updates_per_epoch * (run.max_epochs or 1)
        metrics = MetricsLog(self.run_dir, run, self.ctx, self.progress, total, state.update)
        # A resume point is no scheduled save: the update it restored is saved again if training ends there.
        last_saved = state.update if state.update > 0 and not self.restored_resume_point else -1
        window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0, "step_time": 0.0, "wait_time": 0.0,
                  "oom_retries": 0}
        try:
            with signals.deferred():
                reason = self._loop(metrics, window, batches_per_epoch, last_saved)
        finally:
            metrics.close()
        return reason

    def _loop(self, metrics: MetricsLog, window: dict, batches_per_epoch: int, last_saved: int) -> str:
        run, state = self.run, self.state
        while (reason := self.stop_reason()) is None:
            self.train_sampler.set_epoch(state.epoch, state.batch_in_epoch)
            batches = self._on_device(self.train_loader)
            while True:
                t_wait = time.perf_counter()
                # The last update of an epoch takes the batches that are left (fairseq does the same).
                group = [b for _, b in zip(range(run.update_freq), batches)]
                if not group:
                    break
                t_step = time.perf_counter()
                loss_sum, nll_sum, ntokens = self.train_step(group)
                t_end = time.perf_counter()
                state.batch_in_epoch += len(group)
                state.wall_time += t_end - t_wait
                window["loss"] += loss_sum
                window["nll"] += nll_sum
                window["tokens"] += ntokens
                window["updates"] += 1
                window["step_time"] += t_end - t_step
                window["wait_time"] += t_step - t_wait
                window["oom_retries"] += self.last_oom_retries
                end_of_epoch = state.batch_in_epoch >= batches_per_epoch
                if end_of_epoch:
                    state.epoch += 1
                    state.batch_in_epoch = 0
                metrics.tick(self._postfix(window))
                if state.update % run.log_every == 0:
                    metrics.log(self._train_record(window))
                    window = dict.fromkeys(window, 0)
                if (end_of_epoch or state.update % run.save_every == 0
                        or (self.dev_hook is not None and state.update in self.dev_hook.at_updates)):
                    self.evaluate_and_save(metrics)
                    last_saved = state.update
                if self.stop_signalled and self.stop_reason() is None:
                    self.stop_for_signal(last_saved)
                if end_of_epoch or self.stop_reason() is not None:
                    break
        if last_saved != state.update and state.update > 0:
            self.evaluate_and_save(metrics)
        return reason

    def _postfix(self, window: dict) -> dict:
        # The loss shown is the last one logged: reading the window's would wait for the device every update.
        elapsed = window["step_time"] + window["wait_time"]
        if elapsed <= 0:
            return {}
        shown = {} if self.last_logged_loss is None else {"loss": f"{self.last_logged_loss:.3f}"}
        return shown | {"upd/s": f"{window['updates'] / elapsed:.2f}", "tok/s": f"{window['tokens'] / elapsed:.0f}"}

    def _train_record(self, window: dict) -> dict:
        elapsed = max(window["step_time"] + window["wait_time"], 1e-9)
        self.last_logged_loss = float(window["loss"]) / max(window["tokens"], 1)
        return {
            "update": self.state.update,
            "epoch": self.state.epoch,
            "loss": self.last_logged_loss,
            "nll_loss": float(window["nll"]) / max(window["tokens"], 1),
            "lr": inverse_sqrt_lr(self.state.update, self.run.lr, self.run.warmup),
            "tokens_per_s": window["tokens"] / elapsed,
            "updates_per_s": window["updates"] / elapsed,
            "data_wait_fraction": window["wait_time"] / elapsed,
            "oom_retries": window["oom_retries"],  # updates done again in smaller batches after running out of memory
            "wall_time": round(self.state.wall_time, 3),
        }


