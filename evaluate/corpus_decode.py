"""Decoding a whole corpus: BPE-encode the sources, beam-search them in token-budget batches, detokenize."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from prlmfuse.batching import token_budget_batches
from prlmfuse.evaluate.decode import beam_search
from prlmfuse.evaluate.settings import BATCH_TOKENS, DecodeSettings
from prlmfuse.errors import UserError
from prlmfuse.precision import autocast, free_memory, is_out_of_memory
from prlmfuse.train_fused.bpe import EOS_ID, PAD_ID
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.train_fused.data import batch_features, cap_source

logger = logging.getLogger(__name__)


@dataclass
class DecodeOutput:
    hyps: list[str]
    hyp_tokens: int  # generated subword tokens, without </s>
    seconds: float

    @property
    def sentences_per_s(self) -> float:
        return len(self.hyps) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.hyp_tokens / self.seconds if self.seconds > 0 else float("nan")


def encode_sources(bpe, lines: Sequence[str], max_positions: int, *, max_source_tokens: int | None = None,
                   stats: dict | None = None) -> list[np.ndarray]:
    """BPE ids of each source line, cut as the run's training cut them (its `max_source_tokens`:
    `data.cap_source`), then so that ids + </s> fit the model's positions.

    Over-long lines are cut, not refused; `stats`, if given, receives how many the run's cap cut ("capped")
    and how many were cut beyond it to fit the positions ("truncated").
    """
    limit = max(1, int(max_positions) - 1)
    encoded = bpe.encode_batch(list(lines))
    if max_source_tokens is not None:
        if stats is not None:
            stats["capped"] = sum(1 for ids in encoded if len(ids) >= max_source_tokens)
        encoded = [cap_source(ids, max_source_tokens) for ids in encoded]
    if stats is not None:
        stats.setdefault("capped", 0)
        stats["truncated"] = sum(1 for ids in encoded if len(ids) > limit)
        stats["limit"] = limit
    return [np.asarray(ids[:limit], dtype=np.int64) for ids in encoded]


def note_truncated(stats: dict, what: str) -> None:
    if stats.get("truncated"):
        logger.warning("%s: %d source line(s) longer than %d BPE tokens were cut", what, stats["truncated"], stats["limit"])


def decode_corpus(
    model,
    bpe,
    src_ids: list[np.ndarray],
    branches: list[PrLMBranch],
    settings: DecodeSettings,
    *,
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = False,
    desc: str = "decode",
) -> DecodeOutput:
    """Beam-search every sentence in token-budget batches and return detokenized text in corpus order.

    The clock covers feature reading, padding, search and detokenization: what a user waits for.
    """
    n = len(src_ids)
    lengths = np.fromiter((len(s) + 1 for s in src_ids), dtype=np.int64, count=n)
    # Longest first: the first batch shows the memory peak, later ones only get shorter.
    order = np.argsort(-lengths, kind="stable")
    batches = [b.tolist() for b in token_budget_batches(order, lengths, batch_tokens)]

    hyps: list[str] = [""] * n
    hyp_tokens = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=desc, unit="sent", leave=False)
    start = time.perf_counter()
    device = next(model.parameters()).device
    with torch.inference_mode(), autocast(device, torch.bfloat16 if settings.bf16 else torch.float32):
        pending = list(reversed(batches))  # a stack: a batch split after running out of memory goes next
        while pending:
            batch = pending.pop()
            try:
                out_ids = _decode_batch(model, batch, src_ids, lengths, branches, settings, device)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                out_ids = None
            if out_ids is None:  # outside the except block, so the failed search's tensors are gone
                free_memory(device)
                if len(batch) == 1:
                    raise UserError(f"out of memory decoding one sentence of {int(lengths[batch[0]])} tokens with beam "
                                    f"{settings.beam}; lower --beam or --max-len-a/--max-len-b")
                logger.warning("decode: out of memory on %d sentences of up to %d tokens; decoding them in halves",
                               len(batch), int(lengths[batch[0]]))
                pending += [batch[len(batch) // 2:], batch[: len(batch) // 2]]
                continue
            for i, ids in zip(batch, out_ids):
                ids = [int(t) for t in ids]
                if EOS_ID in ids:
                    ids = ids[: ids.index(EOS_ID)]
                hyp_tokens += len(ids)
                hyps[i] = bpe.decode(ids)
            if bar is not None:
                bar.update(len(batch))
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return DecodeOutput(hyps=hyps, hyp_tokens=hyp_tokens, seconds=seconds)


def _decode_batch(model, batch: list[int], src_ids, lengths: np.ndarray, branches, settings, device: torch.device):
    """Beam search over the sentences `batch` (longest first), their features read as training reads them."""
    width = int(max(lengths[i] for i in batch))
    src_tokens = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    for row, i in enumerate(batch):
        ids = torch.from_numpy(src_ids[i])
        src_tokens[row, : len(ids)] = ids
        src_tokens[row, len(ids)] = EOS_ID
    # Same reading and padding as the trainer's batches.
    prlm = [batch_features(b, batch) for b in branches]
    if device.type == "cuda":
        src_tokens = src_tokens.pin_memory().to(device, non_blocking=True)
        prlm = [_features_to(f, device) for f in prlm]
    return beam_search(
        model,
        src_tokens,
        prlm,
        beam=settings.beam,
        lenpen=settings.lenpen,
        max_len_a=settings.max_len_a,
        max_len_b=settings.max_len_b,
        min_len=settings.min_len,
        no_repeat_ngram_size=settings.no_repeat_ngram_size,
    )


def _features_to(features, device: torch.device):
    """One branch's batch features on the model's device (copied from page-locked memory without blocking)."""
    move = lambda t: None if t is None else t.pin_memory().to(device, non_blocking=True)  # noqa: E731
    return dataclasses.replace(features, states=move(features.states), mask=move(features.mask),
                               pooled=move(features.pooled))
