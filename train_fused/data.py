"""Stage-two data: BPE'd sentence pairs, token-budget batches, PrLM features read from the cache.

The PrLM never runs here. Each batch's features come from `CacheReader.features(i)` (and
`pooled(i)` for Dyn[CLS]/Dyn[Aver]) inside DataLoader worker processes: the batch sampler runs
in the main process and hands a whole list of indices to a worker, whose dataset reads and pads
the features for that list in one `__getitems__` call, while the model trains on earlier batches.
Readers open lazily in whichever process first touches them (never carried across a fork).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from prlmfuse.batching import token_budget_batches
from prlmfuse.train_fused.bpe import BOS_ID, EOS_ID, PAD_ID
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.train_fused.modeling import PrLMFeatures


@dataclass
class Batch:
    """One (local) batch: padded token tensors plus one PrLMFeatures per PrLM branch."""

    ids: torch.Tensor  # [B] sentence indices in the split (= cache indices)
    src_tokens: torch.Tensor  # [B, S] long, source BPE + </s>, right-padded with <pad>
    tgt_in: torch.Tensor  # [B, T] long, <s> + target BPE
    tgt_out: torch.Tensor  # [B, T] long, target BPE + </s>
    prlm: list[PrLMFeatures] = field(default_factory=list)
    ntokens: int = 0  # real target tokens (the loss normaliser)

    @property
    def nsentences(self) -> int:
        return int(self.ids.shape[0])

    def _map(self, fn) -> "Batch":
        prlm = [
            dataclasses.replace(f, states=fn(f.states), mask=fn(f.mask), pooled=None if f.pooled is None else fn(f.pooled))
            for f in self.prlm
        ]
        return Batch(ids=self.ids, src_tokens=fn(self.src_tokens), tgt_in=fn(self.tgt_in), tgt_out=fn(self.tgt_out),
                     prlm=prlm, ntokens=self.ntokens)

    def pin_memory(self) -> "Batch":
        """Page-locked copy (the DataLoader calls this with pin_memory=True), so the GPU copy can run async."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """The tensors the model reads on `device`; `ids` stays on the host (bookkeeping only)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


class PairDataset(Dataset):
    """Aligned BPE pairs of one split; item i is sentence i of the corpus split and of every cache."""

    def __init__(self, src_ids: list[np.ndarray], tgt_ids: list[np.ndarray], branches: list[PrLMBranch]):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source lines vs {len(tgt_ids)} target lines")
        self.src_ids = src_ids
        self.tgt_ids = tgt_ids
        self.branches = list(branches)  # each over this split's cache
        # +1: </s> on the source, <s> / </s> on the shifted target sides.
        self.src_lens = np.fromiter((len(s) + 1 for s in src_ids), dtype=np.int64, count=len(src_ids))
        self.tgt_lens = np.fromiter((len(t) + 1 for t in tgt_ids), dtype=np.int64, count=len(tgt_ids))

    def __len__(self) -> int:
        return len(self.src_ids)

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> Batch:
        indices = [int(i) for i in indices]
        bsz = len(indices)
        src_len = max((int(self.src_lens[i]) for i in indices), default=1)
        tgt_len = max((int(self.tgt_lens[i]) for i in indices), default=1)
        # Filled in numpy: a DataLoader worker's time comes out of the training step's cores, and a
        # torch slice assignment costs microseconds of dispatch per row where numpy's costs nanoseconds.
        src_tokens = np.full((bsz, src_len), PAD_ID, dtype=np.int64)
        tgt_in = np.full((bsz, tgt_len), PAD_ID, dtype=np.int64)
        tgt_out = np.full((bsz, tgt_len), PAD_ID, dtype=np.int64)
        ntokens = 0
        for row, i in enumerate(indices):
            src, tgt = self.src_ids[i], self.tgt_ids[i]
            n, m = len(src), len(tgt)
            src_tokens[row, :n] = src
            src_tokens[row, n] = EOS_ID
            tgt_in[row, 0] = BOS_ID
            tgt_in[row, 1 : m + 1] = tgt
            tgt_out[row, :m] = tgt
            tgt_out[row, m] = EOS_ID
            ntokens += m + 1
        prlm = [batch_features(branch, indices) for branch in self.branches]
        return Batch(
            ids=torch.tensor(indices, dtype=torch.long),
            src_tokens=torch.from_numpy(src_tokens),
            tgt_in=torch.from_numpy(tgt_in),
            tgt_out=torch.from_numpy(tgt_out),
            prlm=prlm,
            ntokens=ntokens,
        )


