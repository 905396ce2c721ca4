"""Options and helpers that several commands share: the pipeline file, --jobs, --device, --precision,
the decoding options of `evaluate` and `translate`, and the evaluation summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

DEFAULT_PIPELINE = "pipeline.yaml"
# The demo pipeline ships beside the package's modules (package-data), one folder up from here.
_PACKAGED_PIPELINE = Path(__file__).parent.parent / "pipeline.yaml"


def _pipeline_path(path: str | None) -> Path:
    """The pipeline file given, else ./pipeline.yaml, else the demo that ships inside the package."""
    if path:
        return Path(path)
    if Path(DEFAULT_PIPELINE).is_file():
        return Path(DEFAULT_PIPELINE)
    return _PACKAGED_PIPELINE


def _load_pipeline(path: str | None, device: str | None, precision: str | None):
    """The pipeline config of _pipeline_path(path), with the command line's --device / --precision."""
    from prlmfuse.config import load_pipeline

    file = _pipeline_path(path)
    cfg = load_pipeline(file)
    if file == _PACKAGED_PIPELINE:
        # The shipped demo's workdir is relative to the current directory: the installed package's
        # own directory may be read-only, and is no place for a user's data and runs.
        cfg.workdir = Path.cwd() / cfg.workdir.relative_to(_PACKAGED_PIPELINE.resolve().parent)
    return _runtime_overrides(cfg, device, precision)


