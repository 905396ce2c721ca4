"""Builders from Debian's apt lists (the package descriptions of the configured apt sources).

  * debian-descriptions: summarization, a long package description -> its one-line synopsis, from
    the Translation-en lists;
  * debian-translations: translation between English and another language, from the Debian
    Description Translation Project's Translation-<lang> lists aligned with Translation-en by
    Description-md5, one segment pair per synopsis, paragraph or list item.

Both fetch the lists with `apt-get update` into a lists directory of their own (or read one given),
and split by a hash of each description's *source* package, read from the Packages lists apt
fetches beside them: sibling binary packages (foo, foo-dev, foo-doc, python3-foo) share
paragraphs, so they land in one split. Pairs of train (and of dev) whose text also occurs in a
more held-out split are then dropped, and corpus.json records every count.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from prlmfuse.corpora.apt_lists import Description, _apt_lists, _Lists, _read_list_file, parse_translation, read_sources
from prlmfuse.corpora.corpus import SPLITS, Corpus, install_corpus, normalize_text
from prlmfuse.errors import UserError

logger = logging.getLogger(__name__)

DEBIAN_MIN_WORDS = 40
# A source package's split is fixed by a hash of its name, so adding or dropping other packages
# never moves it: about 3% test and 3% dev.
_DEBIAN_TEST_FRACTION = 0.03
_DEBIAN_DEV_FRACTION = 0.03

# DDTP's language codes as apt names the lists: fr, de, ja, pt_BR, zh_CN, ...
_DDTP_LANG = re.compile(r"[a-z]{2,3}(?:_[A-Z]{2})?")
# What fileio.read_lines refuses inside a corpus line (after normalize_text, which turns \t, \n, ... into spaces).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


# ----------------------------------------------------------------------------- descriptions on one line


def parse_translation_en(text: str) -> Iterator[tuple[str, str, str]]:
    """Yield (package, synopsis, long description on one line) from a Translation-en list.

    Stanzas are RFC 822 paragraphs: `Package:`, `Description-md5:`, `Description-en: <synopsis>`
    followed by continuation lines starting with a space, where ` .` separates paragraphs.
    """
    for d in parse_translation(text, "en"):
        yield d.package, d.synopsis, _one_line(d)


def _one_line(d: Description) -> str:
    """A long description's paragraphs joined into one line."""
    return normalize_text(" ".join("" if ln.strip() == "." else ln for ln in d.body))


# ----------------------------------------------------------------------------- splitting


