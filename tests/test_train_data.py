"""Stage-two data: token-budget batches, epoch order, DDP slices, the LR schedule, features from a real cache."""

from __future__ import annotations

import math
from pathlib import Path
import os

import numpy as np
import pytest
import torch

from prlmfuse.cache_features import CacheReader
from prlmfuse.train_fused.batch_samplers import (
    WINDOWS_SHUFFLED_TOGETHER, StorageWindowBatchSampler, TokenBudgetBatchSampler,
)
from prlmfuse.train_fused.bpe import BOS_ID, EOS_ID, PAD_ID
from prlmfuse.train_fused.data import PairDataset, make_loader
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.train_fused.update_step import inverse_sqrt_lr

from helpers import small_runs

torch.set_num_threads(1)


def _lengths(n: int = 500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return rng.randint(2, 60, size=n), rng.randint(2, 80, size=n)


def test_batches_respect_budget_and_cover_each_pair_once():
    src, tgt = _lengths()
    sampler = TokenBudgetBatchSampler(src, tgt, 400, seed=1)
    seen = [i for b in sampler.batches for i in b]
    assert sorted(seen) == list(range(len(src)))
    for b in sampler.batches:
        assert len(b) * max(max(src[i], tgt[i]) for i in b) <= 400
    # Length bucketing, source length first (fairseq's order): little source padding, and every
    # batch is a run of the sorted source lengths.
    padded = sum(len(b) * max(src[i] for i in b) for b in sampler.batches)
    assert padded < 1.1 * src.sum()
    runs = sorted((min(src[i] for i in b), max(src[i] for i in b)) for b in sampler.batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(runs, runs[1:]))


def test_oversized_pair_gets_a_batch_of_its_own():
    sampler = TokenBudgetBatchSampler(np.array([5, 500, 6]), np.array([5, 3, 6]), 100)
    assert [500] in [[int(np.array([5, 500, 6])[i]) for i in b] for b in sampler.batches]


def test_epoch_order_is_seeded_and_resumable():
    src, tgt = _lengths()
    a = TokenBudgetBatchSampler(src, tgt, 400, seed=1)
    b = TokenBudgetBatchSampler(src, tgt, 400, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    full = list(a)
    assert full == list(b)
    a.set_epoch(4)
    assert list(a) != full  # a new order every epoch
    b.set_epoch(3, start=5)
    assert list(b) == full[5:] and len(b) == len(full) - 5


def test_ddp_slices_are_disjoint_and_cover_the_global_batch():
    src, tgt = _lengths()
    single = TokenBudgetBatchSampler(src, tgt, 400, seed=2)
    ranks = [TokenBudgetBatchSampler(src, tgt, 400, seed=2, rank=r, world_size=2) for r in range(2)]
    for s in [single, *ranks]:
        s.set_epoch(1)
    for whole, r0, r1 in zip(single, *ranks):
        assert not set(r0) & set(r1)
        assert sorted(r0 + r1) == sorted(whole)


def test_dev_order_is_unshuffled_and_indices_filter():
    src, tgt = _lengths(50)
    sampler = TokenBudgetBatchSampler(src, tgt, 200, indices=np.arange(0, 50, 2), shuffle=False)
    sampler.set_epoch(7)
    assert list(sampler) == sampler.batches
    assert sorted(i for b in sampler.batches for i in b) == list(range(0, 50, 2))


def _stored(n: int, seed: int = 3) -> np.ndarray:
    return np.random.RandomState(seed).permutation(n)  # a cache's stored order: any permutation of the sentences


def test_storage_windows_cover_each_pair_once_within_budget_from_neighbouring_stored_sentences():
    src, tgt = _lengths()
    stored = _stored(len(src))
    usable = np.flatnonzero(src != 7)  # as the trainer leaves out pairs too long to embed
    sampler = StorageWindowBatchSampler(src, tgt, 400, stored, window=4, indices=usable, seed=1)
    assert sorted(i for b in sampler.batches for i in b) == usable.tolist() and sampler.num_pairs == len(usable)
    for b in sampler.batches:
        assert len(b) * max(max(src[i], tgt[i]) for i in b) <= 400
    # Each window is one stretch of the stored order (usable pairs only), the windows in stored order.
    position = np.argsort(stored)
    kept = stored[np.isin(stored, usable)]
    spans = [sorted(position[i] for b in w for i in b) for w in sampler.windows]
    assert [p for span in spans for p in span] == sorted(position[kept])
    sizes = np.maximum(src, tgt)
    assert len(sampler.windows) == int(sizes[kept].sum() // 1600) + 1
    # Within a window, batches run up the longer side's lengths (the sort key there).
    for w in sampler.windows:
        runs = [(min(sizes[i] for i in b), max(sizes[i] for i in b)) for b in w]
        assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(runs, runs[1:]))


def test_storage_windows_over_a_cache_of_more_sentences_than_the_pairs_trained():
    """max_train_pairs trains on the split's first lines while the cache stores the whole split."""
    src, tgt = _lengths()
    sampler = StorageWindowBatchSampler(src[:300], tgt[:300], 400, _stored(len(src)), window=3, seed=1)
    assert sorted(i for b in sampler.batches for i in b) == list(range(300))


def test_storage_window_epochs_are_seeded_resumable_and_read_whole_windows():
    src, tgt = _lengths()
    stored = _stored(len(src))
    a = StorageWindowBatchSampler(src, tgt, 400, stored, window=3, seed=1)
    b = StorageWindowBatchSampler(src, tgt, 400, stored, window=3, seed=1)
    assert len(a.windows) > 2 * WINDOWS_SHUFFLED_TOGETHER

    def epoch(sampler, number, start=0):
        sampler.set_epoch(number, start)
        items = list(sampler)  # what the loader's workers are asked to read: whole windows
        assert all(any(w is window for window in sampler.windows) for w in items)
        order = [sampler.windows[w][j] for _windows, steps in sampler.remaining_groups() for w, j in steps]
        return order, items

    full, items = epoch(a, 3)
    assert sorted(i for batch in full for i in batch) == list(range(len(src)))  # each pair once an epoch
    assert len(items) == len(a.windows) and len(full) == len(a.batches) == len(a)
    assert epoch(b, 3)[0] == full
    assert epoch(a, 4)[0] != full  # a new order every epoch
    # Consecutive batches mix several windows.
    first = {next(k for k, w in enumerate(a.windows) if batch in w) for batch in full[:8]}
    assert len(first) > 1
    # Resumed at batch k: the rest of the same epoch, and no window whose batches were all trained is read.
    for k in range(1, len(full)):
        rest, items_left = epoch(b, 3, start=k)
        assert rest == full[k:] and len(b) == len(full) - k
        # exactly the windows the rest of the epoch trains from
        assert sorted(map(id, items_left)) == sorted({id(w) for w in b.windows if any(batch in w for batch in rest)})
    assert epoch(b, 3, start=len(full))[0] == []


def test_storage_windows_split_over_ranks_step_together_and_cover_every_pair_once():
    src, tgt = _lengths()
    stored = _stored(len(src))
    ranks = [StorageWindowBatchSampler(src, tgt, 400, stored, window=4, seed=2, rank=r, world_size=3) for r in range(3)]
    assert len({len(r.windows) for r in ranks}) == 1
    for windows in zip(*(r.windows for r in ranks)):
        assert len({len(w) for w in windows}) == 1  # the same number of batches on every rank
    assert sorted(i for r in ranks for b in r.batches for i in b) == list(range(len(src)))
    for r in ranks:
        for b in r.batches:
            assert not b or len(b) * max(max(src[i], tgt[i]) for i in b) <= 400 // 3
    # Every rank reads its own stretch of each window.
    position = np.argsort(stored)
    for windows in zip(*(r.windows for r in ranks)):
        spans = [sorted(position[i] for b in w for i in b) for w in windows]
        for span, following in zip(spans, spans[1:]):
            assert span == list(range(span[0], span[-1] + 1)) and (not following or span[-1] < following[0])
    for r in ranks:
        r.set_epoch(5, start=2)
    orders = [[(w, j) for _windows, steps in r.remaining_groups() for w, j in steps] for r in ranks]
    assert orders[0] == orders[1] == orders[2]


def test_inverse_sqrt_schedule_matches_fairseq():
    lr, warmup = 7e-4, 4000
    assert inverse_sqrt_lr(1, lr, warmup) == pytest.approx(lr / warmup)
    assert inverse_sqrt_lr(2000, lr, warmup) == pytest.approx(lr / 2)
    assert inverse_sqrt_lr(4000, lr, warmup) == pytest.approx(lr)
    assert inverse_sqrt_lr(16000, lr, warmup) == pytest.approx(lr / 2)
    assert inverse_sqrt_lr(9000, lr, warmup) == pytest.approx(lr * math.sqrt(4000 / 9000))
    values = [inverse_sqrt_lr(u, lr, warmup) for u in range(1, 8001)]
    assert max(values) == pytest.approx(lr) and values.index(max(values)) == warmup - 1


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    corpus = small_runs.small_bible(root, train=40, dev=8, test=8)
    ckpt = small_runs.tiny_prlm(root / "bert")
    paths = small_runs.build_caches(ckpt, corpus, root / "cache", layers="1,-1")
    return corpus, paths


def _pairs(n: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    src = [rng.randint(4, 50, size=rng.randint(0, 9)).astype(np.int32) for _ in range(n)]
    tgt = [rng.randint(4, 50, size=rng.randint(0, 9)).astype(np.int32) for _ in range(n)]
    return src, tgt


@pytest.mark.parametrize("vocab, dtype, smoothing", [(50, torch.float32, 0.1), (8000, torch.bfloat16, 0.1),
                                                    (8000, torch.float32, 0.3), (50, torch.float32, 0.0)])
def test_loss_sums_are_torch_cross_entropy_over_real_tokens(vocab, dtype, smoothing):
    from prlmfuse.train_fused.update_step import label_smoothed_sums

    g = torch.Generator().manual_seed(3)
    # bf16 logits of a training-sized vocabulary, as autocast hands them over; the logged NLL is
    # derived from the smoothed loss and must equal a separate plain cross entropy.
    logits = (torch.randn(4, 7, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(4, vocab, (4, 7), generator=g)
    target[1, 4:] = PAD_ID
    target[3, 2:] = PAD_ID
    loss, nll = label_smoothed_sums(logits, target, smoothing)
    real = target != PAD_ID
    exact = logits.float()[real]
    expected_loss = torch.nn.CrossEntropyLoss(label_smoothing=smoothing, reduction="sum")(exact, target[real])
    expected_nll = torch.nn.CrossEntropyLoss(reduction="sum")(exact, target[real])
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(nll, expected_nll)


def test_collate_pads_tokens_and_features_from_the_cache(cache):
    corpus, paths = cache
    reader = CacheReader(paths["train"])
    assert reader.layers == [1, 3]
    src, tgt = _pairs(40)
    # Row 1 of the cached layers = hidden_states index 3 (the last of 3 layers).
    dataset = PairDataset(src, tgt, [PrLMBranch(reader, layer_rows=(1,), pooled_rows=(0, 1))])
    indices = [5, 0, 17]
    batch = dataset.__getitems__(indices)
    assert batch.ids.tolist() == indices
    for row, i in enumerate(indices):
        n, m = len(src[i]), len(tgt[i])
        assert batch.src_tokens[row, :n].tolist() == src[i].tolist() and batch.src_tokens[row, n] == EOS_ID
        assert (batch.src_tokens[row, n + 1 :] == PAD_ID).all()
        assert batch.tgt_in[row, 0] == BOS_ID and batch.tgt_in[row, 1 : m + 1].tolist() == tgt[i].tolist()
        assert batch.tgt_out[row, :m].tolist() == tgt[i].tolist() and batch.tgt_out[row, m] == EOS_ID
    assert batch.ntokens == sum(len(tgt[i]) + 1 for i in indices)
    (feats,) = batch.prlm
    lengths = [int(reader.lengths[i]) for i in indices]
    assert feats.states.shape == (3, 1, max(lengths), reader.hidden_size)
    assert batch.src_tokens.shape[1] == max(len(src[i]) + 1 for i in indices)
    assert batch.tgt_in.shape[1] == max(len(tgt[i]) + 1 for i in indices)
    assert feats.mask.sum(1).tolist() == lengths
    # A float16 cache hands over float16 (half the bytes), exactly the stored values.
    assert reader.dtype == "float16" and feats.states.dtype == torch.float16
    for row, i in enumerate(indices):
        assert torch.equal(feats.states[row, 0, : lengths[row]].float(), reader.features(i)[1])
        assert (feats.states[row, :, lengths[row] :] == 0).all()
        torch.testing.assert_close(feats.pooled[row], reader.pooled(i))
    assert feats.pooled.shape == (3, len(reader.pooled_layers), 2, reader.hidden_size)


def test_workers_deliver_the_same_batches_as_in_process(cache):
    corpus, paths = cache
    src, tgt = _pairs(40, seed=1)
    sources = [PrLMBranch(CacheReader(paths["train"]), layer_rows=(0, 1), pooled_rows=None)]
    dataset = PairDataset(src, tgt, sources)
    sampler = TokenBudgetBatchSampler(dataset.src_lens, dataset.tgt_lens, 60, seed=4)
    sampler.set_epoch(2, start=1)
    expected = [dataset.__getitems__(b) for b in sampler]
    memory = PairDataset(src, tgt, [PrLMBranch(CacheReader(paths["train"], in_memory=True), layer_rows=(0, 1), pooled_rows=None)])
    got_workers = list(make_loader(dataset, sampler, num_workers=2))
    got_memory = list(make_loader(memory, sampler, num_workers=0))
    assert len(got_workers) == len(expected) == len(got_memory) > 1
    for e, w, m in zip(expected, got_workers, got_memory):
        for got in (w, m):
            assert torch.equal(e.ids, got.ids) and torch.equal(e.src_tokens, got.src_tokens)
            assert torch.equal(e.prlm[0].states, got.prlm[0].states) and torch.equal(e.prlm[0].mask, got.prlm[0].mask)


@pytest.mark.parametrize("static", [False, True])
def test_a_worker_s_window_is_one_block_of_shared_memory_sent_without_a_copy(cache, monkeypatch, static):
    """In a DataLoader worker every tensor of a work item (here a window of batches, one empty, with pooled
    vectors; under static shapes with rows past the sentences) is a view of one block of shared memory,
    written in full whatever the block held: the hand-over (a worker's result queue pickles the item with
    torch's reductions) copies nothing and registers one descriptor. In-process batches stay private."""
    import io
    from multiprocessing import resource_sharer
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (the reductions a worker's queue uses)
    from prlmfuse.train_fused import data
    from prlmfuse.train_fused.buckets import BatchShapes

    def tensors(batch):
        f = batch.prlm[0]
        return [batch.ids, batch.src_tokens, batch.tgt_in, batch.tgt_out, f.states, f.mask, f.pooled]

    new_shared = torch.UntypedStorage._new_shared

    def poisoned(nbytes):  # a fresh block reads as zeros; every byte the batches leave unwritten shows here
        block = new_shared(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(block).fill_(0xA5)
        return block

    corpus, paths = cache
    src, tgt = _pairs(12, seed=3)
    dataset = PairDataset(src, tgt, [PrLMBranch(CacheReader(paths["train"]), layer_rows=(1, 0), pooled_rows=(1,))])
    if static:
        dataset.shapes = BatchShapes(max_tokens=100_000, target_ratio=1.5, prlm_ratio=1.5)
    batches = [[0, 5, 3], [], [7, 1], [11]]
    private = dataset.padded(batches)
    monkeypatch.setattr(data, "get_worker_info", lambda: object())  # as inside a worker
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(poisoned))
    shared = dataset.padded(batches)
    if static:
        assert any(len(b.prlm[0].states) > b.nsentences for b in shared)
    block = shared[0].ids.untyped_storage()
    for mine, theirs in zip(private, shared):
        assert mine.ntokens == theirs.ntokens
        for a, b in zip(tensors(mine), tensors(theirs)):
            assert torch.equal(a, b) and a.dtype == b.dtype and b.is_contiguous() and b.data_ptr() % 64 == 0
            assert not a.is_shared() and b.is_shared() and b.untyped_storage().data_ptr() == block.data_ptr()
    views = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for batch in shared for t in tensors(batch))
    assert all(end <= start for (_, end), (start, _) in zip(views, views[1:]))  # no two views overlap
    sharer = resource_sharer._resource_sharer
    before = len(sharer._cache)
    try:
        where = block.data_ptr()
        ForkingPickler(io.BytesIO()).dump(shared)
        assert len(sharer._cache) == before + 1 and block.data_ptr() == where  # one descriptor, nothing moved
        moved = private[0].prlm[0].states
        where = moved.untyped_storage().data_ptr()
        ForkingPickler(io.BytesIO()).dump(private[0])
        assert len(sharer._cache) == before + 1 + 7 and moved.untyped_storage().data_ptr() != where  # copied
    finally:  # nothing here claims the descriptors, as a trainer would
        with sharer._lock:
            for _, close in sharer._cache.values():
                close()
            sharer._cache.clear()


def test_empty_slice_is_an_empty_batch(cache):
    corpus, paths = cache
    src, tgt = _pairs(4)
    batch = PairDataset(src, tgt, [PrLMBranch(CacheReader(paths["train"]), layer_rows=(0,), pooled_rows=None)]).__getitems__([])
    assert batch.nsentences == 0 and batch.ntokens == 0 and batch.prlm[0].states.shape[0] == 0


@pytest.mark.parametrize("backend, window", [("hdf5", 0), ("zarr", 0), ("hdf5", 1), ("zarr", 2)])
def test_an_epoch_streamed_by_workers_delivers_each_sentence_once_with_its_stored_features(tmp_path, backend, window):
    """Workers read each batch (window 0) or each window of neighbouring stored sentences from the files of
    shards split small (hdf5: by os.preadv)."""
    from prlmfuse.cache_features import build_cache

    corpus = small_runs.small_bible(tmp_path, train=40, dev=8, test=8)
    ckpt = small_runs.tiny_prlm(tmp_path / "bert")
    path = build_cache(str(ckpt), corpus.src_path("train"), tmp_path / backend, layers="1,-1", backend=backend,
                       progress=False, shard_bytes=2048, max_tokens=64).path
    streamed = CacheReader(path)
    stored = CacheReader(path, in_memory=True)
    assert len(streamed.manifest["shards"]) > 3
    src, tgt = _pairs(len(stored), seed=2)
    dataset = PairDataset(src, tgt, [PrLMBranch(streamed, layer_rows=(1, 0), pooled_rows=(1,))])
    if window:
        sampler = StorageWindowBatchSampler(dataset.src_lens, dataset.tgt_lens, 60, streamed.stored_order(),
                                            window=window, seed=5)
        assert len(sampler.windows) > 1
    else:
        sampler = TokenBudgetBatchSampler(dataset.src_lens, dataset.tgt_lens, 60, seed=5)
    sampler.set_epoch(1)
    seen = []
    for batch in make_loader(dataset, sampler, num_workers=2):
        features = batch.prlm[0]
        for row, i in enumerate(batch.ids.tolist()):
            n = int(stored.lengths[i])
            assert int(features.mask[row].sum()) == n
            assert torch.equal(features.states[row, :, :n], stored.features(i, [1, 0], widen=False)), i
            assert torch.equal(features.pooled[row], stored.pooled(i)[[1]]), i
        seen += batch.ids.tolist()
    assert sorted(seen) == list(range(len(stored)))


def test_auto_loader_workers_are_two_on_a_cpu_and_half_the_run_s_threads_on_a_gpu(monkeypatch):
    from prlmfuse.errors import SettingError
    from prlmfuse.train_fused.trainer import loader_workers

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # only the device's type is read
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert (loader_workers("auto", cpu), loader_workers("auto", gpu), loader_workers(3, gpu)) == (2, 8, 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one of eight runs sharing 16 cores (train.jobs)
    assert loader_workers("auto", gpu) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert loader_workers("auto", gpu) == 8
    for wrong in ("many", -1, True):
        with pytest.raises(SettingError, match="num_workers"):
            small_runs.tiny_run("w", num_workers=wrong).check()
    small_runs.tiny_run("w", num_workers="auto").check()
