"""Builder: the user's own line-aligned train/dev/test files, checked and copied into the corpus layout."""

from __future__ import annotations

import os
import re
from pathlib import Path

from prlmfuse.corpora.corpus import CORPUS_JSON, SIDES, TASKS, Corpus, install_corpus, normalize_text
from prlmfuse.errors import UserError
from prlmfuse.fileio import FileDigests, read_json, read_lines


def check_task_and_languages(task: str, src_lang: str, tgt_lang: str) -> None:
    """The checks every builder of the user's own data makes on its task and language codes."""
    if task not in TASKS:
        raise UserError(f"task {task!r} is not one of {', '.join(TASKS)}")
    for what, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if not isinstance(lang, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", lang):
            raise UserError(f"{what} {lang!r} is not a language code; use e.g. en, ja, de, zh-Hans")


def register_text(
    out: str | os.PathLike,
    *,
    train_src: str | os.PathLike,
    train_tgt: str | os.PathLike,
    dev_src: str | os.PathLike,
    dev_tgt: str | os.PathLike,
    test_src: str | os.PathLike,
    test_tgt: str | os.PathLike,
    src_lang: str,
    tgt_lang: str,
    task: str = "translation",
    name: str | None = None,
    force: bool = False,
) -> Corpus:
    """Check the user's line-aligned files and copy them into the corpus layout.

    Each split's source and target must have the same number of lines, be valid UTF-8 and
    hold at least one pair; no line may be empty (whitespace is collapsed as in the builders).
    """
    check_task_and_languages(task, src_lang, tgt_lang)
    files = {
        "train": (train_src, train_tgt),
        "dev": (dev_src, dev_tgt),
        "test": (test_src, test_tgt),
    }
    pairs: dict[str, tuple[list[str], list[str]]] = {}
    for split, (src_file, tgt_file) in files.items():
        src_lines = [normalize_text(s) for s in read_lines(src_file)]
        tgt_lines = [normalize_text(s) for s in read_lines(tgt_file)]
        if len(src_lines) != len(tgt_lines):
            raise UserError(
                f"{split} split is not line-aligned: {src_file} has {len(src_lines)} lines but {tgt_file} has "
                f"{len(tgt_lines)}; line i of the source must pair with line i of the target"
            )
        if not src_lines:
            raise UserError(f"{split} split is empty: {src_file} and {tgt_file} have no lines; every split needs sentence pairs")
        for path, lines in ((src_file, src_lines), (tgt_file, tgt_lines)):
            empty = [i for i, s in enumerate(lines, start=1) if not s]
            if empty:
                raise UserError(
                    f"{path}:{empty[0]}: empty line ({len(empty)} in this file); remove those lines together "
                    f"with their partners in the other file of the {split} split"
                )
        pairs[split] = (src_lines, tgt_lines)
    source = "registered files: " + ", ".join(f"{split}={s} | {t}" for split, (s, t) in files.items())
    digests = FileDigests()
    inputs = {split: {side: {"path": str(Path(f).resolve()), "sha256": digests.sha256(f)} for side, f in zip(SIDES, pair)}
              for split, pair in files.items()}
    digests.save()
    return install_corpus(
        out, name=name or Path(out).resolve().name, task=task, src_lang=src_lang, tgt_lang=tgt_lang,
        source=source, pairs=pairs, force=force, inputs=inputs,
    )


def text_inputs_changed(corpus_root: str | os.PathLike, files: dict[str, str | os.PathLike]) -> str | None:
    """The first of the user's files ({"train_src": path, ...}) whose content differs from what the corpus
    at `corpus_root` was registered from (a stat per file unchanged since it was last hashed); None if none;
    "" if the corpus records no inputs (registered by an earlier version), so nothing can be told."""
    try:
        recorded = read_json(Path(corpus_root) / CORPUS_JSON, CORPUS_JSON).get("inputs") or {}
    except (UserError, AttributeError):
        recorded = {}
    if not recorded:
        return ""
    digests = FileDigests()
    try:
        for name, path in files.items():
            split, side = name.split("_")
            entry = (recorded.get(split) or {}).get(side) if isinstance(recorded, dict) else None
            if not isinstance(entry, dict) or not Path(path).is_file() or digests.sha256(path) != entry.get("sha256"):
                return str(path)
        return None
    finally:
        digests.save()