def _hash_unit(name: str) -> float:
    """A stable number in [0, 1) from sha256(name), independent of Python's hash seed."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def _debian_split(name: str) -> str:
    """The split of a (source) package name."""
    u = _hash_unit(name)
    if u < _DEBIAN_TEST_FRACTION:
        return "test"
    if u < _DEBIAN_TEST_FRACTION + _DEBIAN_DEV_FRACTION:
        return "dev"
    return "train"


@dataclass
class _SourceSplit:
    """Each description's split, by a hash of its binary package's source package (or, where the
    Packages lists do not name the package, of the binary name), with counts for corpus.json."""

    lists: _Lists
    sources: dict[str, str] = field(default_factory=dict)
    by_source: int = 0
    by_binary_name: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sources = read_sources(self.lists.packages)
        if not self.lists.packages:
            why = f" (fetching them failed: {self.lists.fetch_error})" if self.lists.fetch_error else ""
            logger.warning(
                "no Packages lists in %s%s: splitting by binary package name, so sibling packages (foo, foo-dev, "
                "foo-doc) may land in different splits, sharing paragraphs across them (train keeps none of dev's "
                "or test's text all the same); fetch them with `apt-get update` into that directory (or delete it "
                "if it is prlmfuse's own) to split by source package", self.lists.root, why)

    def split(self, package: str) -> str:
        source = self.sources.get(package)
        if source is None:
            self.by_binary_name.append(package)
            return _debian_split(package)
        self.by_source += 1
        return _debian_split(source)

    def record(self) -> dict:
        return {
            "packages_lists": [p.name for p in self.lists.packages],
            "split_by": "source package" if self.lists.packages else
                        "binary package name: no Packages lists were found, so siblings may straddle splits",
            "binary_packages_with_source": len(self.sources),
            "source_packages": len(set(self.sources.values())),
            "descriptions_split_by_source": self.by_source,
            "descriptions_split_by_binary_name": len(self.by_binary_name),
            "binary_names_without_source_examples": self.by_binary_name[:10],
        }


def _dedupe_and_hold_out(
    items: Iterable[tuple[str, str, str]],
    dedupe_key: Callable[[str, str], object],
    leak_keys: Callable[[str, str], Iterable[object]],
) -> tuple[dict[str, tuple[list[str], list[str]]], dict]:
    """(split, src, tgt) items -> the corpus's pairs, in the order read, and the counts of what was dropped.

    A pair whose dedupe_key was seen before in its split is a duplicate. Then a train pair with a
    leak key (e.g. its English segment) that some dev or test pair also has is dropped, and so is a
    dev pair with a leak key of a test pair: no held-out text is trained on, nor selected on.
    """
    kept: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    seen: dict[str, set] = {s: set() for s in SPLITS}
    duplicates = 0
    for split, src, tgt in items:
        key = dedupe_key(src, tgt)
        if key in seen[split]:
            duplicates += 1
            continue
        seen[split].add(key)
        kept[split].append((src, tgt))
    held: set = set()
    leaks = {}
    pairs: dict[str, tuple[list[str], list[str]]] = {}
    for split in ("test", "dev", "train"):
        mine = [(s, t) for s, t in kept[split] if not any(k in held for k in leak_keys(s, t))]
        leaks[split] = len(kept[split]) - len(mine)
        held.update(k for s, t in mine for k in leak_keys(s, t))
        pairs[split] = ([s for s, _ in mine], [t for _, t in mine])
    return {s: pairs[s] for s in SPLITS}, {"duplicates_dropped": duplicates,
                                            "leak_drops": {"train": leaks["train"], "dev": leaks["dev"]}}


def _split_sizes(pairs: dict[str, tuple[list[str], list[str]]], words: dict[str, int]) -> dict:
    """Per split: pairs, and whitespace-separated words of each side named in `words` (0: src, 1: tgt)."""
    return {split: {"pairs": len(pairs[split][0]),
                    **{f"{name}_words": sum(len(line.split()) for line in pairs[split][side]) for name, side in words.items()}}
            for split in SPLITS}


def _require_every_split(pairs: dict, lists: Path) -> None:
    for split in SPLITS:
        if not pairs[split][0]:
            raise UserError(
                f"the lists in {lists} gave no {split} pairs ({sum(len(p[0]) for p in pairs.values())} "
                f"in all); they look truncated: delete {lists} and run again"
            )


# ----------------------------------------------------------------------------- debian-descriptions


def build_debian_descriptions(
    out: str | os.PathLike, lists_dir: str | os.PathLike | None = None, *, force: bool = False
) -> Corpus:
    """Summarization corpus: Debian long package descriptions (>= 40 words) -> their synopsis.

    Reads apt's Translation-en lists from lists_dir (default $PRLMFUSE_HOME/apt-lists); when it
    holds none, runs `apt-get update` into it first. Split by a hash of each package's source
    package (read from the Packages lists beside them; the binary name where there are none).
    Descriptions are deduplicated within a split (first occurrence kept, files in name order);
    a train pair whose description or synopsis occurs in dev or test is dropped, and so is a dev
    pair whose description or synopsis occurs in test.
    """
    lists = _apt_lists(lists_dir, ("en",))
    splitter = _SourceSplit(lists)
    counts = {"descriptions_read": 0, "descriptions_too_short": 0, "descriptions_with_control_characters": 0}

    def items() -> Iterator[tuple[str, str, str]]:
        for path in lists.translations["en"]:
            for d in parse_translation(_read_list_file(path), "en", path):
                counts["descriptions_read"] += 1
                description = _one_line(d)
                if not d.synopsis or len(description.split()) < DEBIAN_MIN_WORDS:
                    counts["descriptions_too_short"] += 1
                elif _CONTROL.search(d.synopsis + description):
                    counts["descriptions_with_control_characters"] += 1
                else:
                    yield splitter.split(d.package), description, d.synopsis

    pairs, dropped = _dedupe_and_hold_out(items(), lambda d, s: d, lambda d, s: (("description", d), ("synopsis", s)))
    _require_every_split(pairs, lists.root)
    stats = {
        **counts, **dropped,
        "splits": _split_sizes(pairs, {"description": 0, "synopsis": 1}),
        "sources": splitter.record(),
    }
    source = "Debian apt Translation-en: " + ", ".join(p.name for p in lists.translations["en"])
    return install_corpus(
        out, name="debian-descriptions", task="summarization", src_lang="en", tgt_lang="en",
        source=source, pairs=pairs, force=force, stats=stats,
    )


# ----------------------------------------------------------------------------- debian-translations

# A list item's marker at the start of a line: *, -, +, bullets and dashes (French lists use – and —)
# anywhere; o and 1. / 1) only indented (a wrapped line of prose may start with a word "o" or a number).
_BULLET = re.compile(r"[*+•·‣◦–—-]\s+(?=\S)")
_INDENTED_BULLET = re.compile(r"(?:o|\d{1,2}[.)])\s+(?=\S)")


def check_translation_languages(src: str, tgt: str) -> str | None:
    """What is wrong with the languages of a debian-translations corpus, or None."""
    if "en" not in (src, tgt) or src == tgt:
        return (f"debian-translations pairs English with another language; src={src!r} tgt={tgt!r} has "
                f"{'no' if 'en' not in (src, tgt) else 'only'} English: use e.g. src: en, tgt: fr")
    other = tgt if src == "en" else src
    if not _DDTP_LANG.fullmatch(other):
        return (f"{other!r} is not a language code as Debian's translation lists name them "
                f"(e.g. fr, de, ja, pt_BR, zh_CN)")
    return None


def _paragraphs(body: tuple[str, ...]) -> list[list[str]]:
    """A long description's paragraphs (separated by ` .` lines, or by a line of other blanks that a
    translator typed instead), each a list of its lines."""
    paragraphs: list[list[str]] = [[]]
    for line in body:
        if line.strip() in (".", ""):
            paragraphs.append([])
        else:
            paragraphs[-1].append(line)
    return [p for p in paragraphs if any(line.strip() for line in p)]


def _blocks(paragraph: list[str]) -> list[str]:
    """A paragraph's text as blocks, each on one line: the text before a list, each list item (its
    marker dropped, with the lines indented under it) and any text after the list."""
    blocks: list[list[str]] = []
    item_indent: int | None = None  # the indentation of the current item's marker; None outside a list
    for line in paragraph:
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        marker = _BULLET.match(text) or (_INDENTED_BULLET.match(text) if indent > 0 else None)
        if marker is not None:
            blocks.append([text[marker.end():]])
            item_indent = indent
        elif item_indent is not None and (indent > item_indent or indent == item_indent == 0):
            # indented under the item, or an item at the margin wrapped at the margin
            blocks[-1].append(text)
        elif not blocks or item_indent is not None:
            blocks.append([text])
            item_indent = None
        else:
            blocks[-1].append(text)
    return [normalize_text(" ".join(b)) for b in blocks]


def align_segments(english: Description, other: Description) -> tuple[list[tuple[str, str]], int] | None:
    """The (English, other) segment pairs of one description: the synopses, then paragraph by
    paragraph, and within a paragraph item by item when both sides hold the same number of list
    items and text blocks (else the paragraph whole, counted). None when the paragraph counts differ."""
    en_paragraphs, other_paragraphs = _paragraphs(english.body), _paragraphs(other.body)
    if len(en_paragraphs) != len(other_paragraphs):
        return None
    pairs = [(english.synopsis, other.synopsis)]
    whole = 0
    for en_par, other_par in zip(en_paragraphs, other_paragraphs):
        en_blocks, other_blocks = _blocks(en_par), _blocks(other_par)
        if len(en_blocks) == len(other_blocks):
            pairs += zip(en_blocks, other_blocks)
        else:
            whole += 1
            pairs.append((normalize_text(" ".join(en_par)), normalize_text(" ".join(other_par))))
    return pairs, whole


def build_debian_translations(
    out: str | os.PathLike, *, src: str = "en", tgt: str, lists_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> Corpus:
    """Translation corpus from Debian's package description translations (DDTP), English <-> `other`.

    Reads the Translation-en and Translation-<other> lists (and the Packages lists beside them)
    from lists_dir (default $PRLMFUSE_HOME/apt-lists), running `apt-get update` into it when one is
    missing. Descriptions are aligned by Description-md5 and cut into segments: the synopsis, each
    paragraph and, where both sides agree on them, each list item. A description whose two sides
    have different paragraph counts is skipped. Split by a hash of the source package; segment
    pairs are deduplicated within a split; a train pair whose English segment occurs in dev or test
    is dropped, and so is a dev pair whose English segment occurs in test.
    """
    problem = check_translation_languages(src, tgt)
    if problem is not None:
        raise UserError(problem)
    other = tgt if src == "en" else src
    lists = _apt_lists(lists_dir, ("en", other))
    splitter = _SourceSplit(lists)
    english: dict[str, Description] = {}
    for path in lists.translations["en"]:
        for d in parse_translation(_read_list_file(path), "en", path):
            english.setdefault(d.md5, d)
    counts = {"descriptions_en": len(english), f"descriptions_{other}": 0, "descriptions_aligned": 0,
              f"descriptions_{other}_without_english": 0, "descriptions_skipped_paragraph_counts_differ": 0,
              "segment_pairs_read": 0, "paragraphs_kept_whole_list_items_differ": 0,
              "segment_pairs_with_control_characters": 0, "segment_pairs_empty_side": 0}
    translated: set[str] = set()

    def items() -> Iterator[tuple[str, str, str]]:
        for path in lists.translations[other]:
            for d in parse_translation(_read_list_file(path), other, path):
                if d.md5 in translated:
                    continue
                translated.add(d.md5)
                counts[f"descriptions_{other}"] += 1
                en = english.get(d.md5)
                if en is None:
                    counts[f"descriptions_{other}_without_english"] += 1
                    continue
                counts["descriptions_aligned"] += 1
                aligned = align_segments(en, d)
                if aligned is None:
                    counts["descriptions_skipped_paragraph_counts_differ"] += 1
                    continue
                segments, whole = aligned
                counts["paragraphs_kept_whole_list_items_differ"] += whole
                split = splitter.split(en.package)
                for en_text, other_text in segments:
                    if not en_text or not other_text:
                        counts["segment_pairs_empty_side"] += 1
                        continue
                    if _CONTROL.search(en_text + other_text):
                        counts["segment_pairs_with_control_characters"] += 1
                        continue
                    counts["segment_pairs_read"] += 1
                    yield (split, en_text, other_text) if src == "en" else (split, other_text, en_text)

    english_side = 0 if src == "en" else 1
    pairs, dropped = _dedupe_and_hold_out(items(), lambda s, t: (s, t), lambda s, t: ((s, t)[english_side],))
    _require_every_split(pairs, lists.root)
    stats = {
        **counts, **dropped,
        "splits": _split_sizes(pairs, {src: 0, tgt: 1}),
        "sources": splitter.record(),
    }
    files = [*lists.translations["en"], *lists.translations[other]]
    source = (f"Debian apt (DDTP) Translation-en + Translation-{other}, aligned by Description-md5: "
              + ", ".join(p.name for p in files))
    return install_corpus(
        out, name=f"debian-translations-{src}-{tgt}", task="translation", src_lang=src, tgt_lang=tgt,
        source=source, pairs=pairs, force=force, stats=stats,
    )
