"""Stage-two data: BPE'd sentence pairs, PrLM features read from the cache, padded batches and the loader
that makes them (which pairs form each batch, in what order: train_fused.batch_samplers).

The PrLM never runs here. Each batch's features are read by `CacheReader.features_into` straight into
the padded batch (and `pooled_many` for Dyn[CLS]/Dyn[Aver]) inside DataLoader worker processes: the
batch sampler runs in the main process and hands a whole list of indices (or a window's batches, under
`read_window`) to a worker, whose dataset reads and pads the features for that list in one
`__getitems__` call, while the model trains on earlier batches.
Readers open lazily in whichever process first touches them (never carried across a fork).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from prlmfuse.cache_features.codecs import numpy_view
from prlmfuse.signals import ignore_in_worker, start_multiprocessing_helpers
from prlmfuse.train_fused.batch_samplers import (
    WINDOWS_SHUFFLED_TOGETHER, StorageWindowBatchSampler, TokenBudgetBatchSampler,
)
from prlmfuse.train_fused.bpe import BOS_ID, EOS_ID, PAD_ID
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.train_fused.modeling import PrLMFeatures

if TYPE_CHECKING:
    from prlmfuse.train_fused.buckets import BatchShapes


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
        # ids copied too: a view of a loader worker's shared block (batch_tensors) kept past pinning would hold
        # the whole block in memory beside the pinned copies
        return dataclasses.replace(self._map(torch.Tensor.pin_memory), ids=self.ids.clone())

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """The tensors the model reads on `device`; `ids` stays on the host (bookkeeping only)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def cap_source(ids, max_source_tokens: int | None):
    """A source's BPE ids (no </s>) as the model reads them under a run's `max_source_tokens` N: its first
    N - 1 ids, so that with the </s> appended after them the model reads at most N tokens, the last </s>.
    None: all of them. Training's batches and decoding (evaluate.corpus_decode.encode_sources) both cut here."""
    if max_source_tokens is None or len(ids) < max_source_tokens:
        return ids
    return ids[: max_source_tokens - 1].copy()  # a copy: a numpy view would keep the whole source's memory


