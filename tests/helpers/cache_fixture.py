"""The committed caches of tests/fixtures/cache-format/: what a cache written by this layout looks like on disk,
so that a later change to the layout must keep reading it (tests/test_cache_format_fixture.py).

    python tests/helpers/cache_fixture.py tests/fixtures/cache-format

writes one cache per backend and storage dtype (hdf5 and zarr; float16 and int8) of five sentences through a
tiny random BERT at fp32, and expected.json: per cache its key, and per sentence the sha256 of its features
and pooled vectors as the reader hands them over (float32). Regenerate only to add a layout, never over one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

SENTENCES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
    "Let there be light: and there was light.",
    "And God saw the light, that it was good.",
    "And the evening and the morning were the first day.",
]
CACHES = [(backend, dtype) for backend in ("hdf5", "zarr") for dtype in ("float16", "int8")]


def digests(reader) -> dict:
    """sha256 of each sentence's features and pooled vectors as float32 bytes, in sentence order."""
    def sha(t) -> str:
        return hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()

    return {"features": [sha(reader.features(i)) for i in range(len(reader))],
            "pooled": [sha(reader.pooled(i)) for i in range(len(reader))],
            "lengths": [int(n) for n in reader.lengths]}


def main(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import tiny_prlms
    from prlmfuse.cache_features import CacheReader, build_cache

    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_prlms.build_tiny("bert", Path(tmp) / "bert", layers=2, width=16, max_positions=64)
        corpus = Path(tmp) / "five.src"
        corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
        for backend, dtype in CACHES:
            name = f"{backend}-{dtype}"
            shutil.rmtree(out / name, ignore_errors=True)
            result = build_cache(str(checkpoint), corpus, out / name, layers="-1,-2", backend=backend, dtype=dtype,
                                 device="cpu", precision="fp32", progress=False)
            (out / name / ".lock").unlink(missing_ok=True)
            reader = CacheReader(result.path)
            expected[name] = {"key": reader.key, "layers": reader.layers, **digests(reader)}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
