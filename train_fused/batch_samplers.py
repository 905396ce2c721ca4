"""Which pairs form each training batch and in what order an epoch yields them: token-budget batches of
length-sorted pairs, or batches formed within windows of a cache's stored order (read a window at once)."""

from __future__ import annotations

import numpy as np

from prlmfuse.batching import token_budget_batches


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
        self.num_pairs = sum(len(b) for b in self.batches)

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


# Windows whose batches are shuffled together: consecutive updates then mix this many stretches of
# the stored (length-sorted) order, at the memory of this many windows' features in the trainer.
WINDOWS_SHUFFLED_TOGETHER = 4


class StorageWindowBatchSampler:
    """Batches formed within windows of sentences neighbouring in a cache's stored order; a worker reads a window at once.

    For a cache larger than memory: one window (about `window` batches' worth of tokens of
    neighbouring stored sentences) is read in a few large reads instead of one small random read per
    sentence. Within a window, pairs are sorted by the length the budget counts (the longer side), then
    target, then source length (the stored order already keeps their PrLM lengths together), and cut
    into batches under the token budget (`bench/batch_padding.py --storage-windows` counts the padding).
    Windows and batches are formed once; every epoch (seed + epoch) shuffles the window order, and the
    batches of each WINDOWS_SHUFFLED_TOGETHER consecutive windows are shuffled together. The loader
    yields whole windows (lists of batches); `WindowedLoader` hands them on one batch at a time in
    that order, from batch `start` of the epoch after a resume.
    Under DDP each window is split into one stretch per rank, each batched under max_tokens / world_size,
    and every rank's stretch is cut into the same number of batches, so ranks step together and
    each reads only its own neighbouring sentences.
    """

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        max_tokens: int,
        stored_order: np.ndarray,
        *,
        window: int,
        indices: np.ndarray | None = None,
        seed: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1 batches, got {window}")
        self.seed = int(seed)
        self.epoch = 0
        self.start = 0
        wanted = np.zeros(len(src_lens), dtype=bool)
        wanted[np.arange(len(src_lens)) if indices is None else indices] = True
        order = np.asarray(stored_order, dtype=np.int64)
        order = order[order < len(src_lens)]  # the cache covers the whole split; max_train_pairs keeps its first lines
        order = order[wanted[order]]
        sizes = np.maximum(src_lens, tgt_lens)
        window_of = np.cumsum(sizes[order]) // (int(window) * int(max_tokens))
        budget = max(1, int(max_tokens) // world_size)
        ties = np.random.RandomState(self.seed)
        # window -> this rank's batches; every rank holds the same number of batches per window
        self.windows: list[list[list[int]]] = []
        self.num_pairs = len(order)
        for members in np.split(order, np.flatnonzero(np.diff(window_of)) + 1):
            parts = np.array_split(members, np.searchsorted(
                np.cumsum(sizes[members]), np.arange(1, world_size) * sizes[members].sum() / world_size, side="right"))
            per_rank = []
            for part in parts:
                ranked = ties.permutation(part)
                ranked = ranked[np.lexsort((src_lens[ranked], tgt_lens[ranked], sizes[ranked]))]
                per_rank.append([b.tolist() for b in token_budget_batches(ranked, sizes, budget)] if len(part) else [])
            count = max(len(b) for b in per_rank)
            self.windows.append(_split_to(per_rank[rank], count))
        # this rank's batches (TokenBudgetBatchSampler's are global), in formation order
        self.batches = [b for w in self.windows for b in w]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Epoch (0-based) whose order to yield next, skipping its first `start` batches."""
        self.epoch = int(epoch)
        self.start = int(start)

    def groups(self, epoch: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """The epoch's order: (windows, their batches as (window, batch in window) in the order trained)."""
        rng = np.random.RandomState((self.seed * 1_000_003 + epoch) % 2**32)
        window_order = rng.permutation(len(self.windows)).tolist()
        out = []
        for g in range(0, len(window_order), WINDOWS_SHUFFLED_TOGETHER):
            windows = window_order[g : g + WINDOWS_SHUFFLED_TOGETHER]
            steps = [(w, j) for w in windows for j in range(len(self.windows[w]))]
            out.append((windows, [steps[k] for k in rng.permutation(len(steps)).tolist()]))
        return out

    def remaining_groups(self):
        """(windows, steps) of this epoch from batch `start` on: groups already trained are left out and
        the first one left is cut to the steps not yet trained, and to the windows those steps read."""
        skip = self.start
        for windows, steps in self.groups(self.epoch):
            if skip >= len(steps):
                skip -= len(steps)
                continue
            if skip:
                steps = steps[skip:]
                windows = [w for w in windows if any(step_window == w for step_window, _ in steps)]
            yield windows, steps
            skip = 0

    def __iter__(self):
        # The loader's work items: each window a group still trains from, whole.
        for windows, _steps in self.remaining_groups():
            for w in windows:
                yield self.windows[w]

    def __len__(self) -> int:
        # batches left in the epoch (what WindowedLoader yields), not the windows __iter__ hands the workers
        return max(0, len(self.batches) - self.start)


def _split_to(batches: list[list[int]], count: int) -> list[list[int]]:
    """`batches` cut into exactly `count` (halving the largest while it has two or more pairs; then empty ones)."""
    batches = list(batches)
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda k: len(batches[k]), default=None)
        if largest is None or len(batches[largest]) < 2:
            batches += [[] for _ in range(count - len(batches))]
            break
        b = batches[largest]
        batches[largest : largest + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return batches
