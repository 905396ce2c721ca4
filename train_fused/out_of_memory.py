"""One batch that does not fit in memory: free it, say which, and train on it in halves (as fairseq
frees and goes on). The trainer's rule: an update whose micro-batches run out of memory on any rank is
done again by every rank with each micro-batch split in two (then in four, ...), the same update and
the same gradient; more than OOM_IN_A_ROW such updates in a row, or an update still out of memory after
MAX_SPLITS halvings, stop the run with one line naming max_tokens. The counts live in the trainer state, so
a resumed run goes on counting where the stopped one was.
"""

from __future__ import annotations

import dataclasses

from prlmfuse.train_fused.bpe import PAD_ID
from prlmfuse.train_fused.data import Batch

# Updates in a row that may need a split before the run stops: one long batch is bad luck, a run of
# them means max_tokens does not fit this device.
OOM_IN_A_ROW = 8
# Times one update's batches may be halved (64 pieces) before the run stops.
MAX_SPLITS = 6


def split_batch(batch: Batch) -> list[Batch]:
    """The batch's sentences in two halves, each trimmed to its own longest sentence; a single sentence stays whole."""
    n = batch.nsentences
    if n < 2:
        return [batch]
    halves = []
    for rows in (slice(0, n // 2), slice(n // 2, n)):
        src, tgt_in, tgt_out = batch.src_tokens[rows], batch.tgt_in[rows], batch.tgt_out[rows]
        src_len = int((src != PAD_ID).sum(1).max())
        tgt_len = int(((tgt_in != PAD_ID) | (tgt_out != PAD_ID)).sum(1).max())
        prlm = []
        for f in batch.prlm:
            mask = f.mask[rows]
            m = max(int(mask.sum(1).max()), 1)
            prlm.append(dataclasses.replace(f, states=f.states[rows, :, :m], mask=mask[:, :m],
                                            pooled=None if f.pooled is None else f.pooled[rows]))
        tgt_out = tgt_out[:, :tgt_len]
        halves.append(Batch(ids=batch.ids[rows], src_tokens=src[:, :src_len], tgt_in=tgt_in[:, :tgt_len],
                            tgt_out=tgt_out, prlm=prlm, ntokens=int((tgt_out != PAD_ID).sum())))
    return halves


def describe(micro: list[Batch]) -> str:
    """Shape and token counts of an update's batches, for the log line and the error."""
    parts = [f"{b.nsentences} sentences, {int((b.src_tokens != PAD_ID).sum())} source and {b.ntokens} target tokens "
             f"(padded {tuple(b.src_tokens.shape)} / {tuple(b.tgt_in.shape)})" for b in micro]
    return "; ".join(parts)
