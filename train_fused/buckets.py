"""Batches of a few fixed shapes (`static_shapes: true`), so that a compiled step is captured once per shape.

A CUDA graph replays one shape; token-budget batches padded to their own longest sentence take a new
shape almost every batch. Here a batch takes the shape of one of a few classes. Class k is a source
length L_k from a ladder (multiples of 8 up to 64, then STEPS_PER_OCTAVE steps an octave: 80, 96, 112,
128, 160, ...), a target length and a PrLM feature length in fixed ratios to it (rounded up to
multiples of 8), and as many rows as the token budget allows at the longer of source and target (a
multiple of the world size). A pair belongs to the least class that holds all three of its lengths.
The two ratios are fitted once to the training split, to the pair that computes the fewest positions
(source, target and features together); a sentence longer than any seen still has a class.

Batches are cut from each class's pairs in a seeded order, and the pairs that do not fill a last
batch of their class join the next class up, so only the largest class ends in a batch that empty
rows fill up. A batch takes the shape of the largest class among its pairs (always one whose rows
hold them), a function of its pairs' lengths alone, so a DataLoader worker pads it without being
told; under DDP each rank pads its own slice so.

Sampling keeps TokenBudgetBatchSampler's contract: every usable pair once an epoch, batches formed
once, a seeded order each epoch, a resume at batch `start`, one slice of each global batch per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler

# Lengths up to 64 round to multiples of 8 (tensor cores work in such tiles); above it, an octave
# holds this many steps, so a class is at most 1/STEPS_PER_OCTAVE longer than the one below it.
GRANULE = 8
STEPS_PER_OCTAVE = 4
# The target and feature ratios tried when fitting: 1/8 to 8 in steps of 2^(1/4) (a summary's target is
# short beside its source, a translation's near it; a PrLM's subwords near the model's BPE).
RATIOS = tuple(2.0 ** (i / 4) for i in range(-12, 13))
# Pairs the ratios are fitted to: a sample this large gives a corpus's length mix, and fitting costs a second.
FIT_PAIRS = 20_000


def bucket_length(n: int, steps_per_octave: int = STEPS_PER_OCTAVE) -> int:
    """`n` rounded up to the ladder: 8, 16, ..., 64, then `steps_per_octave` steps an octave (80, 96, 112, 128, 160, ...)."""
    n = max(int(n), 1)
    step = max(GRANULE, (1 << (n - 1).bit_length()) // (2 * steps_per_octave))
    return -(-n // step) * step


def _round8(x: np.ndarray) -> np.ndarray:
    return np.maximum(GRANULE, -(-np.ceil(x).astype(np.int64) // GRANULE) * GRANULE)


@dataclass(frozen=True)
class BatchShapes:
    """The classes of static_shapes: class k has source length ladder[k], target and PrLM lengths in fixed
    ratios to it, and a fixed number of rows."""

    max_tokens: int
    world_size: int = 1
    target_ratio: float = 1.0
    prlm_ratio: float = 1.0
    steps_per_octave: int = STEPS_PER_OCTAVE

    @classmethod
    def fit(cls, src_lens: np.ndarray, tgt_lens: np.ndarray, prlm_lens: np.ndarray | None, max_tokens: int,
            world_size: int = 1, steps_per_octave: int = STEPS_PER_OCTAVE) -> "BatchShapes":
        """The classes whose ratios compute the fewest positions over these pairs (ties: the first tried), fitted
        to at most FIT_PAIRS of them (a seeded sample: the same classes on every rank and after a resume)."""
        if len(src_lens) > FIT_PAIRS:
            sample = np.sort(np.random.RandomState(0).choice(len(src_lens), FIT_PAIRS, replace=False))
            src_lens, tgt_lens = np.asarray(src_lens)[sample], np.asarray(tgt_lens)[sample]
            prlm_lens = None if prlm_lens is None else np.asarray(prlm_lens)[sample]
        best = None
        for target_ratio in RATIOS:
            for prlm_ratio in RATIOS if prlm_lens is not None else (1.0,):
                shapes = cls(max_tokens, world_size, target_ratio, prlm_ratio, steps_per_octave)
                cost = shapes.positions(src_lens, tgt_lens, prlm_lens)
                if best is None or cost < best[0]:
                    best = (cost, shapes)
        return best[1]

    def ladder(self, longest: int) -> np.ndarray:
        """The classes' source lengths, up to one that holds `longest` whatever the ratios."""
        top = max(int(longest), 1) * max(1.0, 1 / self.target_ratio, 1 / self.prlm_ratio) + GRANULE
        values, n = [], 1
        while not values or values[-1] < top:
            values.append(bucket_length(n, self.steps_per_octave))
            n = values[-1] + 1
        return np.array(values, dtype=np.int64)

    def _table(self, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        source = self.ladder(longest)
        target = _round8(source * self.target_ratio)
        prlm = _round8(source * self.prlm_ratio)
        fit = np.maximum(1, self.max_tokens // np.maximum(source, target))
        rows = np.maximum(self.world_size, fit - fit % self.world_size)
        return source, target, prlm, rows

    def classes(self, src_lens, tgt_lens, prlm_lens=None) -> np.ndarray:
        """Each pair's class: the least that holds its source, target and PrLM lengths."""
        return self._classes_and_table(src_lens, tgt_lens, prlm_lens)[0]

    def _classes_and_table(self, src_lens, tgt_lens, prlm_lens=None):
        """Each pair's class, and the table (source, target, PrLM lengths, rows) of the classes up to the largest."""
        src_lens, tgt_lens = np.asarray(src_lens), np.asarray(tgt_lens)
        longest = max(int(src_lens.max(initial=1)), int(tgt_lens.max(initial=1)),
                      int(np.max(prlm_lens, initial=1)) if prlm_lens is not None else 1)
        table = source, target, prlm, _ = self._table(longest)
        k = np.maximum(np.searchsorted(source, src_lens), np.searchsorted(target, tgt_lens))
        if prlm_lens is not None:
            k = np.maximum(k, np.searchsorted(prlm, np.asarray(prlm_lens)))
        return k, table

    def shape(self, src_len: int, tgt_len: int, prlm_len: int = 0) -> tuple[int, int, int, int]:
        """(rows per rank, source, target, PrLM length) of a batch whose longest lengths are these."""
        k, (source, target, prlm, rows) = self._classes_and_table([src_len], [tgt_len], [prlm_len])
        k = int(k[0])
        return int(rows[k]) // self.world_size, int(source[k]), int(target[k]), int(prlm[k])

    def batches(self, src_lens, tgt_lens, prlm_lens, order: np.ndarray) -> list[list[int]]:
        """Global batches of the pairs `order` lists (in the order taken within a class): per class, runs of
        its rows; what does not fill a last batch joins the next class up."""
        order = np.asarray(order, dtype=np.int64)
        if len(order) == 0:
            return []
        k, (_, _, _, rows) = self._classes_and_table(src_lens[order], tgt_lens[order],
                                                     None if prlm_lens is None else prlm_lens[order])
        by_class = order[np.argsort(k, kind="stable")]
        starts = np.searchsorted(np.sort(k), np.arange(len(rows) + 1))
        batches, carried = [], []
        for c in range(len(rows)):
            members = carried + by_class[starts[c] : starts[c + 1]].tolist()
            full = len(members) // int(rows[c]) * int(rows[c])
            batches += [members[i : i + int(rows[c])] for i in range(0, full, int(rows[c]))]
            carried = members[full:]
        if carried:
            batches.append(carried)
        return batches

    def positions(self, src_lens, tgt_lens, prlm_lens=None) -> int:
        """The positions the batches of these pairs compute (source, target and PrLM features, padding included),
        in whatever order each class's pairs are taken: what `fit` minimises."""
        k, (source, target, prlm, rows) = self._classes_and_table(src_lens, tgt_lens, prlm_lens)
        cost = rows * (source + target + (prlm if prlm_lens is not None else 0))  # a batch of the class's shape
        counts = np.bincount(k, minlength=len(rows))
        total, carried = 0, np.zeros(0, dtype=np.int64)  # the classes of the pairs carried up, in their order
        for c in range(len(rows)):
            r, n = int(rows[c]), int(counts[c])
            full = (len(carried) + n) // r
            # the batches holding carried pairs take the shape of their largest class (c once a native is in)
            mixed = min(full, -(-len(carried) // r))
            for j in range(mixed):
                piece = carried[j * r : (j + 1) * r]
                total += int(cost[c if len(piece) < r else piece.max()])
            total += (full - mixed) * int(cost[c])
            cut = full * r
            carried = np.concatenate([carried[cut:], np.full(n - max(0, cut - len(carried)), c, dtype=np.int64)])
        if len(carried):
            total += int(cost[carried.max()])
        return total


class BucketBatchSampler(TokenBudgetBatchSampler):
    """TokenBudgetBatchSampler's sampling over the batches of `BatchShapes`' classes."""

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        shapes: BatchShapes,
        *,
        prlm_lens: np.ndarray | None = None,
        indices: np.ndarray | None = None,
        shuffle: bool = True,
        seed: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ):
        if shapes.world_size != world_size:
            raise ValueError(f"shapes made for {shapes.world_size} ranks, sampler for {world_size}")
        self.shapes = shapes
        self.prlm_lens = prlm_lens
        super().__init__(src_lens, tgt_lens, shapes.max_tokens, indices=indices, shuffle=shuffle, seed=seed,
                         rank=rank, world_size=world_size)

    def build_batches(self, src_lens, tgt_lens, max_tokens, *, indices=None, seed=1) -> list[list[int]]:
        if indices is None:
            indices = np.arange(len(src_lens))
        order = np.random.RandomState(seed).permutation(np.asarray(indices, dtype=np.int64))
        return self.shapes.batches(src_lens, tgt_lens, self.prlm_lens, order)


def prlm_lengths(dataset) -> np.ndarray | None:
    """Each pair's longest PrLM feature length over the dataset's branches (None for a baseline)."""
    lengths = None
    for branch in dataset.branches:
        own = branch.reader.lengths
        if branch.rows is not None:  # control "shuffled": the features of another sentence
            own = own[np.asarray(branch.rows)]
        own = own[: len(dataset)]
        lengths = own if lengths is None else np.maximum(lengths, own)
    return lengths


__all__ = ["BatchShapes", "BucketBatchSampler", "bucket_length", "prlm_lengths"]
