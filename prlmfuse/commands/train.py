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
    `prlmfuse train average RUN_DIR` averages a run's last checkpoints.
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