def creatable_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --out / OUT directory the command can make: one line naming why not, before any work starts.
    An fsspec URL (s3://...) is its backend's to check."""
    if value is not None and "://" not in value:
        check_creatable(Path(value))
    return value


def creatable_parent(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output the command writes whole (a file, or a directory that appears once complete): its folder
    can be made, or one line names why not."""
    if value is not None and "://" not in value:
        check_creatable(Path(value).absolute().parent)
    return value


def check_creatable(path: Path) -> None:
    """UserError unless `path` is a directory or can be made one. Nothing is left behind: the first
    missing folder is made and removed again, as the surest test of whether the command could."""
    import errno
    import os

    from prlmfuse.errors import UserError

    path = path.absolute()
    existing, missing = path, None
    while not existing.exists():
        existing, missing = existing.parent, existing
    if not existing.is_dir():
        raise UserError(f"{existing} is a file where a directory is expected; choose another path or move the file")
    if missing is None:
        return
    try:
        os.mkdir(missing)
        os.rmdir(missing)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write {path} ({e.strerror}); choose a writable location or fix the permissions "
                            "of the directory") from None
        raise UserError(f"cannot create {path} ({e.strerror or e}); choose a writable location") from None


def _variadic(first: tuple[str, ...], rest: tuple[str, ...]) -> list[str]:
    # `--runs a b c` reads as --runs a plus the extra arguments b c: click has no variadic options.
    return [*first, *rest]


# `train` and `run` take the same option.
_jobs_option = click.option(
    "--jobs", "-j", "parallel", type=click.IntRange(min=1),
    help="Train this many runs at once, each in its own process with cores/JOBS threads (log: runs/NAME/train.log). "
    "Default: the pipeline file's train.jobs, else 1.",
)


# `run`, `train` and `search` launch alike.
_launcher_option = click.option(
    "--launcher", type=click.Choice(["local", "slurm"]), default=None,
    help="Where the runs (search: its workers) run: local child processes (--jobs at once), or slurm: one SLURM job "
    "array through submitit, each task the same command, requeued with a resume point when preempted or out of "
    "time (the `search` extra). Default: the pipeline file's launcher.kind, else local.",
)
_no_wait_option = click.option(
    "--no-wait", "no_wait", is_flag=True,
    help="With --launcher slurm: return once the array is submitted; the same command run again once it has ended "
    "goes on from what it finished.",
)


def _launcher_overrides(cfg, launcher: str | None, no_wait: bool):
    """The pipeline config with --launcher in place of the file's launcher.kind; --no-wait needs slurm."""
    from prlmfuse.errors import UserError

    if launcher is not None:
        cfg.launcher.kind = launcher
    if cfg.launcher.kind == "slurm":
        from prlmfuse.launch import require

        require("submitit", "--launcher slurm")  # one line naming the extra, before any work
    if no_wait and cfg.launcher.kind != "slurm":
        raise UserError("--no-wait needs --launcher slurm (or launcher.kind: slurm): local children end with the "
                        "command that starts them")
    return cfg


# Every stage takes the device; the stages that choose a compute precision take that too.
_DEVICE_HELP = ("auto (CUDA when torch sees one, else CPU), cpu, cuda or cuda:N; under torchrun cuda is each rank's "
                "LOCAL_RANK GPU.")
_device_option = click.option(
    "--device", default=None, metavar="DEVICE",
    help=_DEVICE_HELP + " Overrides the pipeline file's `device` (default: auto).",
)
# The commands that read no pipeline file have no `device` of a file to override.
_device_option_alone = click.option("--device", default=None, metavar="DEVICE", help=_DEVICE_HELP + " Default: auto.")
_precision_option = click.option(
    "--precision", default=None, type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
    help="Autocast precision; auto is bf16 where the device multiplies it fast, fp16 on GPUs without bf16, "
    "else fp32. Overrides the pipeline file's `precision` (default: auto).",
)


_max_updates_option = click.option(
    "--max-updates", "max_updates", type=click.IntRange(min=1),
    help="Train each run to this many updates this time, in place of the pipeline file's max_updates (the run's "
    "max_epochs, 50 unless the file sets it null, still stops it first). A run resumes where it stopped and the "
    "learning rate does not depend on the budget, so a budget curve is one run trained on in steps of save_every "
    "multiples (the saves an average reads are then a straight run's), each step evaluated into its own --out. "
    "A step's saves outlive training on: `evaluate --at-update N` decodes the run as it was there.",
)


def _budget_override(cfg, max_updates: int | None):
    """The pipeline config with the command line's --max-updates as every run's budget."""
    if max_updates is not None:
        cfg.train.runs = [dataclasses.replace(run, max_updates=max_updates) for run in cfg.train.runs]
        cfg.train.max_updates_override = max_updates
    return cfg


def _runtime_overrides(cfg, device: str | None, precision: str | None):
    """The pipeline config with the command line's --device / --precision in place of the file's."""
    from prlmfuse.precision import check_device_text

    if device is not None:
        cfg.device = check_device_text(device)
    if precision is not None:
        cfg.precision = precision
    return cfg


def _split_names(values: tuple[str, ...]) -> list[str] | None:
    names = [n for v in values for n in v.split(",") if n]
    return names or None


def _decode_options(command):
    """`evaluate` and `translate` decode alike: the same options, with the defaults of evaluate/settings.py."""
    from prlmfuse.evaluate.settings import AVERAGE, AVERAGE_CHOICES, AVERAGE_LAST, DEFAULTS, SUMMARIZATION_NO_REPEAT_NGRAM

    options = [
        click.option("--beam", default=DEFAULTS.beam, show_default=True, type=click.IntRange(min=1), help="Beam size; 1 is greedy decoding."),
        click.option("--lenpen", default=DEFAULTS.lenpen, show_default=True, help="Length penalty: a hypothesis scores log-prob / length^LENPEN."),
        click.option("--max-len-a", default=DEFAULTS.max_len_a, show_default=True, type=click.FloatRange(min=0),
                     help="Output length limit: at most MAX_LEN_A * source length + MAX_LEN_B tokens."),
        click.option("--max-len-b", default=DEFAULTS.max_len_b, show_default=True, type=click.IntRange(min=0),
                     help="See --max-len-a."),
        click.option("--min-len", default=DEFAULTS.min_len, show_default=True, type=click.IntRange(min=0), help="At least this many tokens before </s>."),
        click.option("--no-repeat-ngram-size", type=click.IntRange(min=0),
                     help=f"Block repeated n-grams (default: {SUMMARIZATION_NO_REPEAT_NGRAM} for summarization runs, "
                     f"else {DEFAULTS.no_repeat_ngram_size})."),
        click.option("--average-last", default=AVERAGE_LAST, show_default=True, type=click.IntRange(min=0),
                     help="Average this many newest checkpoints (0: best)."),
        click.option("--average", default=AVERAGE, show_default=True, type=click.Choice(AVERAGE_CHOICES),
                     help="Which checkpoints --average-last counts: the newest saves, or those saved at an epoch end."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _print_summary(results) -> None:
    """The evaluation summary that `evaluate` and `run` print."""
    from prlmfuse.evaluate import summary_lines

    for line in summary_lines(results):
        click.echo(line)
