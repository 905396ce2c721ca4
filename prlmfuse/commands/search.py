"""`prlmfuse search`: a pruned search over the fusion settings of a pipeline file's `search:` section."""

from __future__ import annotations

import click

from prlmfuse.commands._common import (_device_option, _launcher_option, _launcher_overrides, _load_pipeline,
                                       _no_wait_option, _precision_option, _print_summary)


@click.command()
@click.argument("pipeline", required=False, type=click.Path(dir_okay=False))
@click.option("--jobs", "-j", "parallel", type=click.IntRange(min=1),
              help="Trials trained at once: worker processes (or SLURM array tasks) sharing the study's journal, "
              "each with cores/JOBS threads. Default: the file's search.jobs, else 1.")
@click.option("--dry-run", is_flag=True, help="Print the space, its size, each trial's state and parameters, and the "
              "most updates the search can spend against the full grid's.")
@click.option("--confirm", is_flag=True, help="Once every trial has ended: train the best setting, the plain baseline "
              "and the baseline matched to the best's parameters to the full budget, and evaluate them on test "
              "(paired bootstrap against the plain baseline).")
@click.option("--check-pruned", "check_pruned", type=click.IntRange(min=1), metavar="N",
              help="Once every trial has ended: train the N pruned trials that came nearest to going on (the highest "
              "rung, then the lowest dev loss there) on to the full budget, each from a copy of its run directory, "
              "and show their dev loss beside the best's: whether the pruner stopped a better setting.")
@click.option("--no-score", "no_score", is_flag=True, help="With --confirm: decode without scoring (`prlmfuse score` "
              "scores the folder elsewhere).")
@_launcher_option
@_no_wait_option
@click.option("--worker", is_flag=True, hidden=True, help="Train trials of the study until none is left (a worker).")
@click.option("--train-run", "train_run", hidden=True, help="Train one of --confirm's runs here (its child).")
@click.option("--check-run", "check_run", hidden=True, help="Train one pruned trial on here (a --check-pruned child).")
@_device_option
@_precision_option
def search(pipeline, parallel, dry_run, confirm, check_pruned, no_score, launcher, no_wait, worker, train_run, check_run,
           device, precision) -> None:
    """Which fusion setting pays on this corpus: train every setting of the pipeline file's `search:` grid from
    the cache, stopping the weak ones early (successive halving or hyperband on the dev loss at each rung).

    Each setting is a run (runs/NAME-001/ ...). The study is a journal file in WORKDIR/search/NAME/: the
    same command resumes a killed or preempted search (finished and pruned trials kept, a running one
    resumed from its checkpoint), and several workers share it. The end is a table of every trial
    (WORKDIR/search/NAME/trials.md and .json) with the best setting and the updates spent; --check-pruned N adds
    the N nearest-to-going-on pruned settings trained to the full budget. Test is never read, until --confirm.
    Needs optuna (and submitit for --launcher slurm): pip install 'prlmfuse[search]'.
    """
    from prlmfuse import search as searching

    cfg = _launcher_overrides(_load_pipeline(pipeline, device, precision), launcher, no_wait)
    searching.the_search(cfg)
    if train_run:
        searching.train_confirm_run(cfg, train_run)
        return
    if check_run:
        searching.train_check_run(cfg, check_run)
        return
    if worker:
        searching.work(cfg)
        return
    if dry_run:
        for line in searching.dry_run_lines(cfg):
            click.echo(line)
        return
    table = searching.run_search(cfg, jobs=parallel, wait=not no_wait, confirm=confirm, score=not no_score,
                                 check=check_pruned or 0)
    if table is None:
        return
    click.echo("")
    for line in searching.summary_lines(table):
        click.echo(line)
    click.echo(f"table: {searching.search_dir(cfg) / searching.TABLE_MD} (and {searching.TABLE_JSON})")
    if table.get("confirm") is not None:
        click.echo("")
        _print_summary(table["confirm"])
