"""A batch that runs out of memory, injected at a chosen update of a real small run: freed, logged, trained
in halves and counted; too many in a row stop the run with one line that names max_tokens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from prlmfuse.errors import UserError
from prlmfuse.precision import resolve_runtime
from prlmfuse.train_fused import train_run
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.out_of_memory import OOM_IN_A_ROW, split_batch
from prlmfuse.train_fused.trainer import Trainer

from helpers import small_runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return small_runs.fused_world(tmp_path_factory.mktemp("oom"))


def _inject(monkeypatch, *, updates: set[int] | None, min_sentences: int = 2) -> list[int]:
    """Make the forward pass run out of memory at these updates (every update if None) on any batch of at
    least `min_sentences` sentences; returns the list of sizes that failed."""
    real = Trainer._forward_sums
    failed: list[int] = []

    def forward_sums(self, batch):
        if self.model.training and (updates is None or self.state.update + 1 in updates) \
                and batch.nsentences >= min_sentences:
            failed.append(batch.nsentences)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, batch)

    monkeypatch.setattr(Trainer, "_forward_sums", forward_sums)
    return failed


def _records(run_dir):
    return [r for r in rundir.read_metrics(run_dir) if "loss" in r]


def test_an_out_of_memory_batch_is_trained_in_halves_and_counted(world, tmp_path, monkeypatch, caplog):
    corpus, use, caches = world
    run = small_runs.tiny_run("fused", prlms=[use], max_updates=8, log_every=1)
    # float32: under bf16 autocast two half-batch forwards round differently from one full batch.
    fp32 = resolve_runtime("cpu", "fp32")
    plain = train_run(run, corpus, caches, tmp_path / "plain", progress=False, runtime=fp32)

    # At update 5 every batch of two sentences or more fails: halved until each sentence trains alone.
    failed = _inject(monkeypatch, updates={5}, min_sentences=2)
    with caplog.at_level(logging.WARNING, logger="prlmfuse"):
        split = train_run(run, corpus, caches, tmp_path / "split", progress=False, runtime=fp32)
    assert failed and all(n >= 2 for n in failed)
    lines = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert lines and all("at update 5 on " in line and "target tokens" in line and "padded (" in line for line in lines)

    state = json.loads((split / "trainer_state.json").read_text())
    assert state["oom_retries"] >= 1 and state["oom_in_a_row"] == 0 and state["update"] == 8
    retries = {r["update"]: r["oom_retries"] for r in _records(split)}
    assert retries[5] == state["oom_retries"] and all(v == 0 for u, v in retries.items() if u != 5)
    # The same update: the halves' summed loss is the whole batch's, up to rounding.
    before = {r["update"]: r["loss"] for r in _records(plain)}
    after = {r["update"]: r["loss"] for r in _records(split)}
    assert after[4] == before[4] and after[5] == pytest.approx(before[5], rel=1e-5)


def test_too_many_updates_in_a_row_out_of_memory_stop_the_run_in_one_line(world, tmp_path, monkeypatch):
    corpus, use, caches = world
    _inject(monkeypatch, updates=None, min_sentences=2)  # every update fails until its sentences train alone
    run = small_runs.tiny_run("fused", prlms=[use], max_updates=OOM_IN_A_ROW + 4)
    with pytest.raises(UserError) as e:
        train_run(run, corpus, caches, tmp_path / "run", progress=False)
    message = str(e.value)
    assert "\n" not in message and f"{OOM_IN_A_ROW + 1} updates in a row ran out of memory" in message
    assert "lower max_tokens (now 300)" in message


def test_an_update_that_never_fits_stops_the_run(world, tmp_path, monkeypatch):
    corpus, use, caches = world
    _inject(monkeypatch, updates={3}, min_sentences=1)  # even one sentence fails
    with pytest.raises(UserError, match=r"out of memory at update 3 even with its batches split 6 times"):
        train_run(small_runs.tiny_run("fused", prlms=[use], max_updates=6), corpus, caches, tmp_path / "run",
                  progress=False)


def test_split_batch_keeps_every_sentence_token_and_feature(world):
    from prlmfuse.train_fused.data import PairDataset
    from prlmfuse.train_fused.run_setup import open_run_branches

    corpus, use, caches = world
    (branch,) = open_run_branches(small_runs.tiny_run("x", prlms=[use]), corpus, caches)["train"]
    src = [torch.randint(3, 50, (n,)).numpy() for n in (3, 9, 5, 1, 7)]
    tgt = [torch.randint(3, 50, (n,)).numpy() for n in (4, 2, 8, 6, 3)]
    batch = PairDataset(src, tgt, [branch]).__getitems__([0, 1, 2, 3, 4])
    a, b = split_batch(batch)
    assert a.nsentences + b.nsentences == 5 and a.ntokens + b.ntokens == batch.ntokens
    assert a.src_tokens.shape == (2, 10) and b.src_tokens.shape == (3, 8)  # each half trimmed to its longest
    assert torch.equal(a.tgt_out[0, :5], batch.tgt_out[0, :5]) and torch.equal(b.ids, batch.ids[2:])
    for half, rows in ((a, slice(0, 2)), (b, slice(2, 5))):
        (f,), (whole,) = half.prlm, batch.prlm
        m = f.mask.shape[1]
        assert torch.equal(f.mask, whole.mask[rows, :m]) and torch.equal(f.states, whole.states[rows, :, :m])
        assert not whole.mask[rows, m:].any()


def test_decoding_splits_a_batch_that_runs_out_of_memory_and_gives_the_same_hypotheses(world, tmp_path, monkeypatch):
    from prlmfuse.evaluate import corpus_decode, evaluate_runs

    corpus, use, caches = world
    run_dir = train_run(small_runs.tiny_run("fused", prlms=[use], max_updates=6), corpus, caches, tmp_path / "run",
                        progress=False)
    whole = evaluate_runs([run_dir], out=tmp_path / "whole", beam=2, average_last=1, progress=False)
    real, sizes = corpus_decode.beam_search, []

    def beam_search(model, src_tokens, *args, **kwargs):
        sizes.append(src_tokens.shape[0])
        if src_tokens.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, src_tokens, *args, **kwargs)

    monkeypatch.setattr(corpus_decode, "beam_search", beam_search)
    split = evaluate_runs([run_dir], out=tmp_path / "split", beam=2, average_last=1, progress=False)
    assert max(sizes) > 3 and sizes[-1] <= 3
    assert (tmp_path / "split" / "hyp.fused.test.txt").read_text() == (tmp_path / "whole" / "hyp.fused.test.txt").read_text()
    assert split.row("fused").bleu == whole.row("fused").bleu


def test_the_cache_build_runs_a_batch_that_runs_out_of_memory_in_halves(world, tmp_path, monkeypatch):
    from prlmfuse.cache_features import build_cache
    from prlmfuse.cache_features.extract import FeatureExtractor

    from helpers import reliability

    corpus, use, _ = world
    source = corpus.src_path("dev")
    # float32: whether a bf16 row rounds the same in a batch of another height depends on the CPU's kernels.
    reference = build_cache(use.checkpoint, source, tmp_path / "whole", layers="-2,-1", max_tokens=256,
                            precision="fp32", progress=False)
    real, sizes = FeatureExtractor._forward, []

    def forward(self, input_ids, attention_mask):
        sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, input_ids, attention_mask)

    monkeypatch.setattr(FeatureExtractor, "_forward", forward)
    split = build_cache(use.checkpoint, source, tmp_path / "split", layers="-2,-1", max_tokens=256,
                        precision="fp32", progress=False)
    assert max(sizes) > 2
    reliability.assert_same_cache(Path(split.path), Path(reference.path))



_DDP_DRIVER = """
import json, os, sys
import torch

