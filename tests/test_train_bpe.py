"""Joint BPE of stage two: special ids, exact round trip for spaced and unspaced scripts, save/load."""

from __future__ import annotations

import errno

import pytest

from prlmfuse.errors import UserError
from prlmfuse.train_fused.bpe import BOS_ID, EOS_ID, PAD_ID, UNK_ID, BPE, normalize_line, train_bpe

TRAIN = [
    "In the beginning, God created the heavens and the earth.",
    "The earth was formless and empty. Darkness was on the surface of the deep.",
    "God said, “Let there be light,” and there was light.",
    "初めに、神は天と地を創造された。",
    "地は形がなく、空虚であって、闇が深淵の面にあり、",
    "神は「光あれ」と言われた。すると光があった。",
] * 20


@pytest.fixture(scope="module")
def bpe() -> BPE:
    return train_bpe(TRAIN, vocab_size=600)


def test_special_ids(bpe):
    tok = bpe.tokenizer
    assert [tok.token_to_id(t) for t in ["<pad>", "<s>", "</s>", "<unk>"]] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID] == [0, 1, 2, 3]


def test_japanese_without_spaces_is_segmented_and_round_trips(bpe):
    line = "神は光があったと言われた。"
    ids = bpe.encode(line)
    assert 1 < len(ids) < len(line)  # learned merges inside one space-free "word", yet several pieces
    assert bpe.decode(ids) == line


@pytest.mark.parametrize(
    "line",
    [
        "In the beginning God created the earth.",
        "two  spaces and\ttab",
        "初めに、神は天と地を創造された。",
        "unseen: Zebra ü 🎉 龘",  # never seen in training: byte fallback, no <unk>
        "ＦＵＬＬ　ｗｉｄｔｈ ①",  # NFKC folds these; decode returns the normalised text
        "",
    ],
)
def test_round_trip_is_exact_on_normalised_text(bpe, line):
    ids = bpe.encode(line)
    assert UNK_ID not in ids
    assert bpe.decode(ids) == normalize_line(line)


def test_decode_stops_at_eos_and_skips_pad_bos(bpe):
    ids = bpe.encode("the earth")
    assert bpe.decode([BOS_ID] + ids + [EOS_ID] + bpe.encode("light") + [PAD_ID]) == "the earth"


def test_save_load_same_ids(bpe, tmp_path):
    bpe.save(tmp_path / "bpe.json")
    again = BPE.load(tmp_path / "bpe.json")
    line = "God said, 神は言われた。"
    assert again.encode(line) == bpe.encode(line)
    assert again.vocab_size == bpe.vocab_size <= 600


def test_vocab_size_is_respected_when_text_is_rich():
    text = [f"word{i} 語{i} token{i * 7}" for i in range(400)]
    assert train_bpe(text, vocab_size=400).vocab_size == 400


def test_a_large_alphabet_leaves_room_for_merges():
    """A side with more distinct characters than the vocabulary holds (as Japanese has thousands)
    must not crowd out the merges: the English side still gets whole-word pieces."""
    rare = "".join(chr(0x4E00 + i) for i in range(3000))  # 3,000 distinct CJK characters
    text = [rare[i : i + 30] for i in range(0, 3000, 30)] + [line for line in TRAIN if line.isascii()] * 10
    bpe = train_bpe(text, vocab_size=1000)
    assert bpe.vocab_size <= 1000
    assert len(bpe.encode("In the beginning God created the earth.")) <= 12  # not letter by letter (39 chars)
    line = rare[1234:1250] + " the earth"
    ids = bpe.encode(line)
    assert UNK_ID not in ids and bpe.decode(ids) == line  # rare characters are spelled in bytes
    # The 3,000 characters are equally frequent: which of them stay must not depend on hash order,
    # or a run and its rerun would train different vocabularies.
    assert all(train_bpe(text, vocab_size=1000).tokenizer.to_str() == bpe.tokenizer.to_str() for _ in range(3))


def test_too_small_vocab_and_corrupt_file_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="bpe_vocab=100"):
        train_bpe(TRAIN, vocab_size=100)
    (tmp_path / "bpe.json").write_text('{"model": ')
    with pytest.raises(UserError, match="corrupt"):
        BPE.load(tmp_path / "bpe.json")


def test_splits_encode_in_chunks_to_the_ids_of_one_batch(tmp_path, monkeypatch):
    """train_run encodes a split a chunk of lines at a time (a whole split's Encoding objects at once
    made a heap peak that grew with the corpus) into int32 arrays, the ids of encoding it whole."""
    import numpy as np

    from helpers import small_runs
    from prlmfuse.fileio import read_lines
    from prlmfuse.train_fused import run_setup

    corpus = small_runs.small_bible(tmp_path, train=50, dev=5, test=5)
    src, tgt = read_lines(corpus.src_path("train")), read_lines(corpus.tgt_path("train"))
    bpe = train_bpe(src + tgt, vocab_size=600)
    monkeypatch.setattr(run_setup, "ENCODE_CHUNK", 7)
    got_src, got_tgt = run_setup._encode_split(bpe, corpus, "train", 40)
    assert len(got_src) == len(got_tgt) == 40
    assert all(a.dtype == np.int32 for a in got_src + got_tgt)
    assert [a.tolist() for a in got_src] == bpe.encode_batch(src[:40])
    assert [a.tolist() for a in got_tgt] == bpe.encode_batch(tgt[:40])


def test_run_bpe_trains_in_a_child_process_to_the_same_model(tmp_path):
    """train_run's BPE is trained in a child process (the tokenizers trainer's memory stays in the heap of
    the process that ran it): the same bpe.json as training it in-process, and its errors arrive as UserError."""
    from helpers import small_runs
    from prlmfuse.fileio import read_lines
    from prlmfuse.train_fused.config import RunConfig
    from prlmfuse.train_fused.run_setup import train_run_bpe

    corpus = small_runs.small_bible(tmp_path, train=60, dev=5, test=5)
    src, tgt = read_lines(corpus.src_path("train")), read_lines(corpus.tgt_path("train"))
    path = tmp_path / "bpe.json"
    train_run_bpe(RunConfig(name="r", bpe_vocab=600, max_train_pairs=50), corpus, path)
    assert BPE.load(path).tokenizer.to_str() == train_bpe(src[:50] + tgt[:50], vocab_size=600).tokenizer.to_str()
    with pytest.raises(UserError, match="bpe_vocab=10 is too small"):
        train_run_bpe(RunConfig(name="r", bpe_vocab=10), corpus, tmp_path / "small.json")
    assert not (tmp_path / "small.json").exists()
    # An OSError in the child (here: a file where the output directory belongs) arrives as one.
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    with pytest.raises(OSError) as raised:
        train_run_bpe(RunConfig(name="r", bpe_vocab=600), corpus, tmp_path / "a-file" / "bpe.json")
    assert raised.value.errno in (errno.ENOTDIR, errno.EEXIST)


def test_the_bpe_child_imports_no_torch():
    # train_run_bpe's child process imports the module of the function it runs: torch there would cost
    # the child seconds and hundreds of MB for a job that never uses it.
    import subprocess
    import sys

    from prlmfuse.train_fused.bpe import train_bpe_files

    code = f"import sys, {train_bpe_files.__module__}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
