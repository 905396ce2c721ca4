"""Scoring hypotheses decoded elsewhere: a GPU node without the metric's tokenizer (MeCab for Japanese BLEU)
decodes with `evaluate --no-score` and sends back its results folder; `score_evaluation` scores it here.

The folder's results.json names each run's hypothesis file and the references beside it (both checked by
sha256); every row is scored as `evaluate` would have scored it, compared with the baseline its evaluation
named, and the folder's results.md/csv/json and scores.png are rewritten: `prlmfuse report` then accepts it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.evaluate.bootstrap import add_bootstrap
from prlmfuse.evaluate.evaluation import score_hypotheses
from prlmfuse.evaluate.plots import plot_scores
from prlmfuse.evaluate.report import read_evaluation
from prlmfuse.evaluate.results import EvaluationResults, refresh_hypothesis_figures, write_results
from prlmfuse.fileio import read_lines
from prlmfuse.precision import machine_line

logger = logging.getLogger(__name__)


def score_evaluation(path: str | Path) -> EvaluationResults:
    """Score the results.json at `path` (or in the folder `path`) from its hypothesis and reference files."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    evaluation = read_evaluation(path, unscored=True)
    settings = dict(evaluation.settings)
    if settings.get("scored", True):
        raise UserError(f"{path} is already scored; `prlmfuse report` reads it as it is")
    bleu_tokenize = settings.get("bleu_tokenize")
    sentence_level, refs_sha = {}, {}
    baseline_of = {row.run: row.compared_with for row in evaluation.rows if row.compared_with}
    for row in evaluation.rows:
        hyps = read_lines(evaluation.folder / row.hyp_file, check_text=False) if row.num_sentences else []
        refs = read_lines(evaluation.folder / row.ref_file)
        scores, stats = score_hypotheses(hyps, refs, tgt_lang=row.tgt_lang, task=row.task, bleu_tokenize=bleu_tokenize)
        for metric in ("bleu", "chrf", "rouge1", "rouge2", "rougeL", "signature"):
            setattr(row, metric, scores[metric])
        refresh_hypothesis_figures(row, hyps)
        sentence_level[(row.run, row.test_set)] = stats
        refs_sha[(row.run, row.test_set)] = row.ref_sha256
        row.delta, row.p_value, row.compared_with = {}, {}, None
    add_bootstrap(evaluation.rows, sentence_level, refs_sha, baseline_of,
                  n_samples=int(settings["bootstrap_samples"]), seed=int(settings["seed"]))
    settings["scored"] = True
    settings["scored_on"] = machine_line("cpu")
    results = EvaluationResults(out=evaluation.folder, baseline=evaluation.baseline, rows=evaluation.rows,
                                settings=settings)
    write_results(results)
    plot_scores(results, evaluation.folder / "scores.png")
    logger.info("score: %d row(s) of %s scored", len(evaluation.rows), path)
    return results
