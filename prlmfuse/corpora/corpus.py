"""The corpus contract: line-aligned train/dev/test source and target files plus a corpus.json.

A corpus directory holds `{train,dev,test}.{src,tgt}` (UTF-8, one sentence a line, line i of
`.src` paired with line i of `.tgt`) and `corpus.json` recording, per file, its line count,
byte size and sha256. Caches and runs record those hashes, so a corpus is built once into a
temporary directory beside its final name and renamed into place (`install_corpus`): the final
name only ever holds a complete corpus. Opening one (`load_corpus`) checks every file still hashes
to what corpus.json records, so a file edited afterwards is refused rather than paired with features
computed from its old text.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from prlmfuse import __version__
from prlmfuse.errors import UserError
from prlmfuse.fileio import FileDigests, atomic_write_json, disk_full_error, fsync_dir, is_disk_full, read_json, sha256_file

SPLITS = ("train", "dev", "test")
SIDES = ("src", "tgt")
TASKS = ("translation", "summarization")
CORPUS_JSON = "corpus.json"

_BUILD_HINT = "build one with `prlmfuse data bible|debian-descriptions|debian-translations|text|hf OUT`"


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
        """Re-hash every file against corpus.json, trusting no remembered digest (load_corpus's check
        re-hashes only files whose size or mtime changed since they were last hashed)."""
        self.check_files(full=True)

    def check_files(self, *, full: bool = False) -> None:
        """Refuse a corpus whose files are no longer exactly what corpus.json (and so every cache and
        run built from it) records: each file's size, then its sha256, which FileDigests re-computes
        only for a file whose size or mtime changed since it was last hashed (`full`: always)."""
        meta_path = self.root / CORPUS_JSON
        digests = FileDigests()
        try:
            for split in self.splits:
                for side in SIDES:
                    entry = self._entry(split, side)
                    path = self.root / entry["file"]
                    if not path.is_file():
                        raise UserError(f"corpus file missing: {path} (listed in {meta_path}); {_rebuild_hint(self.root)}")
                    size = path.stat().st_size
                    if "bytes" in entry and size != entry["bytes"]:
                        raise UserError(f"{path}: {size} bytes but {meta_path} records {entry['bytes']}; "
                                        f"the file was changed after the corpus was built: {_rebuild_hint(self.root)}")
                    digest = sha256_file(path) if full else digests.sha256(path)
                    if digest != entry["sha256"]:
                        raise UserError(f"{path}: content differs from the sha256 recorded in {meta_path}; the file was "
                                        f"edited after the corpus was built: {_rebuild_hint(self.root)}")
        finally:
            digests.save()


def _rebuild_hint(root: Path) -> str:
    return (f"restore it, or rebuild the corpus (`prlmfuse data ... {root} --force`, or delete {root} "
            "and rerun `prlmfuse run`), which also rebuilds its caches and runs")


def load_corpus(root: str | os.PathLike, *, verify: bool = False) -> Corpus:
    """Open a corpus directory: corpus.json must exist and every file must still be what it records
    (size and sha256, see Corpus.check_files). `verify=True` re-hashes every file regardless."""
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
    corpus.check_files(full=verify)
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


# ----------------------------------------------------------------------------- text and writing

# Whitespace runs become one ASCII space: a newline (or U+2028 and friends) inside a sentence
# would break line alignment. U+3000 (ideographic space) is Japanese typography, kept as is.
_WHITESPACE_RUN = re.compile(r"[^\S\u3000]+")


def normalize_text(text: str) -> str:
    """Strip and collapse internal whitespace (including newlines) to single spaces."""
    return _WHITESPACE_RUN.sub(" ", text).strip(" ")


def _encode_lines(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def install_corpus(
    out: str | os.PathLike,
    *,
    name: str,
    task: str,
    src_lang: str,
    tgt_lang: str,
    source: str,
    pairs: dict[str, tuple[list[str], list[str]]],
    force: bool,
    inputs: dict | None = None,
    stats: dict | None = None,
) -> Corpus:
    """Write a corpus into a temp dir beside `out`, then rename it into place.

    An existing corpus with the same content is left untouched; a different one is only
    replaced with force=True; a non-corpus directory that is not empty is never touched.
    inputs: what the files were made from ({split: {side: {"path", "sha256"}}} for the user's files),
    recorded in corpus.json so a pipeline can tell when they change.
    stats: what the builder read, dropped and kept (counts), recorded in corpus.json as they are.
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
    if inputs is not None:
        meta["inputs"] = inputs
    if stats is not None:
        meta["stats"] = stats

    replace_existing = False
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"{out} exists and is not a directory; choose another output path for the corpus")
        if (out / CORPUS_JSON).is_file():
            if _same_corpus_on_disk(out, meta):
                existing = read_json(out / CORPUS_JSON, CORPUS_JSON)
                recorded = {k: v for k, v in (("inputs", inputs), ("stats", stats)) if v is not None}
                if any(existing.get(k) != v for k, v in recorded.items()):
                    # the same text from changed inputs (whitespace only) or counted anew: record them, keep the files
                    atomic_write_json(out / CORPUS_JSON, {**existing, **recorded})
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
    try:
        tmp.mkdir()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out)) from None  # name the corpus, not its temp name
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and is_disk_full(e):
            raise disk_full_error(f"corpus {name}", out.parent) from None
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
