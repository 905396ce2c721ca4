"""A PrLM checkpoint's identity: sha256 over the files that decide the hidden states it produces.

A cache key built from it changes whenever the features a checkpoint produces could change.
Per-file digests are remembered in $PRLMFUSE_HOME/file_digests.json.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import time
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, prlmfuse_home, sha256_file

# Files that decide what hidden states a checkpoint produces. Everything else in a model
# directory (README, sentence-transformers pooling folders, our own source marker) is ignored.
IDENTITY_PATTERNS = (
    "config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.*", "merges.txt", "*.model", "*.py",
)


def _identity_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in IDENTITY_PATTERNS)
    )

class _DigestCache:
    """Per-file sha256 keyed by (real path, size, mtime) in $PRLMFUSE_HOME/file_digests.json.

    Hashing a 500 MB weight file takes seconds; every stage resolves its checkpoint, so this makes
    the second resolution cost a few stat calls. A file modified in the last few seconds is never
    cached: filesystem timestamps are coarse (a tick of several ms), so a quick second write could
    leave size and mtime unchanged ("racy git" problem).
    """

    RACY_SECONDS = 3.0

    def __init__(self) -> None:
        self.path = prlmfuse_home() / "file_digests.json"
        try:
            with open(self.path, encoding="utf-8") as f:
                self.entries: dict[str, dict] = json.load(f).get("files", {})
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            # A lost or damaged digest cache only costs re-hashing.
            self.entries = {}
        self.dirty = False

    def digest(self, path: Path) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        entry = self.entries.get(real)
        if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
            return entry["sha256"]
        digest = sha256_file(real)
        if time.time() - st.st_mtime > self.RACY_SECONDS:
            self.entries[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        # Concurrent resolutions may each write; the last one wins and the others just re-hash later.
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, {"version": 1, "files": live})


def checkpoint_identity(directory: str | os.PathLike) -> str:
    """sha256 (hex) over sorted (relative name, file sha256) of config, weight and tokenizer files."""
    directory = Path(directory)
    files = _identity_files(directory)
    if not any(f.name.endswith(".safetensors") for f in files):
        raise UserError(
            f"no safetensors weights in checkpoint directory {directory}; pickle-based weights "
            "(pytorch_model.bin) are refused for safety, re-save the model with save_pretrained(safe_serialization=True)"
        )
    cache = _DigestCache()
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(directory).as_posix()}\t{cache.digest(f)}\n".encode("utf-8"))
    cache.save()
    return h.hexdigest()
