"""max_source_tokens: the model's source cut to its first N BPE tokens, </s> last, alike in training, at the dev
evaluation and in decoding (evaluate, translate), on the real small Bible corpus."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from prlmfuse.config import load_pipeline
from prlmfuse.errors import UserError
from prlmfuse.fileio import read_lines
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused import run_setup, train_run
from prlmfuse.train_fused.bpe import BPE, EOS_ID, PAD_ID
from prlmfuse.train_fused.modeling import FusedTransformer

from helpers import small_runs

torch.set_num_threads(1)

# Train sources run from 13 to 114 BPE tokens at bpe_vocab 600 (a median of 48), dev's from 30 to 107: N = 40
# cuts most of them and leaves some of each split whole.
N = 40


class EncoderInputs:
    """Every src_tokens the model's encoder is given (training steps, dev evaluations, beam search), on the CPU."""

    def __init__(self, monkeypatch):
        self.seen: list[torch.Tensor] = []
        encode = FusedTransformer.encode

        def spy(model, src_tokens, prlm_features):
            self.seen.append(src_tokens.detach().cpu().clone())
            return encode(model, src_tokens, prlm_features)

        monkeypatch.setattr(FusedTransformer, "encode", spy)

    def rows(self) -> list[tuple[int, ...]]:
        """Each source row the encoder read, its padding dropped."""
        return [tuple(int(t) for t in row if t != PAD_ID) for batch in self.seen for row in batch]


