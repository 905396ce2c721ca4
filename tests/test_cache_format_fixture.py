"""Caches written in every layout stay readable: the committed caches of tests/fixtures/cache-format/ (each
backend's layouts, float16 and int8; tests/helpers/cache_fixture.py wrote them) read back to the features they
held when written, verify against their own shard hashes, and `cache inspect` names their layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.cache_fixture import CACHES, digests, fixture_name

FIXTURES = Path(__file__).parent / "fixtures" / "cache-format"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("backend, layout, dtype", CACHES)
def test_a_cache_of_a_committed_layout_reads_back_what_it_held(tmp_path, backend, layout, dtype):
    from prlmfuse.cache_features import CacheReader, inspect_cache, verify_cache

    name = fixture_name(backend, layout, dtype)
    cache = shutil.copytree(FIXTURES / name, tmp_path / name)  # reading must not need to write, but never risk the fixture
    expected = EXPECTED[name]
    for in_memory in (False, True):
        reader = CacheReader(cache, in_memory=in_memory)
        assert (reader.key, reader.layers, reader.backend, reader.dtype) == (expected["key"], expected["layers"], backend, dtype)
        assert digests(reader) == {k: expected[k] for k in ("features", "pooled", "lengths")}
    verify_cache(cache)
    assert inspect_cache(cache)["layout"] == [layout]  # `cache inspect` still describes it


@pytest.mark.parametrize("backend, layout, dtype", CACHES)
def test_verify_finds_a_flipped_byte_in_every_array_of_every_layout(tmp_path, backend, layout, dtype):
    """One bit flipped anywhere in an array's stored bytes (each array of the shard in turn: token layers, their
    int8 scales, pooled vectors, offsets, ids; in zarr's layout 2 its first and middle byte are values, its last
    the index's crc32c) is found by `cache verify`, which names the shard."""
    from prlmfuse.cache_features import verify_cache
    from prlmfuse.errors import UserError

    name = fixture_name(backend, layout, dtype)
    shard = next((FIXTURES / name / "shards").iterdir()).name
    if backend == "hdf5":
        import h5py

        with h5py.File(FIXTURES / name / "shards" / shard, "r") as f:
            # (file, first byte, bytes) of each array's contiguous data
            places = {k: (shard, f[k].id.get_offset(), f[k].id.get_storage_size()) for k in f}
    else:
        root = FIXTURES / name / "shards"
        places = {chunk.relative_to(root / shard).parts[0]: (str(chunk.relative_to(root)), 0, chunk.stat().st_size)
                  for chunk in (root / shard).glob("*/c/**/*") if chunk.is_file()}  # one file an array here
    assert {"offsets", "pooled", "sentence_ids"} <= set(places) and sum(k.startswith("layer_") for k in places) == 2
    for array, (file, first, size) in places.items():
        for where in (first, first + size // 2, first + size - 1):
            cache = tmp_path / f"{array}-{where}"
            shutil.copytree(FIXTURES / name, cache)
            target = cache / "shards" / file
            data = bytearray(target.read_bytes())
            data[where] ^= 0x10
            target.write_bytes(bytes(data))
            with pytest.raises(UserError, match=shard):
                verify_cache(cache)


@pytest.mark.parametrize("layout, message", [(3, "layout newer than this prlmfuse reads .layout 2.; upgrade prlmfuse"),
                                             (0, "has no valid layout"), ("2", "has no valid layout")])
def test_a_shard_layout_this_prlmfuse_does_not_know_is_refused_in_one_line(tmp_path, layout, message):
    from prlmfuse.cache_features import CacheReader
    from prlmfuse.errors import UserError

    cache = shutil.copytree(FIXTURES / fixture_name("zarr", 2, "float16"), tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text(encoding="utf-8"))
    manifest["shards"][0]["layout"] = layout
    (cache / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(UserError, match=message):
        CacheReader(cache)
