"""Caches written by this layout stay readable: the committed caches of tests/fixtures/cache-format/ (each backend,
float16 and int8; tests/helpers/cache_fixture.py wrote them) read back to the features they held when written,
and verify against their own shard hashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.cache_fixture import CACHES, digests

FIXTURES = Path(__file__).parent / "fixtures" / "cache-format"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("backend, dtype", CACHES)
def test_a_cache_of_the_committed_layout_reads_back_what_it_held(tmp_path, backend, dtype):
    from prlmfuse.cache_features import CacheReader, inspect_cache, verify_cache

    name = f"{backend}-{dtype}"
    cache = shutil.copytree(FIXTURES / name, tmp_path / name)  # reading must not need to write, but never risk the fixture
    expected = EXPECTED[name]
    for in_memory in (False, True):
        reader = CacheReader(cache, in_memory=in_memory)
        assert (reader.key, reader.layers, reader.backend, reader.dtype) == (expected["key"], expected["layers"], backend, dtype)
        assert digests(reader) == {k: expected[k] for k in ("features", "pooled", "lengths")}
    verify_cache(cache)
    assert inspect_cache(cache)  # `cache inspect` still describes it
