"""Stage-two data: token-budget batches, epoch order, DDP slices, the LR schedule, features from a real cache."""

from __future__ import annotations

import math
from pathlib import Path
import os

import numpy as np
import pytest
import torch

from prlmfuse.cache_features import CacheReader
from prlmfuse.train_fused.bpe import BOS_ID, EOS_ID, PAD_ID
from prlmfuse.train_fused.data import (
    PairDataset, TokenBudgetBatchSampler, make_loader,
)
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.train_fused.trainer import inverse_sqrt_lr

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
    from prlmfuse.train_fused.trainer import label_smoothed_sums

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


def test_empty_slice_is_an_empty_batch(cache):
    corpus, paths = cache
    src, tgt = _pairs(4)
    batch = PairDataset(src, tgt, [PrLMBranch(CacheReader(paths["train"]), layer_rows=(0,), pooled_rows=None)]).__getitems__([])
    assert batch.nsentences == 0 and batch.ntokens == 0 and batch.prlm[0].states.shape[0] == 0


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_an_epoch_streamed_by_workers_delivers_each_sentence_once_with_its_stored_features(tmp_path, backend):
    """Workers read each batch from the files of shards split small (hdf5: by os.preadv)."""
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
