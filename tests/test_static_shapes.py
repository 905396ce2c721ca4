"""static_shapes: batches of a few fixed shapes, the loss over the padded bucket, the compiled step.

On real small data (the small Bible, a tiny BERT's cache): every pair trained once an epoch within
the token budget, each batch padded to its class's shape, padding rows and positions adding nothing to
the loss or the gradients, the compiled step giving the eager loss and compiling no new graph after
its first epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler
from prlmfuse.train_fused.bpe import PAD_ID
from prlmfuse.train_fused.buckets import BatchShapes, BucketBatchSampler, bucket_length
from prlmfuse.train_fused.data import PairDataset

from helpers import small_runs

torch.set_num_threads(1)


def test_lengths_round_up_to_a_ladder_of_eights_then_quarter_octaves():
    assert [bucket_length(n) for n in (1, 8, 9, 33, 64, 65, 96, 97, 128, 129, 200)] == \
        [8, 8, 16, 40, 64, 80, 96, 112, 128, 160, 224]
    assert [bucket_length(n, steps_per_octave=8) for n in (65, 129)] == [72, 144]
    for n in range(1, 2000):
        b = bucket_length(n)
        assert n <= b <= max(n + 7, n * 1.25) and b % 8 == 0 and bucket_length(b) == b


def _lengths(n: int = 3000, seed: int = 0):
    """Source, target and PrLM lengths that go together, as a translation's do."""
    rng = np.random.RandomState(seed)
    src = rng.randint(2, 90, size=n)
    tgt = np.maximum(2, (src * 1.3 + rng.normal(0, 4, size=n)).astype(np.int64))
    prlm = np.maximum(3, (src * 0.9 + rng.normal(0, 3, size=n)).astype(np.int64))
    return src, tgt, prlm


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_class_batches_hold_every_pair_once_within_the_budget_in_few_shapes(world_size):
    src, tgt, prlm = _lengths()
    usable = np.flatnonzero(src < 85)
    shapes = BatchShapes.fit(src[usable], tgt[usable], prlm[usable], 600, world_size)
    assert shapes.target_ratio > 1 and shapes.prlm_ratio < 1  # fitted to how the lengths go together
    sampler = BucketBatchSampler(src, tgt, shapes, prlm_lens=prlm, indices=usable, seed=1, world_size=world_size)
    assert sorted(i for b in sampler.batches for i in b) == usable.tolist()
    seen, short = [], 0
    for b in sampler.batches:
        rows, s, t, m = shape = shapes.shape(src[b].max(), tgt[b].max(), prlm[b].max())
        assert src[b].max() <= s and tgt[b].max() <= t and prlm[b].max() <= m
        assert len(b) <= rows * world_size and (rows * world_size * max(s, t) <= 600 or rows == 1)
        short += len(b) < rows * world_size
        seen.append(shape)
    # a dozen shapes, however many batches; a batch short of its rows only where carried pairs end a class
    assert len(set(seen)) <= 16 < len(seen) / 10 and short <= len(set(seen))
    # and about as many positions as batches padded to their longest sentences (source sorted first)
    padded = sum(len(b) * (src[b].max() + tgt[b].max() + prlm[b].max())
                 for b in TokenBudgetBatchSampler(src, tgt, 600, indices=usable, seed=1).batches)
    computed = sum(r * world_size * (s + t + m) for r, s, t, m in seen)
    assert computed == shapes.positions(src[usable], tgt[usable], prlm[usable]) and computed < 1.25 * padded


def test_any_length_has_a_class_and_a_baseline_fits_the_target_alone():
    src, tgt, _ = _lengths()
    shapes = BatchShapes.fit(src, tgt, None, 600)
    rows, s, t, m = shapes.shape(900, 5, 0)  # longer than any pair it was fitted to
    assert (rows, s >= 900, t >= 5) == (1, True, True)
    assert shapes.shape(10, 13) == shapes.shape(9, 12)


