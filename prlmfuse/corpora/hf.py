"""Builder: a corpus from a Hugging Face `datasets` dataset (hub id, `save_to_disk` directory, or
local parquet/json/csv files), checked like the user's own text files and copied into the corpus layout."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from prlmfuse.corpora.corpus import SPLITS, Corpus, install_corpus, normalize_text
from prlmfuse.corpora.text import check_task_and_languages
from prlmfuse.errors import UserError

logger = logging.getLogger(__name__)

# Data files `datasets` reads with one of its packaged builders.
HF_FILE_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# Split names tried, in order, when `splits` does not name one; a split none of them finds is
# carved from train by hash, this fraction of it.
DEFAULT_SPLIT_NAMES = {"train": ("train",), "dev": ("validation", "dev", "valid"), "test": ("test",)}
DEFAULT_HOLDOUT = 0.05
_MAX_HOLDOUT = 0.5
_INSTALL_HINT = "install it with `pip install 'prlmfuse[hf]'` (or `pip install datasets`)"


def check_splits(splits: Any) -> tuple[tuple, str] | None:
    """Why `splits` is not a valid mapping, as (key path inside it, message), or None when it is.

    train names a split; dev and test name a split or give a fraction of train to carve out by hash.
    """
    if splits is None:
        return None
    if not isinstance(splits, dict):
        return (), f"expected a mapping such as {{train: train, dev: validation, test: {DEFAULT_HOLDOUT}}}, got {splits!r}"
    for key, value in splits.items():
        if key not in SPLITS:
            return (key,), f"unknown split; the splits are {', '.join(SPLITS)}"
        if isinstance(value, str) and value:
            continue
        if key != "train" and isinstance(value, (int, float)) and not isinstance(value, bool):
            if 0 < value <= _MAX_HOLDOUT:
                continue
            return (key,), f"a fraction of train must be above 0 and at most {_MAX_HOLDOUT}, got {value}"
        what = "a split name" if key == "train" else "a split name or a fraction of train such as 0.05"
        return (key,), f"expected {what}, got {value!r}"
    return None


def check_fields(src_field: str | None, tgt_field: str | None, translation_field: str | None) -> str | None:
    """Why these field settings contradict each other, or None."""
    if (src_field is None) != (tgt_field is None):
        return "give both src_field and tgt_field (the columns holding the source and the target)"
    if src_field is not None and translation_field is not None:
        return "give either src_field/tgt_field or translation_field, not both"
    return None


def looks_like_path(dataset: str) -> bool:
    """True when `dataset` is written as a file system path rather than a hub id (`name` or `owner/name`)."""
    return (
        dataset.startswith((".", "/", "~"))
        or dataset.count("/") > 1
        or "\\" in dataset
        or Path(dataset).suffix.lower() in HF_FILE_FORMATS
    )


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(f"data kind hf needs the `datasets` package, which is not installed; {_INSTALL_HINT}") from None
    return datasets


def _load(dataset: str, subset: str | None, revision: str | None) -> dict:
    """{split name: datasets.Dataset} from a save_to_disk directory, data files, a folder of them or the hub."""
    datasets = _import_datasets()
    path = Path(dataset).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = HF_FILE_FORMATS.get(path.suffix.lower())
            if builder is None:
                raise UserError(
                    f"{path}: not a data file `datasets` reads; use {', '.join(HF_FILE_FORMATS)} files, a folder of "
                    f"them, or a directory written by save_to_disk"
                )
            loaded = datasets.load_dataset(builder, data_files=str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        elif looks_like_path(dataset):
            raise UserError(f"dataset {dataset}: no such file or directory; give a hub id, a save_to_disk directory, "
                            f"or {'/'.join(HF_FILE_FORMATS)} files")
        else:
            loaded = datasets.load_dataset(dataset, subset, revision=revision)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - `datasets` raises many types; each becomes the one-line error
        said = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"dataset {dataset}: `datasets` could not load it ({type(e).__name__}: {said})") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _choose_splits(available: list[str], splits: dict | None, dataset: str) -> dict[str, str | float]:
    """Each corpus split -> the dataset split it comes from, or the fraction of train carved out for it."""
    chosen: dict[str, str | float] = {}
    splits = splits or {}
    for split in SPLITS:
        if split in splits:
            value = splits[split]
            if isinstance(value, str) and value not in available:
                raise UserError(
                    f"dataset {dataset} has no split {value!r} (asked for as {split}); its splits are "
                    f"{', '.join(available)}" + ("" if split == "train" else f"; or give a fraction of train such as {DEFAULT_HOLDOUT}")
                )
            chosen[split] = value
            continue
        found = next((name for name in DEFAULT_SPLIT_NAMES[split] if name in available), None)
        if found is None and split == "train":
            raise UserError(
                f"dataset {dataset} has no split named train (its splits are {', '.join(available)}); "
                f"name the training split with splits: {{train: NAME}}"
            )
        chosen[split] = found if found is not None else DEFAULT_HOLDOUT
    named = [(s, v) for s, v in chosen.items() if isinstance(v, str)]
    for i, (split, value) in enumerate(named):
        twin = next((other for other, v in named[:i] if v == value), None)
        if twin is not None:
            # The same rows on two sides would score the model on what it trained or was selected on.
            raise UserError(
                f"dataset {dataset}: {twin} and {split} would both be its split {value!r}; name another split "
                f"for {split}, or give a fraction such as {DEFAULT_HOLDOUT} to carve it out of train"
            )
    return chosen


def _hash_unit(text: str) -> float:
    """A stable number in [0, 1) from sha256(text), independent of Python's hash seed and of row order."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def _resolve_fields(columns: list[str], dataset: str, src_field, tgt_field, translation_field, src_lang, tgt_lang):
    """(src_field, tgt_field, translation_field) as given, or found: a `translation` column, else columns named
    after the two languages."""
    if src_field is not None or translation_field is not None:
        return src_field, tgt_field, translation_field
    if "translation" in columns:
        return None, None, "translation"
    if src_lang in columns and tgt_lang in columns and src_lang != tgt_lang:
        return src_lang, tgt_lang, None
    raise UserError(
        f"dataset {dataset} has columns {', '.join(columns)}: name the source and target columns with src_field "
        f"and tgt_field, or with translation_field a column of {{{src_lang}: ..., {tgt_lang}: ...}} dicts"
    )


