"""Builder: a summarization corpus of Debian long package descriptions -> their one-line synopsis,
read from apt's Translation-en lists."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import logging
import lzma
import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path
from typing import Iterator

from prlmfuse.corpora.corpus import SPLITS, Corpus, install_corpus, normalize_text
from prlmfuse.errors import UserError
from prlmfuse.fileio import prlmfuse_home

logger = logging.getLogger(__name__)

DEBIAN_MIN_WORDS = 40
# A package's split is fixed by a hash of its name, so adding or dropping other packages never
# moves it: about 3% test and 3% dev (~1,000 each out of ~34k).
_DEBIAN_TEST_FRACTION = 0.03
_DEBIAN_DEV_FRACTION = 0.03

_TRANSLATION_SUFFIX = "_i18n_Translation-en"
_DECOMPRESSORS = {".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}
_EXTERNAL_COMPRESSIONS = (".lz4", ".zst")  # no stdlib codec: apt's own helper decompresses them


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
    logger.info("fetching apt's Translation-en lists into %s (apt-get update)", lists_dir)
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
    return install_corpus(
        out, name="debian-descriptions", task="summarization", src_lang="en", tgt_lang="en",
        source=source, pairs=pairs, force=force,
    )
