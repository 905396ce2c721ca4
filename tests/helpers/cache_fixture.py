"""The committed caches of tests/fixtures/cache-format/: what a cache written by this layout looks like on disk,
so that a later change to the layout must keep reading it (tests/test_cache_format_fixture.py).

    python tests/helpers/cache_fixture.py tests/fixtures/cache-format

writes, for each backend's current layout (cache_features.shards.LAYOUT) and storage dtype (float16 and int8),
a cache of five sentences through a tiny random BERT at fp32 where none is committed yet, and adds to
expected.json per cache its key, and per sentence the sha256 of its features and pooled vectors as the reader
hands them over (float32). A committed cache is never written over: it is what an older layout looks like.
"""

from __future__ import annotations

import hashlib
import json
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
# (backend, layout, dtype) of every committed cache: each layout a backend has had
CACHES = [(backend, layout, dtype) for backend, layouts in (("hdf5", (1,)), ("zarr", (1, 2)))
          for layout in layouts for dtype in ("float16", "int8")]


def fixture_name(backend: str, layout: int, dtype: str) -> str:
    return f"{backend}-{dtype}" if layout == 1 else f"{backend}-layout{layout}-{dtype}"


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

    from prlmfuse.cache_features.shards import LAYOUT

    out.mkdir(parents=True, exist_ok=True)
    expected_file = out / "expected.json"
    expected = json.loads(expected_file.read_text(encoding="utf-8")) if expected_file.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_prlms.build_tiny("bert", Path(tmp) / "bert", layers=2, width=16, max_positions=64)
        corpus = Path(tmp) / "five.src"
        corpus.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
        for backend, layout, dtype in CACHES:
            name = fixture_name(backend, layout, dtype)
            if layout != LAYOUT[backend] or (out / name).exists():
                continue
            result = build_cache(str(checkpoint), corpus, out / name, layers="-1,-2", backend=backend, dtype=dtype,
                                 device="cpu", precision="fp32", progress=False)
            (out / name / ".lock").unlink(missing_ok=True)
            reader = CacheReader(result.path)
            expected[name] = {"key": reader.key, "layers": reader.layers, **digests(reader)}
    expected_file.write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
