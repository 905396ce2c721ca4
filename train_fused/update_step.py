"""One optimizer update and the loss arithmetic under it: fairseq's inverse_sqrt schedule, label-smoothed loss sums,
gradient accumulation and reduction over ranks, the out-of-memory retry in halves, and the dev loss."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

import prlmfuse.train_fused.out_of_memory as oom
from prlmfuse import signals
from prlmfuse.distributed import all_reduce_sum, reduce_gradients
from prlmfuse.errors import UserError
from prlmfuse.precision import free_memory, is_out_of_memory
from prlmfuse.train_fused.bpe import PAD_ID
from prlmfuse.train_fused.data import Batch
from prlmfuse.train_fused.out_of_memory import split_batch

logger = logging.getLogger(__name__)


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


class UpdateStepMixin:
    """Trainer's update step and dev loss, apart from the loop, checkpoints and resume around them.

    Reads what Trainer.__init__ sets (run, runtime, device, model, padded_sums, optimizer, scaler, params, ctx,
    state, dev_loader) and Trainer._on_device; sets stop_signalled and last_oom_retries.
    """

    def _forward_sums(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.src_tokens.device != self.device:
            batch = batch.to(self.device)
        if self.padded_sums is not None:
            if self.device.type == "cuda":
                # Each forward starts a new step of the CUDA graphs: the previous outputs are consumed by now.
                torch.compiler.cudagraph_mark_step_begin()
            return self.padded_sums(batch.src_tokens, batch.tgt_in, batch.tgt_out, batch.prlm)
        # Eager: only the scored positions reach the output projection and the loss (a data-dependent shape).
        scored = batch.tgt_out != PAD_ID
        with self.runtime.autocast():
            logits = self.model(batch.src_tokens, batch.tgt_in, batch.prlm, scored=scored)
        return label_smoothed_sums(logits, batch.tgt_out[scored], self.run.label_smoothing)

    def _padded_sums(self, src_tokens, tgt_in, tgt_out, prlm) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss sums over every position of the padded batch, padding masked out by its target id:
        no shape depends on the data, so the whole of it compiles into one graph."""
        with self.runtime.autocast():
            logits = self.model(src_tokens, tgt_in, prlm)
        return label_smoothed_sums(logits, tgt_out, self.run.label_smoothing)

    def _compiled_sums(self):
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        return torch.compile(self._padded_sums, mode=mode)

    def train_step(self, batch: Batch | list[Batch]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer update on (this rank's slice of) `update_freq` global batches; returns the global sums of
        the loss and the NLL (0-d float64 tensors, on the device) and the global target token count.

        As fairseq: the summed losses of every micro-batch are back-propagated one after the other,
        gradients are reduced over ranks once (after the last), then divided by the global token
        count of them all, so N batches of B tokens give the update one batch of N*B tokens would.
        """
        micro = batch if isinstance(batch, list) else [batch]
        self.model.train()
        lr = inverse_sqrt_lr(self.state.update + 1, self.run.lr, self.run.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        retries = 0
        while True:
            totals, out_of_memory = self._accumulate(micro)
            if not out_of_memory:
                break
            # Some rank ran out of memory: every rank does the update again with each batch in halves (the
            # retry count is the same on every rank, so they give up together too).
            if retries == oom.MAX_SPLITS:
                raise UserError(
                    f"run {self.run.name}: out of memory at update {self.state.update + 1} even with its batches split "
                    f"{retries} times ({oom.describe(micro)}); lower max_tokens (now {self.run.max_tokens}) or the model size"
                )
            halves = [half for b in micro for half in split_batch(b)]
            logger.warning("train: %s ran out of memory at update %d on %s; training it as %d batches",
                           self.run.name, self.state.update + 1, oom.describe(micro), len(halves))
            micro = halves
            retries += 1
        self.last_oom_retries = retries
        self.state.oom_retries += retries
        self.state.oom_in_a_row = self.state.oom_in_a_row + 1 if retries else 0
        if self.state.oom_in_a_row > oom.OOM_IN_A_ROW:
            raise UserError(
                f"run {self.run.name}: {self.state.oom_in_a_row} updates in a row ran out of memory (the last at update "
                f"{self.state.update + 1}: {oom.describe(micro)}); lower max_tokens (now {self.run.max_tokens}), with "
                "update_freq to keep the batch per update"
            )
        ntokens = totals[2]
        self.stop_signalled = totals[3] > 0
        if ntokens > 0:
            self.scaler.unscale_(self.optimizer)
            # Gradients of the sum, divided by the global token count: per-token mean over the global batch.
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], ntokens)
            if self.run.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.run.clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.state.update += 1
        self.state.tokens_seen += int(ntokens)
        return totals[0], totals[1], int(ntokens)

    def _accumulate(self, micro: list[Batch]) -> tuple[list, bool]:
        """Forward and backward every micro-batch, then sum gradients and stats over ranks.

        Returns the global (loss, nll, tokens, stop signal) sums (the first two as 0-d tensors) and whether any
        rank ran out of memory,
        in which case the gradients are meaningless and the caller does the update again in smaller batches.
        """
        self.optimizer.zero_grad(set_to_none=True)
        # Summed on the device: one host sync per update, not one per micro-batch.
        stats = torch.zeros(5, dtype=torch.float64, device=self.device)
        failed = False
        try:
            for b in micro:
                if b.nsentences == 0:
                    continue
                loss_sum, nll_sum = self._forward_sums(b)
                self.scaler.scale(loss_sum).backward()
                stats[0] += loss_sum.detach().double()
                stats[1] += nll_sum.double()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            failed = True
        if failed:  # outside the except block: the error's frames, and the tensors they hold, are gone
            loss_sum = nll_sum = None
            self.optimizer.zero_grad(set_to_none=True)
            free_memory(self.device)
            stats.zero_()
            stats[4] = 1.0
        ntokens = float(sum(b.ntokens for b in micro))
        stopped = float(signals.received() is not None)
        if not self.ctx.enabled:
            # One process: the tokens, a stop signal and a failure are known here, and the loss sums stay on the
            # device until they are logged, so on a GPU the host never waits for the device inside an update.
            return [stats[0], stats[1], ntokens, stopped, float(failed)], failed
        stats[2] = ntokens
        # A stop signal on any rank, summed with the gradients: every rank stops after this same update.
        stats[3] = stopped
        stats = reduce_gradients(self.ctx, self.params, stats)
        flags = stats[2:].tolist()
        return [stats[0], stats[1], *flags], flags[2] > 0

    @torch.no_grad()
    def dev_loss(self) -> tuple[float, float]:
        self.model.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in self._on_device(self.dev_loader):
            if batch.nsentences == 0:
                continue
            loss_sum, nll_sum = self._forward_sums(batch)
            stats[0] += loss_sum.double()
            stats[1] += nll_sum.double()
            stats[2] += float(batch.ntokens)
        stats = all_reduce_sum(self.ctx, stats.cpu())
        ntokens = max(float(stats[2]), 1.0)
        return float(stats[0]) / ntokens, float(stats[1]) / ntokens