def _columns(ds, dataset: str, split: str, src_field, tgt_field, translation_field, src_lang, tgt_lang):
    """(source strings, target strings) of one dataset split, in row order, unchecked."""
    columns = list(ds.column_names)
    wanted = [translation_field] if translation_field is not None else [src_field, tgt_field]
    for field in wanted:
        if field not in columns:
            raise UserError(f"dataset {dataset} ({split}) has no column {field!r}; its columns are {', '.join(columns)}")
    if translation_field is None:
        return list(ds[src_field]), list(ds[tgt_field])
    src, tgt = [], []
    for row, item in enumerate(ds[translation_field]):
        if not isinstance(item, dict) or src_lang not in item or tgt_lang not in item:
            keys = ", ".join(map(str, item)) if isinstance(item, dict) else type(item).__name__
            raise UserError(
                f"dataset {dataset} ({split}) row {row}: {translation_field} holds {{{keys}}}, not the keys "
                f"{src_lang} and {tgt_lang}; set src and tgt to the language keys of the translation dicts"
            )
        src.append(item[src_lang])
        tgt.append(item[tgt_lang])
    return src, tgt


def _checked(values: list, dataset: str, split: str, side: str, field: str) -> list[str]:
    """The column as normalized lines; refuse non-strings, text that is not UTF-8 and empty lines, as `text` does."""
    lines = []
    empty = []
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise UserError(
                f"dataset {dataset} ({split}) row {row}: the {side} ({field}) is {type(value).__name__}, not text; "
                f"drop or fix those rows (Dataset.filter, then save_to_disk)"
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(
                f"dataset {dataset} ({split}) row {row}: the {side} ({field}) is not valid UTF-8 (a lone surrogate); "
                f"fix or drop that row"
            ) from None
        line = normalize_text(value)
        if not line:
            empty.append(row)
        lines.append(line)
    if empty:
        raise UserError(
            f"dataset {dataset} ({split}) row {empty[0]}: empty {side} ({len(empty)} such rows in this split); "
            f"drop those rows (Dataset.filter, then save_to_disk) and point the corpus at the result"
        )
    return lines


def build_hf(
    out: str | os.PathLike,
    *,
    dataset: str,
    src_lang: str,
    tgt_lang: str,
    src_field: str | None = None,
    tgt_field: str | None = None,
    translation_field: str | None = None,
    splits: dict | None = None,
    subset: str | None = None,
    revision: str | None = None,
    task: str = "translation",
    name: str | None = None,
    force: bool = False,
) -> Corpus:
    """A corpus from a `datasets` dataset: hub id, save_to_disk directory, data file or folder of them.

    Source and target come from the columns src_field and tgt_field, or from translation_field, a
    column of dicts keyed by language code (src_lang, tgt_lang); with neither, a `translation`
    column or columns named after the two languages. `splits` maps train/dev/test to a dataset
    split, or dev/test to a fraction of train: those rows are chosen by a hash of their source
    text, so the choice is the same on every machine and a repeated source never lands on both
    sides. Unnamed splits take `validation`/`dev`/`valid` and `test` when present, else 5% of train.
    """
    check_task_and_languages(task, src_lang, tgt_lang)
    bad = check_splits(splits)
    if bad is not None:
        keypath, message = bad
        raise UserError(f"splits{''.join('.' + str(k) for k in keypath)}: {message}")
    conflict = check_fields(src_field, tgt_field, translation_field)
    if conflict is not None:
        raise UserError(f"dataset {dataset}: {conflict}")
    loaded = _load(dataset, subset, revision)
    chosen = _choose_splits(list(loaded), splits, dataset)
    src_field, tgt_field, translation_field = _resolve_fields(
        list(loaded[str(chosen["train"])].column_names), dataset, src_field, tgt_field, translation_field,
        src_lang, tgt_lang)

    def read(split_name: str) -> tuple[list[str], list[str]]:
        src, tgt = _columns(loaded[split_name], dataset, split_name, src_field, tgt_field, translation_field,
                            src_lang, tgt_lang)
        fields = ((f"{translation_field}.{src_lang}", f"{translation_field}.{tgt_lang}") if translation_field
                  else (src_field, tgt_field))
        return (_checked(src, dataset, split_name, "source", f"{fields[0]}"),
                _checked(tgt, dataset, split_name, "target", f"{fields[1]}"))

    pairs: dict[str, tuple[list[str], list[str]]] = {}
    train_src, train_tgt = read(str(chosen["train"]))
    # Carved splits take consecutive ranges of the hash: test first, then dev.
    carved = [(s, float(chosen[s])) for s in ("test", "dev") if not isinstance(chosen[s], str)]
    bounds, low = {}, 0.0
    for split, fraction in carved:
        bounds[split] = (low, low + fraction)
        low += fraction
    kept: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in ("train", *bounds)}
    for s, t in zip(train_src, train_tgt):
        u = _hash_unit(s)
        split = next((name for name, (a, b) in bounds.items() if a <= u < b), "train")
        kept[split][0].append(s)
        kept[split][1].append(t)
    for split in SPLITS:
        if split in kept:
            pairs[split] = kept[split]
        else:
            pairs[split] = read(str(chosen[split]))
        if not pairs[split][0]:
            how = (f"the hash split of {len(train_src)} train rows gave it none; raise its fraction or name a split"
                   if split in bounds else "every split needs sentence pairs")
            raise UserError(f"dataset {dataset}: the {split} split is empty ({how})")
    described = ", ".join(
        f"{s}={v}" if isinstance(v, str) else f"{s}={v:g} of train by hash" for s, v in chosen.items()
    )
    fields = f"translation_field={translation_field}" if translation_field else f"src_field={src_field}, tgt_field={tgt_field}"
    source = (f"Hugging Face dataset {dataset}" + (f" (subset {subset})" if subset else "")
              + (f" at revision {revision}" if revision else "") + f"; {fields}; splits {described}")
    logger.info("data: %s", source)
    return install_corpus(
        out, name=name or Path(out).resolve().name, task=task, src_lang=src_lang, tgt_lang=tgt_lang,
        source=source, pairs=pairs, force=force,
    )
