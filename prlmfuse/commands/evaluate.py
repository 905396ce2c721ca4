"""`prlmfuse evaluate`: stage three, decoding and scoring trained runs."""

from __future__ import annotations

import click

from prlmfuse.commands._common import (_decode_options, _device_option_alone, _print_summary, _variadic,
                                       creatable_dir)


@click.command()
@click.option("--runs", "runs", multiple=True, required=True, help="Run directories (several may follow).")
@click.argument("more_runs", nargs=-1)
@click.option("--out", required=True, type=click.Path(file_okay=False), callback=creatable_dir, help="Where results.md/csv/json and plots go.")
@click.option("--baseline", help="Run name to compare against (deltas, bootstrap p-values).")
@click.option("--split", "splits", multiple=True, type=click.Choice(["test", "dev"]),
              help="Which split to decode and score (repeat for both; default test). Choose settings on dev, "
              "report test.")
@click.option("--no-score", "no_score", is_flag=True,
              help="Decode only, on a machine without the metric's tokenizer (e.g. a GPU node without MeCab): "
              "hypotheses, references and an unscored results.json; `prlmfuse score OUT` scores them elsewhere.")
@click.option("--at-update", "at_update", type=click.IntRange(min=1),
              help="Decode every run as it was at this update, a budget it was trained to before training on "
              "(a step of a budget curve, `train --max-updates`): the average of its saves up to there, linked "
              "into RUN/budgets/ when it trained on. Refused for a run that kept none from there.")
@_decode_options
@_device_option_alone
def evaluate(runs, more_runs, out, baseline, splits, no_score, at_update, device, **decoding) -> None:
    """Stage three: decode and score every run on its test set (or dev); write results.md and plots."""
    from prlmfuse.evaluate import evaluate_runs

    results = evaluate_runs(_variadic(runs, more_runs), out=out, baseline=baseline, device=device or "auto",
                            test_sets=list(splits) or None, score=not no_score, at_update=at_update, **decoding)
    _print_summary(results)