def main():
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import small_runs as s
    from prlmfuse.corpora import load_corpus
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import PrLMUse, train_run
    from prlmfuse.train_fused.trainer import Trainer
    args = json.loads(sys.argv[1])
    if os.environ.get("RANK") == "1":  # this rank alone runs out of memory at update 5, once per batch size
        real, failed = Trainer._forward_sums, set()
        def forward_sums(self, batch):
            if self.model.training and self.state.update + 1 == 5 and batch.nsentences > 1 and batch.nsentences not in failed:
                failed.add(batch.nsentences)
                raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
            return real(self, batch)
        Trainer._forward_sums = forward_sums
    corpus = load_corpus(args["corpus"])
    use = PrLMUse(checkpoint=args["ckpt"], layer=-2)
    run = s.tiny_run("ddp", prlms=[use], max_updates=8, save_every=4, log_every=1)
    train_run(run, corpus, args["caches"], args["out"], progress=False, runtime=resolve_runtime("cpu", "fp32"))

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_under_torchrun_one_rank_out_of_memory_makes_every_rank_redo_the_update(world, tmp_path):
    import os
    import subprocess
    import sys

    corpus, use, caches = world
    driver = tmp_path / "driver.py"
    driver.write_text(_DDP_DRIVER.format(tests=str(Path(__file__).parent)))
    args = {"corpus": str(corpus.root), "ckpt": use.checkpoint, "caches": caches, "out": str(tmp_path / "ddp")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(driver), json.dumps(args)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((tmp_path / "ddp" / "trainer_state.json").read_text())
    assert state["update"] == 8 and state["oom_retries"] >= 1  # rank 0, which never ran out, counted the redo too
    retries = {r["update"]: r["oom_retries"] for r in _records(tmp_path / "ddp")}
    assert retries[5] >= 1 and all(v == 0 for u, v in retries.items() if u != 5)


@pytest.mark.cuda
def test_a_real_cuda_out_of_memory_batch_is_trained_in_halves(world, tmp_path):
    """On a GPU held to a small share of its memory, a batch too large for it runs out for real and
    the run goes on in halves."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from prlmfuse.precision import resolve_runtime

    corpus, use, caches = world
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (1 << 30) / total))  # 1 GiB for this process
    try:
        run = small_runs.tiny_run("fused", prlms=[use], preset="base", max_tokens=20000, max_updates=3, save_every=3)
        run_dir = train_run(run, corpus, caches, tmp_path / "run", progress=False,
                            runtime=resolve_runtime("cuda", "fp32"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["update"] == 3 and state["oom_retries"] >= 1
