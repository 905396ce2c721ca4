"""apt's lists of the configured apt sources: finding them, fetching them with `apt-get update`,
decompressing and parsing them (Translation-<lang> lists of package descriptions, Packages lists
that name each binary package's source). The corpora built from them are in debian.py.
"""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prlmfuse.corpora.corpus import normalize_text
from prlmfuse.errors import UserError
from prlmfuse.fileio import prlmfuse_home

logger = logging.getLogger(__name__)

_DECOMPRESSORS = {".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}
_EXTERNAL_COMPRESSIONS = (".lz4", ".zst")  # no stdlib codec: apt's own helper decompresses them
_PACKAGES_SUFFIX = "_Packages"
_BROKEN = "the list is damaged: delete it (or the whole lists directory) and run again to fetch the lists anew"


def _translation_suffix(lang: str) -> str:
    return f"_i18n_Translation-{lang}"


# ----------------------------------------------------------------------------- finding and fetching the lists


def _list_files(lists_dir: Path, stem_suffix: str) -> list[Path]:
    """apt lists in lists_dir whose name, less a compression suffix, ends with stem_suffix: one per
    index (the plain file when apt left both)."""
    if not lists_dir.is_dir():
        return []
    chosen: dict[str, Path] = {}
    for path in sorted(lists_dir.iterdir()):
        suffix = next((s for s in (*_DECOMPRESSORS, *_EXTERNAL_COMPRESSIONS) if path.name.endswith(s)), "")
        stem = path.name[: len(path.name) - len(suffix)]
        if not stem.endswith(stem_suffix) or not path.is_file():
            continue
        if stem not in chosen or suffix == "":
            chosen[stem] = path
    return [chosen[k] for k in sorted(chosen)]


def _translation_files(lists_dir: Path, lang: str = "en") -> list[Path]:
    """Translation-<lang> lists in lists_dir, one per archive."""
    return _list_files(lists_dir, _translation_suffix(lang))


def _packages_files(lists_dir: Path) -> list[Path]:
    """Packages lists (binary package indexes, which name each package's source) in lists_dir."""
    return _list_files(lists_dir, _PACKAGES_SUFFIX)


def _languages_in(lists_dir: Path) -> list[str]:
    """The languages of the Translation lists already in lists_dir."""
    if not lists_dir.is_dir():
        return []
    found = (re.search(r"_i18n_Translation-([A-Za-z_]+?)(?:\.(?:gz|xz|bz2|lz4|zst))?$", p.name) for p in lists_dir.iterdir())
    return sorted({m.group(1) for m in found if m})


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
        raise UserError(f"{path}:{line_no}: invalid UTF-8 in an apt list; delete it and run again") from None


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


def _apt_update(lists_dir: Path, languages: Iterable[str]) -> None:
    """Fetch the Translation lists of `languages` (and of those already in lists_dir, which apt would
    otherwise delete) and the Packages lists of the configured apt sources into lists_dir."""
    langs = list(dict.fromkeys([*languages, *_languages_in(lists_dir)]))
    apt_get = shutil.which("apt-get")
    names = " and ".join(f"*{_translation_suffix(lang)}" for lang in langs[:2])
    fix = (f"or pass --lists-dir (data.lists_dir) with a directory that already holds {names} lists and the "
           f"*{_PACKAGES_SUFFIX} lists beside them (apt-get -o Acquire::Languages={','.join(langs)} update fills "
           f"/var/lib/apt/lists with them)")
    if apt_get is None:
        raise UserError(f"apt-get not found: the Debian corpora need apt's Translation and Packages lists; {fix}")
    (lists_dir / "partial").mkdir(parents=True, exist_ok=True)
    logger.info("fetching apt's Translation-%s and Packages lists into %s (apt-get update)", ",".join(langs), lists_dir)
    cmd = [
        apt_get,
        "-o", f"Dir::State::Lists={lists_dir.resolve()}",
        "-o", f"Acquire::Languages={','.join(langs)}",
        # Stored decompressed, whatever the system's (e.g. Docker's) GzipIndexes setting is.
        "-o", "Acquire::GzipIndexes=false",
        # The Packages lists stay enabled: they name each binary package's source, which the split is by.
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


@dataclass
class _Lists:
    root: Path
    translations: dict[str, list[Path]]  # language -> its Translation lists
    packages: list[Path]
    fetch_error: str = ""  # why fetching the missing Packages lists failed


def _apt_lists(lists_dir: str | os.PathLike | None, languages: tuple[str, ...]) -> _Lists:
    """The lists directory (default $PRLMFUSE_HOME/apt-lists) with Translation lists for every one of
    `languages`, fetched with `apt-get update` when one is missing. Packages lists missing beside
    them are fetched into the tool's own directory (an older prlmfuse left them out; a failed fetch
    then only warns), never into a directory the user gave."""
    own = lists_dir is None
    root = prlmfuse_home() / "apt-lists" if own else Path(lists_dir).expanduser()

    def found() -> _Lists:
        return _Lists(root, {lang: _translation_files(root, lang) for lang in languages}, _packages_files(root))

    lists = found()
    complete = all(lists.translations.values())
    if not complete or (own and not lists.packages):
        fetch_error = ""
        try:
            _apt_update(root, languages)
        except UserError as e:
            if not complete:
                raise
            fetch_error = str(e).split(";")[0]  # what failed, said in the one warning about splitting without them
        lists = found()
        lists.fetch_error = fetch_error
        missing = next((lang for lang, files in lists.translations.items() if not files), None)
        if missing is not None:
            raise UserError(
                f"apt-get update left no Translation-{missing} lists in {root}: the apt sources may not publish "
                f"descriptions in {missing!r}; pass --lists-dir with a directory holding "
                f"*{_translation_suffix(missing)} files"
            )
    return lists


# ----------------------------------------------------------------------------- reading the lists

_FIELD = re.compile(r"([^\s:]+):[ \t]*(.*)")


def _stanzas(text: str, path: str | os.PathLike) -> Iterator[tuple[int, dict[str, tuple[str, list[str]]]]]:
    """The RFC 822 stanzas of an apt list: (first line number, {field: (value, continuation lines)}),
    a continuation line without its one leading space. Anything else is refused as path:line."""
    fields: dict[str, tuple[str, list[str]]] = {}
    start = 0
    current: list[str] | None = None
    for no, line in enumerate(text.split("\n"), start=1):
        # Only a line of ASCII blanks ends a stanza: " \u00a0" (a space, a no-break space) is a continuation.
        if not line.strip(" \t\r"):
            if fields:
                yield start, fields
            fields, current = {}, None
            continue
        if line[0] in " \t":
            if current is None:
                raise UserError(f"{path}:{no}: an indented continuation line outside any field; {_BROKEN}")
            current.append(line[1:])
            continue
        m = _FIELD.fullmatch(line)
        if m is None:
            raise UserError(f"{path}:{no}: not an apt list line (`Field: value` or an indented continuation): "
                            f"{line[:60]!r}; {_BROKEN}")
        if not fields:
            start = no
        current = []
        fields[m.group(1)] = (m.group(2).strip(), current)
    if fields:
        yield start, fields


@dataclass(frozen=True)
class Description:
    """One stanza of a Translation-<lang> list."""

    package: str
    md5: str
    synopsis: str  # normalized
    body: tuple[str, ...]  # the long description's lines, each less its one leading space; "." between paragraphs


def parse_translation(text: str, lang: str, path: str | os.PathLike = "<Translation list>") -> Iterator[Description]:
    """The descriptions of a Translation-<lang> list: stanzas of `Package:`, `Description-md5:` and
    `Description-<lang>: <synopsis>` followed by the long description's continuation lines."""
    key = f"Description-{lang}"
    for line, fields in _stanzas(text, path):
        missing = next((k for k in ("Package", "Description-md5", key) if k not in fields), None)
        if missing is not None:
            raise UserError(f"{path}:{line}: a stanza without its {missing}: field in a Translation-{lang} list; {_BROKEN}")
        synopsis, body = fields[key]
        yield Description(fields["Package"][0], fields["Description-md5"][0].lower(), normalize_text(synopsis), tuple(body))


def _source_name(value: str) -> str:
    """`Source: name (version)` or `Source: name` -> name."""
    return value.split(" ", 1)[0]


def read_sources(files: list[Path]) -> dict[str, str]:
    """binary package -> its source package, from Packages lists (no `Source:` field: its own name).
    The first list that names a package decides."""
    sources: dict[str, str] = {}
    for path in files:
        for line, fields in _stanzas(_read_list_file(path), path):
            if "Package" not in fields or not fields["Package"][0]:
                raise UserError(f"{path}:{line}: a stanza without its Package: field in a Packages list; {_BROKEN}")
            package = fields["Package"][0]
            source = _source_name(fields["Source"][0]) if "Source" in fields else package
            if not source:
                raise UserError(f"{path}:{line}: an empty Source: field for {package}; {_BROKEN}")
            sources.setdefault(package, source)
    return sources
