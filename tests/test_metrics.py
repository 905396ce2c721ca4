"""Scoring and bootstrap through our wiring, checked against published and hand-worked values."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
from rouge_score import rouge_scorer

from prlmfuse.errors import UserError
from prlmfuse.evaluate.metrics import (
    RougeTokenizer,
    bleu_tokenizer_for,
    bootstrap_scores,
    confidence_interval,
    corpus_scores,
    paired_bootstrap,
    sentence_stats,
)

# sacrebleu README example.
README_REFS = [
    ["The dog bit the man.", "It was not unexpected.", "The man bit him first."],
    ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."],
]
README_SYS = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]


def test_sacrebleu_readme_example_reproduces():
    scores = corpus_scores(README_SYS, README_REFS, tgt_lang="en")
    assert round(scores["bleu"], 2) == 48.53
    assert scores["bleu_tokenize"] == "13a"
    assert scores["signature"]["bleu"].startswith("nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp|version:2.")
    assert "nrefs:2" in scores["signature"]["chrf"]
    assert scores["num_sentences"] == 3


def test_bleu_tokenizer_follows_target_language():
    assert bleu_tokenizer_for("en") == "13a"
    assert bleu_tokenizer_for("de-DE") == "13a"
    assert bleu_tokenizer_for("zh") == "zh"
    assert bleu_tokenizer_for("zh_Hans") == "zh"
    assert bleu_tokenizer_for("ja") == "ja-mecab"
    assert bleu_tokenizer_for("jpn") == "ja-mecab"
    assert bleu_tokenizer_for("ko") == "ko-mecab"
    assert bleu_tokenizer_for(None) == "13a"


def test_japanese_bleu_uses_mecab_and_records_it():
    scores = corpus_scores(["今日は良い天気です。"], ["今日は天気が良い。"], tgt_lang="ja")
    assert scores["bleu_tokenize"] == "ja-mecab"
    assert "tok:ja-mecab" in scores["signature"]["bleu"]
    # Unsegmented, '13a' would see one token per sentence and score 0.
    assert scores["bleu"] > 0


def test_intl_tokenizer_can_be_chosen():
    scores = corpus_scores(README_SYS, README_REFS, tgt_lang="en", bleu_tokenize="intl")
    assert "tok:intl" in scores["signature"]["bleu"]


def test_unknown_bleu_tokenizer_is_a_user_error():
    with pytest.raises(UserError, match="unknown BLEU tokenizer 'moses'"):
        corpus_scores(README_SYS, README_REFS, tgt_lang="en", bleu_tokenize="moses")


@pytest.mark.skipif(importlib.util.find_spec("mecab_ko") is not None, reason="MeCab-ko is installed")
def test_missing_korean_mecab_is_a_one_line_user_error():
    with pytest.raises(UserError) as info:
        corpus_scores(["안녕하세요"], ["안녕하세요"], tgt_lang="ko")
    assert "\n" not in str(info.value)
    assert "sacrebleu[ko]" in str(info.value)


def test_misaligned_references_are_a_user_error():
    with pytest.raises(UserError, match="must be line-aligned"):
        corpus_scores(["a", "b"], ["a"], tgt_lang="en")


def test_rouge_on_japanese_is_nonzero_and_matches_hand_count():
    # MeCab (IPA) segments
    #   hyp: 今日 / は / 良い / 天気 / です / 。   -> '。' has no word character, dropped: 5 tokens
    #   ref: 今日 / は / 天気 / が / 良い / 。     -> 5 tokens
    # ROUGE-1: shared unigrams {今日, は, 良い, 天気} = 4; P = R = 4/5; F1 = 0.8
    # ROUGE-2: hyp bigrams {今日は, は良い, 良い天気, 天気です}, ref {今日は, は天気, 天気が, が良い};
    #          shared 1 (今日は); P = R = 1/4; F1 = 0.25
    # ROUGE-L: LCS = 今日 は 天気 (or 今日 は 良い), length 3; P = R = 3/5; F1 = 0.6
    hyp, ref = "今日は良い天気です。", "今日は天気が良い。"
    assert RougeTokenizer("ja").tokenize(hyp) == ["今日", "は", "良い", "天気", "です"]
    scores = corpus_scores([hyp], [ref], tgt_lang="ja", task="summarization")
    assert scores["rouge1"] == pytest.approx(80.0)
    assert scores["rouge2"] == pytest.approx(25.0)
    assert scores["rougeL"] == pytest.approx(60.0)
    # rouge-score's default tokenizer keeps only [a-z0-9]: the same pair scores 0 there.
    default = rouge_scorer.RougeScorer(["rouge1"]).score(ref, hyp)
    assert default["rouge1"].fmeasure == 0.0


def test_rouge_on_chinese_is_per_character():
    # zh tokenizer splits ideographs: hyp 我/们/很/好, ref 我/们/好 -> R1: 3 shared, P=3/4, R=3/3,
    # F1 = 2*(3/4)*1/(3/4+1) = 6/7
    scores = corpus_scores(["我们很好。"], ["我们好。"], tgt_lang="zh")
    assert scores["rouge1"] == pytest.approx(100 * 6 / 7)


def test_rouge_on_english_agrees_with_rouge_score_default():
    refs = ["The cat sat on the mat.", "A quick brown fox jumps over 2 lazy dogs!"]
    hyps = ["the cat is on the mat", "quick brown foxes jump over two lazy dogs"]
    ours = corpus_scores(hyps, refs, tgt_lang="en")
    default = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for name in ("rouge1", "rouge2", "rougeL"):
        expected = np.mean([default.score(r, h)[name].fmeasure for h, r in zip(hyps, refs)]) * 100
        assert ours[name] == pytest.approx(expected)


def test_latin_tokenizer_keeps_unicode_letters():
    assert RougeTokenizer("ru").tokenize("Привет, мир! Ça_va 2x") == ["привет", "мир", "ça", "va", "2x"]


def _synthetic_test_set(n=300, seed=0):
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    refs = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n)]
    # Good system: exact on 2 of 3 sentences; poor system: exact on 1 of 3; the rest truncated.
    good = [r if i % 3 else " ".join(r.split()[:3]) for i, r in enumerate(refs)]
    poor = [r if i % 3 == 0 else " ".join(r.split()[:3]) for i, r in enumerate(refs)]
    return refs, good, poor


def test_paired_bootstrap_identical_systems_not_significant():
    refs, good, _ = _synthetic_test_set()
    p = paired_bootstrap(good, list(good), refs, tgt_lang="en")
    assert p == pytest.approx(1.0)


def test_paired_bootstrap_clearly_better_system_is_significant_both_ways():
    refs, good, poor = _synthetic_test_set()
    assert paired_bootstrap(poor, good, refs, tgt_lang="en") < 0.05
    assert paired_bootstrap(good, poor, refs, tgt_lang="en") < 0.05  # two-sided
    assert paired_bootstrap(poor, good, refs, tgt_lang="en", metric="rougeL") < 0.05


def test_paired_bootstrap_small_difference_not_significant():
    refs, good, _ = _synthetic_test_set()
    # Change a single sentence out of 300.
    nearly = list(good)
    nearly[1] = " ".join(nearly[1].split()[:-1])
    p = paired_bootstrap(good, nearly, refs, tgt_lang="en")
    assert p > 0.05


def test_bootstrap_is_seeded_and_interval_covers_score():
    refs, good, _ = _synthetic_test_set()
    stats = sentence_stats(good, refs, metric="bleu", tgt_lang="en")
    first = bootstrap_scores(stats, n_samples=200, seed=7)
    again = bootstrap_scores(stats, n_samples=200, seed=7)
    other = bootstrap_scores(stats, n_samples=200, seed=8)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    low, high = confidence_interval(first)
    assert low < stats.score < high
    assert stats.score == pytest.approx(corpus_scores(good, refs, tgt_lang="en")["bleu"])


def test_rouge_sentence_stats_match_corpus_score():
    refs, good, _ = _synthetic_test_set(n=50)
    stats = sentence_stats(good, refs, metric="rougeL", tgt_lang="en")
    assert stats.score == pytest.approx(corpus_scores(good, refs, tgt_lang="en")["rougeL"])
