"""The `prlmfuse` command. It parses arguments and calls the library; the library does the work.

Every UserError becomes one line on stderr and exit status 2, with no traceback. The library
reports progress through `logging`; this module shows the `prlmfuse` loggers' records on stderr,
INFO and up by default (`--quiet`: warnings only, `--verbose`: debug).

The commands live in `prlmfuse.commands`, one module per command group; this module holds the root
group, registers them, and turns errors into exit statuses. The stage packages (cache_features,
train_fused, evaluate) and the pipeline import torch, so they are imported inside the commands
that use them: `prlmfuse --help` and `checkpoints list` start fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

# oneDNN and ideep keep a compiled kernel for every matmul shape they meet (1,024 of each by default),
# and token-budget batches bring new shapes at almost every step, so uncapped caches grow the training
# process with each new shape while hardly ever being hit; set here, before any stage imports torch.
for _cache_capacity in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache_capacity, "64")

import click

from prlmfuse import __version__, signals
from prlmfuse.commands.bundle import bundle
from prlmfuse.commands.cache import cache
from prlmfuse.commands.checkpoints import checkpoints
from prlmfuse.commands.data import data
from prlmfuse.commands.evaluate import evaluate
from prlmfuse.commands.report import report
from prlmfuse.commands.run import run
from prlmfuse.commands.score import score
from prlmfuse.commands.search import search
from prlmfuse.commands.train import train
from prlmfuse.commands.translate import translate
from prlmfuse.errors import UserError


class _EchoHandler(logging.Handler):
    """Writes log records with click.echo to whatever stderr is at the time of the record."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(self.format(record), err=True)
        except Exception:  # logging must never take the command down
            self.handleError(record)


class _Formatter(logging.Formatter):
    """The message alone; warnings and worse start with their level, like `error:` lines do."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return f"{record.levelname.lower()}: {message}" if record.levelno >= logging.WARNING else message


def _log_handler() -> _EchoHandler | None:
    return next((h for h in logging.getLogger("prlmfuse").handlers if isinstance(h, _EchoHandler)), None)


@contextlib.contextmanager
def logging_to_stderr(level: int = logging.INFO) -> Iterator[None]:
    """Show the `prlmfuse` loggers' records at `level` and above on stderr while the command runs.

    The previous logger state comes back afterwards, so a command run inside another program
    (or a test) leaves that program's logging as it found it.
    """
    logger = logging.getLogger("prlmfuse")
    handler = _EchoHandler()
    handler.setFormatter(_Formatter("%(message)s"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="prlmfuse")
@click.option("--quiet", "-q", is_flag=True, help="Show warnings and errors only.")
@click.option("--verbose", "-v", is_flag=True, help="Show debug messages too.")
def cli(quiet: bool, verbose: bool) -> None:
    """Fuse frozen pretrained language models (PrLMs) into Transformer translation and
    summarization models (Park & Zhao 2021).

    Stage one caches each frozen PrLM's hidden states once (`cache`); stage two trains many
    fused models from that cache with no PrLM in the process (`train`); stage three decodes and
    scores them (`evaluate`). `run` does all of it from a pipeline.yaml.
    """
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose contradict each other; give one")
    if _log_handler() is not None:  # main() shows the records; other callers keep their own logging
        logging.getLogger("prlmfuse").setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)


# `prlmfuse --help` lists the commands sorted by name, whatever the order here.
for _command in (data, checkpoints, cache, train, evaluate, score, report, translate, run, bundle, search):
    cli.add_command(_command)


def main() -> None:
    with signals.handled(), logging_to_stderr():
        _main()


def _main() -> None:
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(UserError.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # One line, like every other bad input; `--help` still shows the full usage.
        hint = ""
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            hint = f" (see `{ctx.command_path} --help`)"
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(signals.INTERRUPTED_EXIT)
    except signals.Stopped as e:
        # SIGTERM / SIGUSR1: what was finished is saved; the status says "rerun me" to a job script.
        what = "interrupted" if e.exit_code == signals.INTERRUPTED_EXIT else f"stopped by {e.name}"
        detail = e.detail or "what was finished is kept; rerun the same command to go on"
        click.echo(f"{what}: {detail}", err=True)
        sys.exit(e.exit_code)
    except OSError as e:
        message = _os_error_line(e)
        if message is None:
            raise
        click.echo(f"error: {message}", err=True)
        sys.exit(UserError.exit_code)


def _os_error_line(e: OSError) -> str | None:
    """One line for the OSErrors that are the user's to fix (a full disk, a path that cannot be written,
    a file where a directory belongs), wherever in a stage they happen; None for the others."""
    import errno

    from prlmfuse.fileio import disk_full_error, is_disk_full

    target = Path(e.filename) if e.filename else None
    if is_disk_full(e):
        return str(disk_full_error(target.name, target.parent) if target else disk_full_error("a file", "this stage's output"))
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"cannot write {target or 'the output'} ({e.strerror}); choose a writable location "
                "or fix the permissions of the directory")
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and target is not None:
        blocking = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            return f"{blocking} is a file where a directory is expected; choose another path or move the file"
    return None


if __name__ == "__main__":
    main()