class Datasets:
    """The PairDatasets train_run builds (train, then dev)."""

    def __init__(self, monkeypatch):
        self.made = []
        made, real = self.made, run_setup.PairDataset

        def spy(*args, **kwargs):
            made.append(real(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(run_setup, "PairDataset", spy)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_runs.small_bible(tmp_path_factory.mktemp("cap"))


@pytest.fixture(scope="module")
def capped(corpus, tmp_path_factory):
    """A run trained with max_source_tokens N: its directory, its train and dev PairDatasets and what its encoder read."""
    with pytest.MonkeyPatch.context() as mp:
        inputs, datasets = EncoderInputs(mp), Datasets(mp)
        run_dir = train_run(small_runs.tiny_run("cap", max_source_tokens=N, max_updates=4, save_every=2), corpus, [],
                            tmp_path_factory.mktemp("runs") / "cap", progress=False)
    return run_dir, datasets.made, inputs


def _expected(bpe: BPE, lines: list[str]) -> list[tuple[int, ...]]:
    """Each source as the capped model must read it: its first N - 1 ids and </s>, or all of them and </s>."""
    return [tuple(ids[: N - 1]) + (EOS_ID,) for ids in bpe.encode_batch(lines)]


def test_training_and_dev_batches_hold_the_first_n_minus_1_tokens_and_eos(corpus, capped):
    run_dir, datasets, inputs = capped
    bpe = BPE.load(run_dir / "bpe.json")
    assert len(datasets) == 2  # train, then dev
    for split, dataset in zip(("train", "dev"), datasets):
        lines = read_lines(corpus.src_path(split))
        whole = bpe.encode_batch(lines)
        long = [i for i, ids in enumerate(whole) if len(ids) >= N]
        short = [i for i, ids in enumerate(whole) if len(ids) < N - 1]
        assert long and short, split  # the split holds sentences of both kinds
        assert len(dataset) == len(lines)
        for i, expected in enumerate(_expected(bpe, lines)):
            row = dataset.batch([i], []).src_tokens[0].tolist()
            assert tuple(row) == expected, (split, i)
            assert len(row) <= N and row[-1] == EOS_ID
        for i in short:  # a short sentence is whole, </s> after it
            assert dataset.batch([i], []).src_tokens[0].tolist() == list(whole[i]) + [EOS_ID]
        for i in long:
            assert len(dataset.batch([i], []).src_tokens[0]) == N
        assert int(dataset.src_lens.max()) == N  # the batch budget counts the cut sources

    # What the encoder read in the 4 training steps and the 2 dev evaluations: never wider than N, every row a
    # source of the splits as cut, </s> last, and some rows cut to exactly N.
    assert inputs.seen and max(batch.shape[1] for batch in inputs.seen) == N
    known = set(_expected(bpe, read_lines(corpus.src_path("train")) + read_lines(corpus.src_path("dev"))))
    rows = inputs.rows()
    assert all(row in known and row[-1] == EOS_ID for row in rows)
    assert any(len(row) == N for row in rows) and any(len(row) < N for row in rows)


def test_decoding_a_long_source_reads_its_first_n_minus_1_tokens_and_eos(corpus, capped, monkeypatch):
    from prlmfuse.evaluate.corpus_decode import decode_corpus
    from prlmfuse.evaluate.live import translate
    from prlmfuse.evaluate.runs import load_model, open_run, select_weights
    from prlmfuse.evaluate.settings import AVERAGE_LAST, DEFAULTS, DecodeSettings

    run_dir, _, _ = capped
    bpe = BPE.load(run_dir / "bpe.json")
    test = read_lines(corpus.src_path("test"))
    line = " ".join(sorted(test, key=lambda s: len(bpe.encode(s)))[-2:])  # the two longest test verses
    ids = bpe.encode(line)
    assert len(ids) > 2 * N

    inputs = EncoderInputs(monkeypatch)
    (capped_hyp,) = translate(run_dir, [line], beam=2, max_len_b=12, bf16=False, device="cpu")
    assert inputs.rows() == [tuple(ids[: N - 1]) + (EOS_ID,)]  # what the encoder read

    # The same model decoding the first N - 1 ids itself gives the same hypothesis.
    run = open_run(run_dir)
    model, _ = load_model(run, select_weights(run, AVERAGE_LAST))
    settings = DecodeSettings.for_run(run, None, beam=2, lenpen=DEFAULTS.lenpen, max_len_a=DEFAULTS.max_len_a,
                                      max_len_b=12, min_len=DEFAULTS.min_len, bf16=False)
    (first,) = decode_corpus(model, bpe, [np.asarray(ids[: N - 1], dtype=np.int64)], [], settings).hyps
    assert capped_hyp == first

    # evaluate --split dev cuts the dev sources the same way, and says how many it cut.
    from prlmfuse.evaluate.evaluation import evaluate_runs

    inputs.seen.clear()
    evaluate_runs([run_dir], out=run_dir.parent / "eval", test_sets=["dev"], beam=2, max_len_b=8, device="cpu",
                  progress=False, score=False)
    dev = read_lines(corpus.src_path("dev"))
    assert max(batch.shape[1] for batch in inputs.seen) == N
    assert set(inputs.rows()) == set(_expected(bpe, dev))
    meta = json.loads((run_dir.parent / "eval" / "hyp.cap.dev.json").read_text())
    assert meta["capped_sources"] == sum(len(x) >= N for x in bpe.encode_batch(dev)) > 0
    assert meta["truncated_sources"] == 0


def test_resuming_with_another_cap_is_refused(corpus, capped):
    run_dir, _, _ = capped
    assert json.loads((run_dir / "run.json").read_text())["train"]["max_source_tokens"] == N
    for other in (N + 8, None):
        with pytest.raises(UserError, match=r"different configuration \(train\.max_source_tokens.*--fresh --runs cap"):
            train_run(small_runs.tiny_run("cap", max_source_tokens=other, max_updates=6, save_every=2), corpus, [],
                      run_dir, progress=False)
    # the same cap resumes (the run is done at 4 updates: nothing more to train)
    train_run(small_runs.tiny_run("cap", max_source_tokens=N, max_updates=4, save_every=2), corpus, [], run_dir,
              progress=False)
    # a run.json written before the setting existed reads as whole sources, so those runs still resume
    old = {"model": {}, "train": {"name": "old"}, "corpus": {"root": "/x"}, "prlms": []}
    assert rundir.upgrade_run_info(old)["train"]["max_source_tokens"] is None


def _pipeline(tmp_path: Path, runs: str) -> Path:
    """A pipeline.yaml of these runs (one a line, from line 5 on)."""
    p = tmp_path / "p.yaml"
    p.write_text(f"workdir: {tmp_path / 'work'}\ntrain:\n  defaults: {{preset: tiny, max_updates: 10}}\n  runs:\n"
                 + textwrap.indent(runs, "    "))
    return p


@pytest.mark.parametrize("value,detail", [
    ("1", "expected an integer >= 2, got 1 (N keeps the source's first N - 1 BPE tokens and </s>; null keeps them all)"),
    ("0", "expected an integer >= 2, got 0 (N keeps the source's first N - 1 BPE tokens and </s>; null keeps them all)"),
    ("64.5", "expected an integer, got 64.5"),
    ("2000", "expected at most 1024 (the model's positions), got 2000"),
])
def test_a_bad_cap_is_refused_where_it_is_written(tmp_path, value, detail):
    p = _pipeline(tmp_path, f"b: {{}}\nc: {{max_source_tokens: {value}}}\n")
    with pytest.raises(UserError) as e:
        load_pipeline(p)
    column = len("    c: {max_source_tokens: ") + 1
    assert str(e.value) == f"{p}:6:{column}: train.runs.c.max_source_tokens: {detail}"


def test_the_dry_run_plan_shows_the_cap(tmp_path):
    from prlmfuse.plan import plan_lines

    cfg = load_pipeline(_pipeline(tmp_path, "whole: {}\ncut: {max_source_tokens: 128}\n"))
    assert cfg.run("cut").max_source_tokens == 128 and cfg.run("whole").max_source_tokens is None
    lines = [line for line in plan_lines(cfg, None) if line.startswith("train:")]
    assert len(lines) == 2
    assert "sources cut" not in lines[0] and lines[1].endswith("10 updates of 3500-token batches, sources cut to 128 tokens")
