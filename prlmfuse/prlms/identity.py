"""A PrLM checkpoint's identity: sha256 over the files that decide the hidden states it produces.

A cache key built from it changes whenever the features a checkpoint produces could change.
Per-file digests are remembered by size and mtime (prlmfuse.fileio.FileDigests): every stage resolves
its checkpoint, and re-hashing unchanged weight files each time would read them whole.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.fileio import FileDigests

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

def checkpoint_identity(directory: str | os.PathLike) -> str:
    """sha256 (hex) over sorted (relative name, file sha256) of config, weight and tokenizer files."""
    directory = Path(directory)
    files = _identity_files(directory)
    if not any(f.name.endswith(".safetensors") for f in files):
        raise UserError(
            f"no safetensors weights in checkpoint directory {directory}; pickle-based weights "
            "(pytorch_model.bin) are refused for safety, re-save the model with save_pretrained(safe_serialization=True)"
        )
    digests = FileDigests()
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(directory).as_posix()}\t{digests.sha256(f)}\n".encode("utf-8"))
    digests.save()
    return h.hexdigest()
