"""Stage three: decode, score and compare trained runs.

    corpus_scores(hyps, refs, *, tgt_lang, task="translation", bleu_tokenize=None) -> dict
        sacrebleu BLEU (tokenizer by target language, signature recorded), chrF, ROUGE-1/2/L F1
    paired_bootstrap(hyps_a, hyps_b, refs, *, tgt_lang, metric="bleu", n_samples=1000, seed=12345) -> p-value
    evaluate_runs(run_dirs, *, out, test_sets=None, baseline=None, beam=5, average_last=5, lenpen=1.0,
                  no_repeat_ngram_size=None, max_len_a=1.2, max_len_b=10, batch_tokens=4096, bf16=False,
                  progress=True) -> EvaluationResults
        results.md / results.csv / results.json, hyp.<run>.<test>.txt, scores.png, dev_loss.png in `out`
    translate(run_dir, lines, *, beam=5, average_last=5, ...) -> list[str]   (PrLM features computed live)
    beam_search(model, src_tokens, prlm, ...), greedy(model, src_tokens, prlm, ...) -> list[list[int]]

Modules: metrics (scores, bootstrap), jobs (batch evaluation), live (translate), decode (search).
Everything is imported on first use, so `import prlmfuse.evaluate` stays cheap.
"""

from __future__ import annotations

_LAZY = {
    "corpus_scores": "prlmfuse.evaluate.metrics",
    "paired_bootstrap": "prlmfuse.evaluate.metrics",
    "bleu_tokenizer_for": "prlmfuse.evaluate.metrics",
    "evaluate_runs": "prlmfuse.evaluate.jobs",
    "EvaluationResults": "prlmfuse.evaluate.jobs",
    "RunResult": "prlmfuse.evaluate.jobs",
    "translate": "prlmfuse.evaluate.live",
    "beam_search": "prlmfuse.evaluate.decode",
    "greedy": "prlmfuse.evaluate.decode",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prlmfuse.evaluate' has no attribute {name!r}")