def test_the_sampler_keeps_the_epoch_order_resume_and_rank_slices():
    src, tgt, prlm = _lengths()
    shapes = BatchShapes.fit(src, tgt, prlm, 600, world_size=2)
    a = BucketBatchSampler(src, tgt, shapes, prlm_lens=prlm, seed=3, rank=0, world_size=2)
    b = BucketBatchSampler(src, tgt, shapes, prlm_lens=prlm, seed=3, rank=1, world_size=2)
    assert a.batches == BucketBatchSampler(src, tgt, shapes, prlm_lens=prlm, seed=3, world_size=2).batches
    a.set_epoch(2)
    full = list(a)
    a.set_epoch(2, start=5)
    assert list(a) == full[5:]
    a.set_epoch(3)
    assert list(a) != full
    a.set_epoch(2), b.set_epoch(2)
    for mine, theirs, whole in zip(a, b, (a.batches[k] for k in a.epoch_order(2))):
        assert mine + theirs == whole
        rows = shapes.shape(src[whole].max(), tgt[whole].max(), prlm[whole].max())[0]
        assert max(len(mine), len(theirs)) <= rows
    with pytest.raises(ValueError, match="2 ranks"):
        BucketBatchSampler(src, tgt, shapes, seed=3, world_size=1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    corpus, use, caches = small_runs.fused_world(root, layers="-2,-1")
    return corpus, use, caches


def _trainer(world, run, run_dir: Path):
    """The Trainer train_run builds for `run` over the world's caches (fp32 on the CPU), and its training pairs."""
    from prlmfuse.distributed import DistContext
    from prlmfuse.precision import Runtime
    from prlmfuse.train_fused.bpe import BPE
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.run_setup import _encode_split, open_run_branches, train_run_bpe
    from prlmfuse.train_fused.trainer import Trainer

    corpus, _, caches = world
    run_dir.mkdir(parents=True)
    branches = open_run_branches(run, corpus, caches if run.prlms else [])
    train_run_bpe(run, corpus, run_dir / "bpe.json")
    bpe = BPE.load(run_dir / "bpe.json")
    torch.manual_seed(run.seed)
    model = FusedTransformer(run.model_config(bpe.vocab_size, [b.spec for b in branches["train"]]))
    src, tgt = _encode_split(bpe, corpus, "train", None)
    pairs = PairDataset(src, tgt, branches["train"])
    trainer = Trainer(run, run_dir, model, pairs, pairs, DistContext(), progress=False,
                      runtime=Runtime(torch.device("cpu"), torch.float32))
    return trainer, pairs


def test_a_batch_is_padded_to_its_class_shape_with_empty_rows_that_score_nothing(world, tmp_path):
    corpus, use, _ = world
    trainer, pairs = _trainer(world, small_runs.tiny_run("s", prlms=[use], static_shapes=True), tmp_path / "r")
    shapes = pairs.shapes
    assert shapes is not None and isinstance(trainer.train_sampler, BucketBatchSampler)
    seen = []
    reader = pairs.branches[0].reader
    for indices in trainer.train_sampler.batches:
        batch = pairs.__getitems__(indices)
        rows, s, t, m = shapes.shape(pairs.src_lens[indices].max(), pairs.tgt_lens[indices].max(),
                                     max(int(reader.lengths[i]) for i in indices))
        (feats,) = batch.prlm
        assert batch.src_tokens.shape == (rows, s) and batch.tgt_in.shape == batch.tgt_out.shape == (rows, t)
        assert feats.states.shape[0] == feats.mask.shape[0] == rows and feats.states.shape[2] == m
        assert batch.ids.tolist() == indices and batch.nsentences == len(indices)
        assert batch.ntokens == int((batch.tgt_out != PAD_ID).sum()) == int(pairs.tgt_lens[indices].sum())
        empty = slice(len(indices), rows)
        assert (batch.src_tokens[empty] == PAD_ID).all() and (batch.tgt_out[empty] == PAD_ID).all()
        assert not feats.mask[empty].any()
        seen.append((rows, s, t, m))
    assert len(set(seen)) < len(seen)


@pytest.mark.parametrize("layer", [-2, "dwatt", "dyn_cls"])
def test_the_loss_over_the_padded_bucket_is_the_eager_loss_and_gradients(world, tmp_path, layer):
    """The same sentences, padded to their class's shape and scored over every position with padding masked,
    give the loss and the gradients of the eager step over the batch padded to its own longest sentence."""
    corpus, use, _ = world
    use = type(use)(checkpoint=use.checkpoint, layer=layer)
    run = small_runs.tiny_run("s", prlms=[use])
    eager, pairs = _trainer(world, run, tmp_path / "eager")
    padded, _ = _trainer(world, run, tmp_path / "padded")
    indices = eager.train_sampler.batches[0] + eager.train_sampler.batches[1]
    plain = pairs.__getitems__(indices)
    pairs.shapes = BatchShapes(max_tokens=100_000, target_ratio=1.5, prlm_ratio=1.5)
    bucketed = pairs.__getitems__(indices)
    assert bucketed.src_tokens.shape[1] > plain.src_tokens.shape[1] or bucketed.tgt_in.shape[1] > plain.tgt_in.shape[1]
    for trainer, batch, sums in ((eager, plain, eager._forward_sums), (padded, bucketed, padded._padded_sums)):
        trainer.model.train()
        args = (batch,) if sums == eager._forward_sums else (batch.src_tokens, batch.tgt_in, batch.tgt_out, batch.prlm)
        loss, nll = sums(*args)
        loss.backward()
        trainer.result = (loss.detach(), nll)
    torch.testing.assert_close(padded.result[0], eager.result[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(padded.result[1], eager.result[1], rtol=1e-5, atol=1e-4)
    for (name, a), b in zip(eager.model.named_parameters(), padded.model.parameters()):
        if a.grad is None:
            assert b.grad is None or not b.grad.any(), name
            continue
        # atol: a key projection's bias has no gradient but rounding (softmax ignores a shift of every key),
        # and other padded lengths round it otherwise; the gradients of a sum over the batch are of order 1.
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_loss_and_compiles_nothing_after_its_first_epoch(world, tmp_path, monkeypatch):
    """Two epochs of static_shapes, compiled (inductor on the CPU) and eager, from the same weights and batches:
    the same losses within float tolerance, and the second epoch compiles no graph the first did not.

    In float32: under `auto` a CPU with bf16 autocasts, and how far bf16 rounding carries the two runs apart
    over 126 updates depends on the CPU's kernels."""
    from prlmfuse.precision import Runtime
    from prlmfuse.train_fused import train_run
    from prlmfuse.train_fused.trainer import Trainer

    corpus, use, caches = world
    real = Trainer.evaluate_and_save
    at_epoch_end: list[int] = []

    def evaluate_and_save(self, metrics):
        real(self, metrics)
        at_epoch_end.append(_dynamo_graphs())

    monkeypatch.setattr(Trainer, "evaluate_and_save", evaluate_and_save)
    losses, graphs = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        at_epoch_end.clear()
        before = _dynamo_graphs()
        run = small_runs.tiny_run("c", prlms=[use], static_shapes=True, compile=compiled, max_updates=None,
                                  max_epochs=2, save_every=10_000, log_every=1, keep_last_epochs=0)
        run_dir = tmp_path / f"compiled-{compiled}"
        train_run(run, corpus, caches, run_dir, progress=False, runtime=Runtime(torch.device("cpu"), torch.float32))
        graphs[compiled] = [n - before for n in at_epoch_end]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[compiled] = [r["loss"] for r in records if "loss" in r] + [r["dev_loss"] for r in records if "dev_loss" in r]
    assert graphs[False] == [0, 0]
    # The first epoch compiles the training step and the dev loss (each at most twice: its first shape, then
    # one graph for the shapes after it); the second epoch, over the same shapes, compiles nothing.
    assert len(graphs[True]) == 2 and 0 < graphs[True][0] <= 6 and graphs[True][1] == graphs[True][0]
    assert len(losses[True]) == len(losses[False]) > 4
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-4)