class PairDataset(Dataset):
    """Aligned BPE pairs of one split; item i is sentence i of the corpus split and of every cache."""

    def __init__(self, src_ids: list[np.ndarray], tgt_ids: list[np.ndarray], branches: list[PrLMBranch]):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source lines vs {len(tgt_ids)} target lines")
        self.src_ids = src_ids
        self.tgt_ids = tgt_ids
        self.branches = list(branches)  # each over this split's cache
        # None: a batch is padded to its longest sentence. Else (static_shapes) to the shape of its class,
        # rows past its sentences being empty ones that score nothing.
        self.shapes: BatchShapes | None = None
        # +1: </s> on the source, <s> / </s> on the shifted target sides.
        self.src_lens = np.fromiter((len(s) + 1 for s in src_ids), dtype=np.int64, count=len(src_ids))
        self.tgt_lens = np.fromiter((len(t) + 1 for t in tgt_ids), dtype=np.int64, count=len(tgt_ids))

    def __len__(self) -> int:
        return len(self.src_ids)

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int] | list[list[int]]) -> Batch | list[Batch]:
        """The batch of these sentences; or, given a window's batches (a list of lists, from
        StorageWindowBatchSampler), every batch of the window, its features read together."""
        if indices and not np.isscalar(indices[0]):
            return self.padded([[int(i) for i in b] for b in indices])
        return self.padded([[int(i) for i in indices]])[0]

    def padded(self, batches: list[list[int]]) -> list[Batch]:
        """These batches of pairs with their features (every batch's read together, per branch), each padded to
        its longest sentence or under static shapes to its class's shape; all their tensors made together
        (`batch_tensors`)."""
        shapes = []
        for indices in batches:
            if self.shapes is None or not indices:
                shapes.append((len(indices), self._longest(self.src_lens, indices), self._longest(self.tgt_lens, indices),
                               None))
                continue
            longest_prlm = max((int(prlm_lengths(branch, indices).max()) for branch in self.branches), default=0)
            rows, src_len, tgt_len, prlm_len = self.shapes.shape(
                int(self.src_lens[indices].max()), int(self.tgt_lens[indices].max()), longest_prlm)
            if rows < len(indices):
                raise ValueError(f"{len(indices)} pairs for a batch of {rows} rows; batch them with BucketBatchSampler")
            shapes.append((rows, src_len, tgt_len, prlm_len))
        reads = [FeatureRead(branch, batches, lengths=[s[3] for s in shapes], rows=[s[0] for s in shapes])
                 for branch in self.branches]
        specs = [spec for indices, (rows, src_len, tgt_len, _) in zip(batches, shapes)
                 for spec in self._token_specs(len(indices), rows, src_len, tgt_len)]
        tensors = iter(batch_tensors(specs + [spec for read in reads for spec in read.specs()]))
        tokens = [[next(tensors) for _ in range(4)] for _ in batches]
        prlm = [read.fill(tensors) for read in reads]
        return [self._fill(indices, [features[b] for features in prlm], *tokens[b]) for b, indices in enumerate(batches)]

    def batch(self, indices: list[int], prlm: list[PrLMFeatures], *, rows: int | None = None,
              src_len: int | None = None, tgt_len: int | None = None) -> Batch:
        """The token tensors of these sentence pairs, beside their PrLM features; padded to their longest
        sentences, or to `rows` rows and the lengths given."""
        src_len = src_len or self._longest(self.src_lens, indices)
        tgt_len = tgt_len or self._longest(self.tgt_lens, indices)
        rows = len(indices) if rows is None else rows
        tensors = batch_tensors(self._token_specs(len(indices), rows, src_len, tgt_len))
        return self._fill(indices, prlm, *tensors)

    @staticmethod
    def _longest(lengths: np.ndarray, indices: list[int]) -> int:
        return int(lengths[indices].max(initial=1))

    @staticmethod
    def _token_specs(n: int, rows: int, src_len: int, tgt_len: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """ids, src_tokens, tgt_in, tgt_out."""
        return [((n,), torch.long), ((rows, src_len), torch.long), ((rows, tgt_len), torch.long),
                ((rows, tgt_len), torch.long)]

    def _fill(self, indices: list[int], prlm: list[PrLMFeatures], ids: torch.Tensor, src_tokens: torch.Tensor,
              tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> Batch:
        # Filled in numpy: a DataLoader worker's time comes out of the training step's cores, and a
        # torch slice assignment costs microseconds of dispatch per row where numpy's costs nanoseconds.
        source, shifted, scored = src_tokens.numpy(), tgt_in.numpy(), tgt_out.numpy()
        ids.numpy()[:] = indices
        for array in (source, shifted, scored):
            array.fill(PAD_ID)
        ntokens = 0
        for row, i in enumerate(indices):
            src, tgt = self.src_ids[i], self.tgt_ids[i]
            n, m = len(src), len(tgt)
            source[row, :n] = src
            source[row, n] = EOS_ID
            shifted[row, 0] = BOS_ID
            shifted[row, 1 : m + 1] = tgt
            scored[row, :m] = tgt
            scored[row, m] = EOS_ID
            ntokens += m + 1
        return Batch(ids=ids, src_tokens=src_tokens, tgt_in=tgt_in, tgt_out=tgt_out, prlm=prlm, ntokens=ntokens)


def batch_features(branch: PrLMBranch, indices: list[int]) -> PrLMFeatures:
    """One PrLM branch's features for a batch of sentences, padded with a mask (training and evaluation)."""
    return read_batches(branch, [indices])[0]


def prlm_lengths(branch: PrLMBranch, indices: list[int]) -> np.ndarray:
    """Each sentence's PrLM length in the branch's cache (for control "shuffled", another sentence's)."""
    return branch.reader.lengths[indices if branch.rows is None else branch.rows[indices]]


SHARED_ALIGN = 64  # bytes: each tensor of a shared block starts on a cache line (a multiple of every itemsize)


def batch_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised tensors of these (shape, dtype).

    In a DataLoader worker they are views of one block of shared memory (torch's default_collate also
    makes its batches in shared memory): handing a work item to the trainer then copies no bytes and
    passes one file descriptor for all of its tensors, since torch's reductions send one per storage
    pickled and the pickler meets this storage once. A tensor in a worker's own memory is copied into
    shared memory as it is sent, and each one's descriptor costs the trainer a connection to the worker.
    The block lives as long as any of its views.
    """
    if get_worker_info() is None:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    offsets, total = [], 0
    for shape, dtype in specs:
        total = -(-total // SHARED_ALIGN) * SHARED_ALIGN
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    if total == 0:  # an empty storage cannot be mapped
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    block = torch.UntypedStorage._new_shared(total)
    return [torch.empty(0, dtype=dtype).set_(block, offset // dtype.itemsize, shape)
            for (shape, dtype), offset in zip(specs, offsets)]


class FeatureRead:
    """One branch's features for a list of batches: their padded shapes (`specs`), then, given the tensors
    made for them, their values (`fill`).

    Every batch's sentences are read with one `features_into`, straight into the padded tensors, so a window
    of neighbouring stored sentences costs a few large reads and no copy. Stored float16 stays float16 until
    the model casts it (the same values): half the bytes for a worker to hand over.
    """

    def __init__(self, branch: PrLMBranch, batches: list[list[int]], *, lengths: list[int | None] | None = None,
                 rows: list[int | None] | None = None):
        reader = self.reader = branch.reader
        self.branch = branch
        sentences = [i for indices in batches for i in indices]
        self.cache_rows = sentences if branch.rows is None else [int(branch.rows[i]) for i in sentences]
        self.real, self.shapes, first = [], [], 0
        for b, indices in enumerate(batches):
            real = reader.lengths[self.cache_rows[first : first + len(indices)]]
            first += len(indices)
            max_len = (lengths[b] if lengths else None) or int(real.max(initial=1))
            count = (rows[b] if rows else None) or len(indices)
            self.real.append(real)
            self.shapes.append((count, max_len))

    def specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per batch: states, mask and (for Dyn[CLS]/Dyn[Aver]) pooled vectors."""
        n_layers, width = len(self.branch.layer_rows), int(self.reader.hidden_size)
        pooled = self.branch.pooled_rows
        specs = []
        for count, max_len in self.shapes:
            specs += [((count, n_layers, max_len, width), self.reader.transfer_dtype), ((count, max_len), torch.bool)]
            if pooled is not None:
                specs.append(((count, len(pooled), 2, width), torch.float32))
        return specs

    def fill(self, tensors) -> list[PrLMFeatures]:
        """The features, read into the next tensors of `tensors` (an iterator over what `specs` asked for)."""
        padded, destinations = [], []
        for real, (count, max_len) in zip(self.real, self.shapes):
            states, mask = next(tensors), next(tensors)
            pooled = next(tensors) if self.branch.pooled_rows is not None else None
            flags = mask.numpy()
            flags[: len(real)] = np.arange(max_len) < real[:, None]
            flags[len(real):] = False
            # Per-row work in numpy: a torch slice costs microseconds of dispatch, numpy's nanoseconds.
            memory = numpy_view(states)
            memory[len(real):] = 0
            for row, n in enumerate(real.tolist()):
                memory[row, :, n:] = 0  # the padding; the real rows are read in
                destinations.append(memory[row])
            padded.append(PrLMFeatures(states=states, mask=mask, pooled=pooled))
        self.reader.features_into(self.cache_rows, list(self.branch.layer_rows), destinations)
        if self.branch.pooled_rows is not None:
            values = self.reader.pooled_many(self.cache_rows)  # float32 already
            if list(self.branch.pooled_rows) != list(range(values.shape[1])):
                values = values[:, list(self.branch.pooled_rows)]
            first = 0
            for features, real in zip(padded, self.real):
                features.pooled[: len(real)] = values[first : first + len(real)]
                features.pooled[len(real):] = 0
                first += len(real)
        return padded


def read_batches(branch: PrLMBranch, batches: list[list[int]], *, lengths: list[int | None] | None = None,
                 rows: list[int | None] | None = None) -> list[PrLMFeatures]:
    """One branch's features for each batch of sentences, right-padded to the batch's longest sentence (or to
    lengths[b], and to rows[b] rows past the sentences), with the mask of real tokens."""
    read = FeatureRead(branch, batches, lengths=lengths, rows=rows)
    return read.fill(iter(batch_tensors(read.specs())))


class WindowedLoader:
    """Batches, one at a time, from a loader over a StorageWindowBatchSampler, in the sampler's epoch order."""

    def __init__(self, loader: DataLoader, sampler: StorageWindowBatchSampler):
        self.loader = loader
        self.sampler = sampler

    def __iter__(self):
        windows_read = iter(self.loader)  # whole windows, in the order remaining_groups lists them
        for windows, steps in self.sampler.remaining_groups():
            read = {w: next(windows_read) for w in windows}
            for w, j in steps:
                yield read[w][j]
                read[w][j] = None  # trained: its window's memory goes with the window's last batch

    def __len__(self) -> int:
        return len(self.sampler)


def _keep_batch(batch: Batch) -> Batch:
    # __getitems__ already built the whole batch; the default collate would try to re-collate it.
    return batch


def make_loader(
    dataset: PairDataset, batch_sampler: TokenBudgetBatchSampler | StorageWindowBatchSampler, *, num_workers: int,
    prefetch_factor: int | None = None, pin_memory: bool = False,
) -> DataLoader | WindowedLoader:
    """Batches from `dataset` in the sampler's order; workers (forkserver) read and pad the features ahead of the model.

    pin_memory (for a CUDA model): batches arrive page-locked, so their copy to the GPU can be asynchronous.
    prefetch_factor: work items each worker keeps ready (default 4 batches; or 2 windows, a window being many
    batches, and at least enough for the workers to read the next group of windows while one trains).
    """
    windows = isinstance(batch_sampler, StorageWindowBatchSampler)
    if prefetch_factor is None:
        prefetch_factor = max(2, -(-WINDOWS_SHUFFLED_TOGETHER // max(num_workers, 1))) if windows else 4
    # A private generator: creating a loader iterator must not advance the global torch RNG
    # (dropout), or a resumed run would drift from an uninterrupted one.
    generator = torch.Generator().manual_seed(0)
    if num_workers <= 0:
        loader = DataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=_keep_batch, num_workers=0, generator=generator,
            pin_memory=pin_memory,
        )
    else:
        methods = multiprocessing.get_all_start_methods()
        context = "forkserver" if "forkserver" in methods else "spawn"
        start_multiprocessing_helpers(context)
        loader = DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=_keep_batch,
            num_workers=num_workers,
            multiprocessing_context=context,
            persistent_workers=True,
            prefetch_factor=prefetch_factor,
            generator=generator,
            pin_memory=pin_memory,
            # A stop signal sent to the process group is the trainer's: it finishes its update, then ends them.
            worker_init_fn=ignore_in_worker,
        )
    return WindowedLoader(loader, batch_sampler) if windows else loader
