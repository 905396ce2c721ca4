"""`prlmfuse run`: a whole pipeline file, every stage in turn."""

from __future__ import annotations

from pathlib import Path

import click

from prlmfuse.commands._common import (_budget_override, _device_option, _jobs_option, _launcher_option,
                                       _launcher_overrides, _load_pipeline, _max_updates_option, _no_wait_option,
                                       _precision_option, _print_summary, _split_names, _variadic)
from prlmfuse.errors import UserError


@click.command()
@click.argument("pipeline", required=False, type=click.Path(dir_okay=False))
@click.option("--only", type=click.Choice(["data", "cache", "train", "evaluate"]), help="Run one stage only.")
@click.option("--runs", "runs", multiple=True, help="Only these training runs (several may follow); only the caches they read are built.")
@click.argument("more_runs", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Print the plan: device and precision, caches present, runs to train or resume, estimates.")
@click.option("--no-score", "no_score", is_flag=True,
              help="Evaluate by decoding only, on a machine without the metric's tokenizer (a GPU node without MeCab); "
              "`prlmfuse score` scores the results folder elsewhere.")
@_max_updates_option
@_jobs_option
@_launcher_option
@_no_wait_option
@_device_option
@_precision_option
def run(pipeline, only, runs, more_runs, dry_run, no_score, max_updates, parallel, launcher, no_wait, device,
        precision) -> None:
    """Run a whole pipeline file: data -> cache -> train -> evaluate -> report.

    Finished steps are skipped, so running it again when all is done takes seconds.
    PIPELINE defaults to ./pipeline.yaml, else the demo shipped with prlmfuse (workdir ./work/demo).
    After an evaluation it prints a summary: where results.md is, each run's score with delta and p,
    two test sentences translated by every run beside the reference, and the plots.
    """
    from prlmfuse.pipeline import run_pipeline
    from prlmfuse.plan import plan_lines

    if pipeline and runs and not Path(pipeline).exists():
        # click gives the first name after `--runs NAME` to PIPELINE when no file came before it.
        names = " ".join((*runs, pipeline, *more_runs))
        raise UserError(f"pipeline file not found: {pipeline}; to select several runs, name the pipeline file first "
                        f"(`prlmfuse run pipeline.yaml --runs {names}`) or join them with commas "
                        f"(`--runs {names.replace(' ', ',')}`)")
    cfg = _launcher_overrides(_budget_override(_load_pipeline(pipeline, device, precision), max_updates), launcher, no_wait)
    names = _split_names(tuple(_variadic(runs, more_runs)))
    if dry_run:
        for line in plan_lines(cfg, names, parallel or cfg.train.jobs):
            click.echo(line)
        return
    results = run_pipeline(cfg, only=only, names=names, parallel=parallel or cfg.train.jobs, score=not no_score,
                           wait=not no_wait)
    if results is not None:
        click.echo("")
        _print_summary(results)
