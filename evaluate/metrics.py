"""Corpus scoring (sacrebleu BLEU / chrF, rouge-score ROUGE) and paired bootstrap resampling.

Everything here scores detokenized text: the caller decodes BPE back to plain text first, and the
references are the corpus's own target lines, never a BPE round trip of them.

BLEU's tokenizer follows the target language the way the WMT/WAT conventions do ('zh' for
Chinese, MeCab for Japanese and Korean, '13a' otherwise). ROUGE goes through rouge-score with
our own tokenizer object, because rouge-score's default tokenizer keeps only [a-z0-9] and would
score every Japanese, Chinese or Korean summary 0.

The paired bootstrap is our own (Koehn 2004) rather than sacrebleu's `paired_bs`: sacrebleu's
test centres the sampled |differences| and counts strictly greater ones, which reports two
identical systems as p = 0.001 ("significant"). Here identical systems give p = 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import sacrebleu
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU, CHRF

from prlmfuse.errors import UserError

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
BOOTSTRAP_METRICS = ("bleu", "chrf") + ROUGE_TYPES
DEFAULT_SEED = 12345

# ISO 639-1/-2/-3 spellings people use in corpus.json, folded onto the codes we key on.
_LANG_ALIASES = {
    "jpn": "ja", "jp": "ja",
    "zho": "zh", "chi": "zh", "cmn": "zh", "yue": "zh",
    "kor": "ko", "kr": "ko",
}
_BLEU_TOKENIZER_BY_LANG = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}


def normalize_lang(lang: str | None) -> str:
    """'ja-JP' / 'jpn' / 'zh_Hans' -> 'ja' / 'ja' / 'zh'; unknown codes pass through lowercased."""
    if not lang:
        return ""
    base = re.split(r"[-_]", str(lang).strip().lower())[0]
    return _LANG_ALIASES.get(base, base)


def bleu_tokenizer_for(tgt_lang: str | None) -> str:
    """The sacrebleu tokenizer that fits the target language."""
    return _BLEU_TOKENIZER_BY_LANG.get(normalize_lang(tgt_lang), "13a")


def _check_bleu_tokenize(name: str) -> str:
    known = list(sacrebleu.metrics.bleu._TOKENIZERS)
    if name not in known:
        raise UserError(f"unknown BLEU tokenizer {name!r}; use one of {', '.join(known)}")
    return name


def check_bleu_tokenizer(tgt_lang: str | None, bleu_tokenize: str | None = None) -> str:
    """The BLEU tokenizer scoring a target language uses, once it has been seen to run here (UserError where
    it cannot: MeCab or its dictionary missing)."""
    tokenize = _check_bleu_tokenize(bleu_tokenize or bleu_tokenizer_for(tgt_lang))
    _make_bleu(tokenize)
    return tokenize


def _make_bleu(tokenize: str, **kwargs) -> BLEU:
    try:
        return BLEU(tokenize=tokenize, **kwargs)
    except RuntimeError as e:
        # sacrebleu raises RuntimeError with a multi-line hint when MeCab-ko (or similar) is missing.
        hint = " ".join(str(e).split())
        raise UserError(
            f"BLEU tokenizer {tokenize!r} is not usable here ({hint}); "
            f"install it or choose another tokenizer, e.g. bleu_tokenize='13a'"
        ) from None


# ---------------------------------------------------------------------------------------------
# ROUGE tokenization


class RougeTokenizer:
    """A rouge-score tokenizer object (anything with `tokenize(text) -> list[str]`) that keeps
    non-Latin text.

    Japanese, Chinese and Korean go through the same sacrebleu tokenizer as BLEU (MeCab for
    ja/ko, per-character for Chinese ideographs) and are then split on spaces; every other
    language is lowercased and split on non-word characters, where `\\w` is Unicode-aware so
    Cyrillic, Greek, Devanagari... letters survive. Tokens without a word character
    (punctuation like '。' or '、') are dropped, as rouge-score's default tokenizer does for
    Latin punctuation.
    """

    def __init__(self, tgt_lang: str | None):
        self.lang = normalize_lang(tgt_lang)
        tok_name = _BLEU_TOKENIZER_BY_LANG.get(self.lang)
        self._segmenter: Callable[[str], str] | None = None
        if tok_name is not None:
            # Reuse BLEU's tokenizer instance; building it also reports a missing MeCab cleanly.
            self._segmenter = _make_bleu(tok_name).tokenizer
            self.name = self._segmenter.signature()
        else:
            self.name = "lc-unicode-words"

    def tokenize(self, text: str) -> list[str]:
        text = text.lower()
        if self._segmenter is not None:
            return [tok for tok in self._segmenter(text.strip()).split() if _WORD_CHAR.search(tok)]
        return [tok for tok in _NON_WORD.split(text) if tok]


_WORD_CHAR = re.compile(r"\w")
_NON_WORD = re.compile(r"[\W_]+")


# ---------------------------------------------------------------------------------------------
# Corpus scores


def _reference_streams(refs, num_hyps: int) -> list[list[str]]:
    """Accept one reference per sentence (list[str]) or sacrebleu-style streams (list[list[str]])."""
    if len(refs) > 0 and all(isinstance(r, str) for r in refs):
        streams = [list(refs)]
    else:
        streams = [list(stream) for stream in refs]
    if not streams:
        raise UserError("no references given; pass the test set's target lines")
    for i, stream in enumerate(streams):
        if len(stream) != num_hyps:
            raise UserError(
                f"reference stream {i} has {len(stream)} lines but there are {num_hyps} hypotheses; "
                f"hypotheses and references must be line-aligned"
            )
    return streams


def corpus_scores(
    hyps: Sequence[str],
    refs,
    *,
    tgt_lang: str | None,
    task: str = "translation",
    bleu_tokenize: str | None = None,
) -> dict:
    """Score detokenized hypotheses against references.

    refs: one reference per hypothesis (list[str]) or several reference streams
    (list[list[str]], each aligned with hyps), as in sacrebleu.
    Returns {"bleu", "chrf", "rouge1", "rouge2", "rougeL", "num_sentences", "task",
    "bleu_tokenize", "signature": {"bleu", "chrf", "rouge"}}; scores are 0-100.
    """
    hyps = list(hyps)
    streams = _reference_streams(refs, len(hyps))
    tokenize = _check_bleu_tokenize(bleu_tokenize or bleu_tokenizer_for(tgt_lang))

    bleu = _make_bleu(tokenize)
    bleu_score = bleu.corpus_score(hyps, streams)
    chrf = CHRF()
    chrf_score = chrf.corpus_score(hyps, streams)

    rouge_tokenizer = RougeTokenizer(tgt_lang)
    rouge_f1 = _rouge_sentence_f1(hyps, streams, rouge_tokenizer)
    rouge = {name: float(values.mean() * 100.0) if len(values) else 0.0 for name, values in rouge_f1.items()}

    return {
        "bleu": float(bleu_score.score),
        "chrf": float(chrf_score.score),
        **rouge,
        "num_sentences": len(hyps),
        "task": task,
        "bleu_tokenize": tokenize,
        "signature": {
            "bleu": str(bleu.get_signature()),
            "chrf": str(chrf.get_signature()),
            "rouge": _rouge_signature(rouge_tokenizer, len(streams)),
        },
    }


def _rouge_signature(tokenizer: RougeTokenizer, nrefs: int) -> str:
    from importlib.metadata import version

    try:
        rouge_version = version("rouge-score")
    except Exception:  # pragma: no cover - only when installed without metadata
        rouge_version = "unknown"
    return f"nrefs:{nrefs}|tok:{tokenizer.name}|f1|agg:mean|multiref:max|version:rouge-score-{rouge_version}"


def _rouge_sentence_f1(
    hyps: Sequence[str], streams: list[list[str]], tokenizer: RougeTokenizer
) -> dict[str, np.ndarray]:
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=tokenizer)
    f1 = {name: np.zeros(len(hyps), dtype=np.float64) for name in ROUGE_TYPES}
    for i, hyp in enumerate(hyps):
        if len(streams) == 1:
            scores = scorer.score(streams[0][i], hyp)  # rouge-score takes (target, prediction)
        else:
            scores = scorer.score_multi([s[i] for s in streams], hyp)
        for name in ROUGE_TYPES:
            f1[name][i] = scores[name].fmeasure
    return f1


# ---------------------------------------------------------------------------------------------
# Bootstrap resampling


@dataclass
class SentenceStats:
    """Additive per-sentence statistics of one system on one test set, for resampling.

    A corpus score is a function of the column sums of `stats` over the sentences in a sample:
    BLEU / chrF n-gram counts (sacrebleu's sufficient statistics), or ROUGE F1 (averaged).
    """

    metric: str
    stats: np.ndarray  # [num_sentences, k]
    score: float  # corpus score over the whole test set
    _score_from_sums: Callable[[np.ndarray, int], float] = field(repr=False)

    @property
    def num_sentences(self) -> int:
        return int(self.stats.shape[0])

    def score_from_sums(self, summed: np.ndarray, num_sentences: int) -> float:
        return self._score_from_sums(summed, num_sentences)


def comparison_stats(hyps: Sequence[str], refs, *, task: str, tgt_lang: str | None,
                     bleu_tokenize: str | None = None) -> dict[str, SentenceStats]:
    """Per-sentence statistics of what a run's comparisons resample: BLEU, and ROUGE-L for summarization."""
    if not len(hyps):
        return {}
    tested = ("bleu", "rougeL") if task == "summarization" else ("bleu",)
    return {m: sentence_stats(hyps, refs, metric=m, tgt_lang=tgt_lang, bleu_tokenize=bleu_tokenize) for m in tested}


def sentence_stats(
    hyps: Sequence[str],
    refs,
    *,
    metric: str = "bleu",
    tgt_lang: str | None = None,
    bleu_tokenize: str | None = None,
) -> SentenceStats:
    """Per-sentence statistics for `metric` in BOOTSTRAP_METRICS."""
    hyps = list(hyps)
    streams = _reference_streams(refs, len(hyps))
    if metric in ("bleu", "chrf"):
        if metric == "bleu":
            tokenize = _check_bleu_tokenize(bleu_tokenize or bleu_tokenizer_for(tgt_lang))
            scorer = _make_bleu(tokenize)
        else:
            scorer = CHRF()
        # sacrebleu's own sufficient statistics; its significance module uses the same two calls.
        stats = np.asarray(scorer._extract_corpus_statistics(hyps, streams), dtype=np.float64)
        stats = stats.reshape(len(hyps), -1)

        def from_sums(summed: np.ndarray, n: int, _scorer=scorer) -> float:
            return float(_scorer._compute_score_from_stats(summed.tolist()).score)

        score = from_sums(stats.sum(0), len(hyps)) if len(hyps) else 0.0
    elif metric in ROUGE_TYPES:
        f1 = _rouge_sentence_f1(hyps, streams, RougeTokenizer(tgt_lang))[metric]
        stats = f1.reshape(-1, 1) * 100.0

        def from_sums(summed: np.ndarray, n: int) -> float:
            return float(summed[0] / n) if n else 0.0

        score = from_sums(stats.sum(0), len(hyps))
    else:
        raise UserError(f"unknown bootstrap metric {metric!r}; use one of {', '.join(BOOTSTRAP_METRICS)}")
    return SentenceStats(metric=metric, stats=stats, score=score, _score_from_sums=from_sums)


def _resample_counts(num_sentences: int, n_samples: int, seed: int):
    """Yield [chunk, num_sentences] matrices: how often each sentence is drawn in each sample.

    Drawing counts from a multinomial is the same distribution as drawing indices with
    replacement, and turns every sample's statistic sums into one matrix product. The chunking
    depends on num_sentences only, so two systems on one test set see identical samples (the
    'paired' in paired bootstrap).
    """
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_samples, 4_000_000 // max(1, num_sentences)))
    pvals = np.full(num_sentences, 1.0 / num_sentences)
    done = 0
    while done < n_samples:
        size = min(chunk, n_samples - done)
        yield rng.multinomial(num_sentences, pvals, size=size).astype(np.float64)
        done += size


def bootstrap_scores(stats: SentenceStats, *, n_samples: int = 1000, seed: int = DEFAULT_SEED) -> np.ndarray:
    """Corpus scores of `n_samples` resampled test sets (with replacement, same size)."""
    n = stats.num_sentences
    if n == 0:
        raise UserError("cannot bootstrap an empty test set; check the test files")
    out = np.empty(n_samples, dtype=np.float64)
    done = 0
    for counts in _resample_counts(n, n_samples, seed):
        sums = counts @ stats.stats
        for row in sums:
            out[done] = stats.score_from_sums(row, n)
            done += 1
    return out


def confidence_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval."""
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def paired_p_value(samples_baseline: np.ndarray, samples_system: np.ndarray) -> float:
    """Two-sided paired bootstrap p-value for 'the system scores differently from the baseline'.

    One-sided, Koehn (2004): the fraction of resampled test sets on which the system is NOT
    better. Two-sided doubles the smaller tail. Ties count against both directions, so two
    identical systems get p = 1; +1 in numerator and denominator keeps p > 0 for a finite
    number of samples.
    """
    delta = np.asarray(samples_system) - np.asarray(samples_baseline)
    n = len(delta)
    not_better = (np.count_nonzero(delta <= 0) + 1) / (n + 1)
    not_worse = (np.count_nonzero(delta >= 0) + 1) / (n + 1)
    return float(min(1.0, 2.0 * min(not_better, not_worse)))


def paired_bootstrap(
    hyps_a: Sequence[str],
    hyps_b: Sequence[str],
    refs,
    *,
    tgt_lang: str | None = None,
    metric: str = "bleu",
    n_samples: int = 1000,
    seed: int = DEFAULT_SEED,
    bleu_tokenize: str | None = None,
) -> float:
    """p-value of the paired bootstrap test between system A (the baseline) and system B."""
    if len(hyps_a) != len(hyps_b):
        raise UserError(
            f"the two systems have {len(hyps_a)} and {len(hyps_b)} hypotheses; "
            f"paired bootstrap needs both decoded on the same test set"
        )
    stats_a = sentence_stats(hyps_a, refs, metric=metric, tgt_lang=tgt_lang, bleu_tokenize=bleu_tokenize)
    stats_b = sentence_stats(hyps_b, refs, metric=metric, tgt_lang=tgt_lang, bleu_tokenize=bleu_tokenize)
    return paired_p_value(
        bootstrap_scores(stats_a, n_samples=n_samples, seed=seed),
        bootstrap_scores(stats_b, n_samples=n_samples, seed=seed),
    )
