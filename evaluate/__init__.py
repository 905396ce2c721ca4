"""Stage three: decode, score and compare trained runs.

    corpus_scores(hyps, refs, *, tgt_lang, task="translation", bleu_tokenize=None) -> dict
        sacrebleu BLEU (tokenizer by target language, signature recorded), chrF, ROUGE-1/2/L F1
    paired_bootstrap(hyps_a, hyps_b, refs, *, tgt_lang, metric="bleu", n_samples=1000, seed=12345) -> p-value
    evaluate_runs(run_dirs, *, out, test_sets=None, baseline=None, <decode settings>, batch_tokens,
                  progress=True) -> EvaluationResults
        results.md / results.csv / results.json, hyp.<run>.<test>.txt, scores.png, dev_loss.png,
        dev_loss.json in `out`
    summary_lines(results) -> list[str]   what to print after an evaluation: scores, delta and p, examples, plots
    score_evaluation(folder) -> EvaluationResults   scores what `evaluate_runs(score=False)` decoded elsewhere
    merge_evaluations(results_json_files, out) -> Report
        one table (results.md/csv/json, scores.png) from evaluations made apart, each fused run against its
        own seed's baseline, mean ± sd over seeds; mismatched inputs refused
    translate(run_dir, lines, *, <decode settings>, ...) -> list[str]   (PrLM features computed live)
    beam_search(model, src_tokens, prlm, ...), greedy(model, src_tokens, prlm, ...) -> list[list[int]]
    DecodeSettings: beam, lenpen, max_len_a/b, min_len, no_repeat_ngram_size and their defaults

Modules: settings (decode settings and defaults), runs (a run directory as evaluation reads it),
corpus_decode (decoding a whole test set), decode (beam search), metrics (scores, bootstrap
statistics), bootstrap (comparisons between runs), results (result rows, what their hypotheses show: distinct share,
most frequent hypothesis, copy share; and the files), plots,
evaluation (evaluate_runs), scoring (score_evaluation), report (merge_evaluations), summary (the printed
summary), live (translate).
Everything is imported on first use, so `import prlmfuse.evaluate` stays cheap.
"""

from __future__ import annotations

_LAZY = {
    "corpus_scores": "prlmfuse.evaluate.metrics",
    "paired_bootstrap": "prlmfuse.evaluate.metrics",
    "bleu_tokenizer_for": "prlmfuse.evaluate.metrics",
    "evaluate_runs": "prlmfuse.evaluate.evaluation",
    "merge_evaluations": "prlmfuse.evaluate.report",
    "score_evaluation": "prlmfuse.evaluate.scoring",
    "EvaluationResults": "prlmfuse.evaluate.results",
    "RunResult": "prlmfuse.evaluate.results",
    "DecodeSettings": "prlmfuse.evaluate.settings",
    "translate": "prlmfuse.evaluate.live",
    "summary_lines": "prlmfuse.evaluate.summary",
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
