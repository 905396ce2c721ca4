"""`prlmfuse train`: stage two, training the runs of a pipeline file from its caches."""

from __future__ import annotations

import click

from prlmfuse.commands._common import (_budget_override, _device_option, _jobs_option, _launcher_option,
                                       _launcher_overrides, _load_pipeline, _max_updates_option, _no_wait_option,
                                       _precision_option, _split_names, creatable_parent)


@click.group(invoke_without_command=True)
@click.option("--pipeline", "-p", type=click.Path(dir_okay=False), help="Pipeline file (default: ./pipeline.yaml).")
@click.option("--runs", "runs", multiple=True, help="Run names, repeated or comma-separated (default: all).")
@click.option(
    "--resume/--fresh", "resume", default=True, show_default=True,
    help="Resume each run from its last checkpoint (the default: update count, learning-rate schedule and "
    "data order continue), or start runs over (the old run is kept until the new one saves a checkpoint).",
)
@_max_updates_option
@_jobs_option
@_launcher_option
@_no_wait_option
@_device_option
@_precision_option
@click.pass_context
def train(ctx, pipeline, runs, resume, max_updates, parallel, launcher, no_wait, device, precision) -> None:
    """Stage two: train the runs of a pipeline file from its caches (no PrLM is loaded).

    Runs resume from their last checkpoint by default (`--resume`); `--fresh` starts them over.
    Data and caches must exist: `prlmfuse run --only cache`.
    `prlmfuse train average RUN_DIR` averages a run's last checkpoints; `prlmfuse train curve RUN_DIR` shows
    how much its dev loss still falls.
    """
    if ctx.invoked_subcommand is not None:
        return
    from prlmfuse.pipeline import train_runs

    cfg = _launcher_overrides(_budget_override(_load_pipeline(pipeline, device, precision), max_updates), launcher, no_wait)
    train_runs(cfg, names=_split_names(runs), resume=resume, parallel=parallel or cfg.train.jobs, wait=not no_wait)


@train.command("average")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--last", default=5, show_default=True, type=click.IntRange(min=1),
              help="How many of the newest checkpoints to average (fewer if fewer exist).")
@click.option("--epochs", is_flag=True, help="Average the newest checkpoints saved at an epoch end instead.")
@click.option("--out", type=click.Path(dir_okay=False), callback=creatable_parent,
              help="Output file (default: RUN_DIR/average-lastK.safetensors, with --epochs average-epochsK.safetensors).")
def train_average(run_dir: str, last: int, epochs: bool, out: str | None) -> None:
    """Average the last K checkpoints (or epoch-end checkpoints) of a run into one safetensors file."""
    from prlmfuse.train_fused import average_checkpoints

    click.echo(average_checkpoints(run_dir, last=last, out=out, average="epochs" if epochs else "saves"))


@train.command("curve")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...", type=click.Path(file_okay=False, exists=True))
@click.option("--over", default=1000, show_default=True, type=click.IntRange(min=1),
              help="The span of updates each gain is measured over.")
@click.option("--below", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="The gain, in percent, under which the curve counts as flat.")
@click.option("--nll", is_flag=True, help="Read the dev NLL instead of the (label-smoothed) loss trained on: "
                                          "runs of different label smoothing compare on it.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), callback=creatable_parent,
              help="Also write every run's curve to this file: [update, loss, gain] with gains and --below as "
                   "fractions, and its flat point.")
def train_curve(run_dirs: tuple[str, ...], over: int, below: float, nll: bool, json_out: str | None) -> None:
    """Each run's dev loss at every dev evaluation with its gain over the last --over updates, and the first
    update where that gain fell under --below percent: the rule that fixes a budget from a baseline's dev curve."""
    from pathlib import Path

    from prlmfuse.fileio import atomic_write_json
    from prlmfuse.train_fused.dev_curve import dev_curve

    curves = [dev_curve(d, over=over, below=below / 100, nll=nll) for d in run_dirs]  # every one read before any output
    for curve in curves:
        click.echo(f"{curve.run_dir}: {curve.key}, gain over {over:,} updates")
        click.echo(f"  {'update':>8}  {'loss':>7}  {'gain':>7}")
        for p in curve.points:
            gain = "-" if p.gain is None else f"{100 * p.gain:.2f}%"  # two decimals: 0.96% and 1.04% differ
            click.echo(f"  {p.update:>8,}  {p.loss:>7.4f}  {gain:>7}")
        last = curve.points[-1]
        if curve.flat_at is not None:
            click.echo(f"  flat at update {curve.flat_at:,}: its first gain under {below:g}% over {over:,} updates")
            at = [p.update for p in curve.points].index(curve.flat_at)  # >= 1: the first evaluation has no gain
            flat, before = curve.points[at], curve.points[at - 1]
            if flat.loss > before.loss:  # a budget fixed here rests on one evaluation's noise
                click.echo(f"  its dev loss rose there ({flat.loss:.4f}, after {before.loss:.4f} at update "
                           f"{before.update:,}): one evaluation can trip the rule, so read the gains after it")
        elif last.gain is None:
            click.echo(f"  not flat: no gain over {over:,} updates yet (its last evaluation is at update {last.update:,})")
        else:
            click.echo(f"  not flat: its last evaluation (update {last.update:,}) still gains {100 * last.gain:.2f}% "
                       f"over {over:,} updates")
    if json_out:
        atomic_write_json(Path(json_out), {str(c.run_dir): c.to_dict() for c in curves})
        click.echo(f"curves: {json_out}")