def batch_features(branch: PrLMBranch, indices: list[int]) -> PrLMFeatures:
    """One PrLM branch's features for a batch of sentences, padded with a mask (training and evaluation)."""
    reader = branch.reader
    rows = list(branch.layer_rows)
    # Stored float16 stays float16 until the model casts it (the same values): half the bytes
    # for the worker to copy and hand over, and less work beside the training step's threads.
    per_sentence = [reader.features(i, rows, widen=False) for i in indices]  # [len(rows), T_i, d] each
    width = int(reader.hidden_size)
    max_len = max((f.shape[1] for f in per_sentence), default=1)
    states = torch.zeros(len(indices), len(rows), max_len, width, dtype=reader.transfer_dtype)
    mask = torch.zeros(len(indices), max_len, dtype=torch.bool)
    for b, f in enumerate(per_sentence):
        n = f.shape[1]
        states[b, :, :n] = f
        mask[b, :n] = True
    pooled = None
    if branch.pooled_rows is not None:
        # reader.pooled(i) is float32 already
        pooled = torch.stack([reader.pooled(i) for i in indices]) if indices else torch.zeros(
            0, len(reader.pooled_layers), 2, width
        )
        if list(branch.pooled_rows) != list(range(pooled.shape[1])):
            pooled = pooled[:, list(branch.pooled_rows)]
    return PrLMFeatures(states=states, mask=mask, pooled=pooled)


class TokenBudgetBatchSampler:
    """Length-bucketed batches under a padded token budget; a seeded new batch order every epoch.

    Batches are formed once (sentences sorted by length, so each batch pads little), then
    shuffled per epoch with `seed + epoch`: the same epoch always yields the same order, which
    is what lets a resumed run continue at `start` inside it. Under DDP every rank builds the
    same global batches and keeps its own contiguous slice of each.
    """

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        max_tokens: int,
        *,
        indices: np.ndarray | None = None,
        shuffle: bool = True,
        seed: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.max_tokens = int(max_tokens)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0
        self.batches = self.build_batches(src_lens, tgt_lens, max_tokens, indices=indices, seed=seed)

    @staticmethod
    def build_batches(
        src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, *, indices: np.ndarray | None = None, seed: int = 1,
    ) -> list[list[int]]:
        """Batches of pair indices, each within the padded budget, from the pairs sorted by length.

        The order is fairseq's (LanguagePairDataset.ordered_indices): a stable sort by target
        length, then by source length, so a batch is a run of nearly equal source lengths. Source
        length is the primary key because the encoder, where every PrLM branch runs, pays for
        source padding (`bench/batch_padding.py` counts both sides' padding).
        """
        if indices is None:
            indices = np.arange(len(src_lens))
        sizes = np.maximum(src_lens, tgt_lens)
        # Random tie-breaking, then target length, then (stably) source length.
        ranked = np.random.RandomState(seed).permutation(indices)
        ranked = ranked[np.argsort(tgt_lens[ranked], kind="stable")]
        ranked = ranked[np.argsort(src_lens[ranked], kind="stable")]
        return [b.tolist() for b in token_budget_batches(ranked, sizes, max_tokens)]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Epoch (0-based) whose order to yield next, skipping its first `start` batches."""
        self.epoch = int(epoch)
        self.start = int(start)

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.batches)))
        rng = np.random.RandomState((self.seed * 1_000_003 + epoch) % 2**32)
        return rng.permutation(len(self.batches)).tolist()

    def local_slice(self, batch: list[int]) -> list[int]:
        n = len(batch)
        lo = self.rank * n // self.world_size
        hi = (self.rank + 1) * n // self.world_size
        return batch[lo:hi]

    def __iter__(self):
        for b in self.epoch_order(self.epoch)[self.start :]:
            yield self.local_slice(self.batches[b])

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.start)


def _keep_batch(batch: Batch) -> Batch:
    # __getitems__ already built the whole batch; the default collate would try to re-collate it.
    return batch


def make_loader(
    dataset: PairDataset, batch_sampler: TokenBudgetBatchSampler, *, num_workers: int, prefetch_factor: int = 4,
    pin_memory: bool = False,
) -> DataLoader:
    """DataLoader over whole batches; workers (forkserver) read and pad the features ahead of the model.

    pin_memory (for a CUDA model): batches arrive page-locked, so their copy to the GPU can be asynchronous.
    """
    # A private generator: creating a loader iterator must not advance the global torch RNG
    # (dropout), or a resumed run would drift from an uninterrupted one.
    generator = torch.Generator().manual_seed(0)
    if num_workers <= 0:
        return DataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=_keep_batch, num_workers=0, generator=generator,
            pin_memory=pin_memory,
        )
    methods = multiprocessing.get_all_start_methods()
    context = "forkserver" if "forkserver" in methods else "spawn"
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=_keep_batch,
        num_workers=num_workers,
        multiprocessing_context=context,
        persistent_workers=True,
        prefetch_factor=prefetch_factor,
        generator=generator,
        pin_memory=pin_memory,
    )
