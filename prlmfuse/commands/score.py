"""`prlmfuse score`: score hypotheses that `evaluate --no-score` decoded on a machine without the metric's tokenizer."""

from __future__ import annotations

import click


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
def score(results: tuple[str, ...]) -> None:
    """Score each RESULTS (a folder written by `evaluate --no-score`, or its results.json) in place.

    A GPU node without MeCab decodes with `prlmfuse evaluate --no-score` and sends back that folder
    (hypotheses, references, results.json); here each run is scored as `evaluate` scores it and
    compared with the baseline its evaluation named. `prlmfuse report` then merges the folders.
    """
    from prlmfuse.commands._common import _print_summary
    from prlmfuse.evaluate import score_evaluation

    for path in results:
        _print_summary(score_evaluation(path))
