"""The storage side of a cache build (cache_features/background_writer.py): encoding runs on encoder threads,
not the model's; one shard commits while the next is written; the batches held between the model and the disk
stay bounded; an encoder's error reaches the caller and leaves no shard counted complete."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from prlmfuse.cache_features import CacheReader, build_cache, verify_cache
from prlmfuse.cache_features import background_writer, shard_handle, shards
from prlmfuse.cache_features.location import Location
from prlmfuse.errors import UserError

from helpers import reliability, tiny_prlms

torch.set_num_threads(1)
BUILD_ARGS = dict(layers="-2,-1", dtype="float16", max_tokens=256, shard_bytes=3000, precision="fp32", progress=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-writer")
    checkpoint = tiny_prlms.build_tiny("bert", root / "bert")
    corpus = tiny_prlms.write_corpus(root / "train.src", reliability.distinct_sentences(200))
    return root, str(checkpoint), corpus


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_batches_are_encoded_on_encoder_threads(world, tmp_path, monkeypatch, backend):
    """Packing, float16's range check and quantization run beside the model, never on its thread (what they
    store is checked against the PrLM's forward by tests/test_cache.py's round trip)."""
    _, checkpoint, corpus = world
    threads = []
    encode = background_writer.encode

    def recording_encode(x, dtype, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(x, dtype, **kwargs)

    monkeypatch.setattr(background_writer, "encode", recording_encode)
    for dtype in ("float16", "int8"):
        result = build_cache(checkpoint, corpus, tmp_path / dtype, backend=backend, **{**BUILD_ARGS, "dtype": dtype})
        verify_cache(result.path)
    assert threads and all(name.startswith("prlmfuse-cache-encode") for name in threads), set(threads)


def test_one_shard_commits_while_the_next_is_written(world, tmp_path, monkeypatch):
    """Shard k's commit waits until shard k+1 has received rows: with one writer the build could only go on
    after the commit, so every commit but the last would wait in vain."""
    _, checkpoint, corpus = world
    appended = threading.Condition()
    shards_with_rows: set[int] = set()
    overlapped: dict[int, bool] = {}
    append, commit = shards.ShardWriter.append, shards.ShardWriter.commit

    def index_of(writer) -> int:
        return int(writer.final.name.split("-")[1].split(".")[0])  # shards/shard-00003.h5 -> 3

    def counting_append(self, name, rows):
        append(self, name, rows)
        if name.startswith("layer_"):
            with appended:
                shards_with_rows.add(index_of(self))
                appended.notify_all()

    def waiting_commit(self):
        index = index_of(self)
        with appended:
            overlapped[index] = appended.wait_for(lambda: index + 1 in shards_with_rows, timeout=3.0)
        return commit(self)

    monkeypatch.setattr(shards.ShardWriter, "append", counting_append)
    monkeypatch.setattr(shards.ShardWriter, "commit", waiting_commit)
    result = build_cache(checkpoint, corpus, tmp_path / "cache", backend="hdf5", **BUILD_ARGS)
    count = len(result.manifest["shards"])
    assert count >= 6 and sorted(overlapped) == list(range(count))
    assert all(overlapped[k] for k in range(count - 1)), overlapped
    verify_cache(result.path)


class _SlowShard:
    """A shard writer that takes its time over each batch's rows, counting the batches it stored."""

    layout = 1

    def __init__(self, stored: list):
        self.stored = stored

    def append(self, name, rows):
        if name == "pooled":
            time.sleep(0.02)
            self.stored.append(len(rows))

    def commit(self):
        return "0" * 64

    def abort(self):
        pass


def test_batches_between_the_model_and_the_disk_stay_bounded(tmp_path, monkeypatch):
    stored: list[int] = []
    monkeypatch.setattr(background_writer, "create_shard", lambda *args: _SlowShard(stored))
    writer = background_writer.BackgroundWriter(Location(tmp_path), "hdf5", "k" * 64, (0,), "float16", encoders=2)
    writer.open("shard-00000.h5", {}, {}, {})
    handed, held = 0, []
    for _ in range(30):
        writer.append(lambda: background_writer.HostBatch(torch.randn(1, 4, 3, 8), torch.randn(4, 1, 2, 8)))
        handed += 1
        held.append(handed - len(stored))
    writer.commit()
    writer.close()
    assert len(stored) == 30
    assert 2 <= max(held) <= background_writer.IN_FLIGHT, held  # the bound held, and the slow disk reached it


def test_a_full_disk_names_the_earliest_shard_whichever_writer_fails_first(world, tmp_path, monkeypatch):
    """Shards 5 and 6 sit on the two writer threads; 6 meets the full disk first, 5 only after. The build
    names shard 5, the one a rerun resumes from, and the rerun completes the cache."""
    _, checkpoint, corpus = world
    create, fail = background_writer.create_shard, background_writer.BackgroundWriter._fail
    later_failed = threading.Event()

    def full_disk_create(location, backend, name, specs):
        index = int(name.split("shard-")[1][:5])  # shards/shard-00005.h5 -> 5
        if index == 5:
            # Shard 6 opens while this waits: BUILD_ARGS give one batch per shard, fewer than IN_FLIGHT.
            reached = later_failed.wait(timeout=60.0)
            assert reached, "shard 6 never failed on its writer"
        if index >= 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return create(location, backend, name, specs)

    def recording_fail(self, error, order, name):
        fail(self, error, order, name)
        if name == "shard-00006.h5":
            later_failed.set()  # shard 6's error is recorded before shard 5 meets the full disk

    monkeypatch.setattr(background_writer, "create_shard", full_disk_create)
    monkeypatch.setattr(background_writer.BackgroundWriter, "_fail", recording_fail)
    out = tmp_path / "cache"
    with pytest.raises(UserError) as failed:
        build_cache(checkpoint, corpus, out, backend="hdf5", **BUILD_ARGS)
    assert str(failed.value) == f"disk full while writing shard shard-00005.h5 in {out}; free space and rerun to resume"
    assert sorted(p.name for p in (out / "progress").iterdir()) == [f"shard-{i:05d}.h5.json" for i in range(5)]
    monkeypatch.setattr(background_writer, "create_shard", create)
    monkeypatch.setattr(background_writer.BackgroundWriter, "_fail", fail)
    verify_cache(build_cache(checkpoint, corpus, out, backend="hdf5", **BUILD_ARGS).path)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_an_encoders_error_is_raised_by_the_build_and_no_shard_of_it_counts(world, tmp_path, monkeypatch, backend):
    """Features past float16's range found on an encoder thread: the build raises that one line, and the shards
    it had not finished leave neither a progress record nor a temp file."""
    _, checkpoint, corpus = world
    encode, calls = background_writer.encode, []

    def failing_encode(x, dtype, **kwargs):
        calls.append(1)
        return encode(x * 1e6 if len(calls) == 9 else x, dtype, **kwargs)

    monkeypatch.setattr(background_writer, "encode", failing_encode)
    out = tmp_path / "cache"
    with pytest.raises(UserError, match=r"past float16's largest .* bfloat16 or float32"):
        build_cache(checkpoint, corpus, out, backend=backend, **BUILD_ARGS)
    records = [json.loads(p.read_text()) for p in (out / "progress").glob("*.json")]
    assert len(records) < 6
    left = sorted(p.name for p in (out / "shards").iterdir())
    assert left == sorted(r["name"] for r in records), left  # no temp shard, nothing unrecorded
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(background_writer, "encode", encode)
    resumed = build_cache(checkpoint, corpus, out, backend=backend, **BUILD_ARGS)
    verify_cache(resumed.path)
    assert np.isfinite(CacheReader(resumed.path).features(0).numpy()).all()


def test_a_zarr_shard_holds_the_files_zarrs_own_array_writes_would(tmp_path, monkeypatch):
    """The shard writer streams each array's rows into one file of zarr's sharding codec itself: the shard's files
    are byte for byte what writing the same rows through the zarr array's indexing gives (every inner chunk
    stored), partial last chunks, 4-d arrays and an array of no rows included, and zarr reads them back."""
    import filecmp

    import zarr

    monkeypatch.setattr(shards, "CHUNK_BYTES", 4096)  # many inner chunks of small arrays
    rng = np.random.default_rng(0)
    arrays = {"layer_005": rng.integers(-127, 128, (1000, 48), dtype=np.int8),
              "quant_005": rng.standard_normal((1000, 9)).astype(np.float32),
              "pooled": rng.standard_normal((37, 1, 2, 48)).astype(np.float16),
              "offsets": np.arange(38, dtype=np.int64), "empty": np.zeros((0, 48), np.float16)}
    specs = {name: shards.ArraySpec(a.shape, a.dtype) for name, a in arrays.items()}
    writer = shards.create_shard(Location(tmp_path), "zarr", "written.zarr", specs)
    for name, array in arrays.items():
        for start in range(0, len(array), 97):  # appends that straddle inner chunks
            writer.append(name, array[start : start + 97])
    writer.commit()

    written_group = zarr.open_group(tmp_path / "written.zarr", mode="r")
    group = zarr.open_group(zarr.storage.LocalStore(tmp_path / "reference.zarr"), mode="w")
    for name, array in arrays.items():
        reference = group.create_array(name, shape=array.shape, dtype=array.dtype, compressors=None, fill_value=0,
                                       chunks=written_group[name].chunks, shards=written_group[name].shards,
                                       config={"write_empty_chunks": True})
        reference[...] = array
    written = sorted(str(p.relative_to(tmp_path / "written.zarr")) for p in (tmp_path / "written.zarr").rglob("*"))
    assert written == sorted(str(p.relative_to(tmp_path / "reference.zarr")) for p in (tmp_path / "reference.zarr").rglob("*"))
    assert written_group["layer_005"].shards[0] // written_group["layer_005"].chunks[0] > 5  # inner chunks of one file
    files = [name for name in written if (tmp_path / "written.zarr" / name).is_file()]
    assert sum(name.startswith("layer_005/c/") for name in files) == 1
    _, differ, errors = filecmp.cmpfiles(tmp_path / "written.zarr", tmp_path / "reference.zarr", files, shallow=False)
    assert not differ and not errors
    assert all(np.array_equal(written_group[name][...], array) for name, array in arrays.items())


def test_a_zarr_shard_of_back_to_back_chunks_is_read_straight_from_its_file(tmp_path, monkeypatch):
    """The reader finds the writer's shard files (inner chunks back to back, as their index says) and reads rows
    with scatter reads from the file; an array zarr wrote with an empty chunk left out, and one of the older
    layout (a file per chunk), are read through zarr's API to the same values; an index whose crc32c fails makes
    the shard unreadable rather than read wrong."""
    import zarr

    monkeypatch.setattr(shards, "CHUNK_BYTES", 4096)
    rng = np.random.default_rng(1)
    values = rng.standard_normal((700, 32)).astype(np.float16)
    values[128:256] = 0  # one whole inner chunk (128 rows of 64 B) of the fill value
    writer = shards.create_shard(Location(tmp_path), "zarr", "ours.zarr", {"layer_001": shards.ArraySpec(values.shape, values.dtype)})
    writer.append("layer_001", values)
    writer.commit()
    group = zarr.open_group(zarr.storage.LocalStore(tmp_path / "theirs.zarr"), mode="w")
    group.create_array("sharded", shape=values.shape, dtype=values.dtype, chunks=(128, 32), shards=(768, 32),
                       compressors=None, fill_value=0)[...] = values  # zarr leaves the empty chunk out
    group.create_array("chunk_files", shape=values.shape, dtype=values.dtype, chunks=(128, 32), compressors=None,
                       fill_value=0)[...] = values

    ours = shard_handle.ShardHandle(Location(tmp_path), "zarr", "ours.zarr")
    theirs = shard_handle.ShardHandle(Location(tmp_path), "zarr", "theirs.zarr")
    assert isinstance(ours.arrays["layer_001"], shard_handle._FileRegion)
    assert not any(isinstance(a, shard_handle._FileRegion) for a in theirs.arrays.values())
    for handle, name in ((ours, "layer_001"), (theirs, "sharded"), (theirs, "chunk_files")):
        assert np.array_equal(handle.read(name), values)
        targets = np.full((60, 32), 7, np.float16)
        handle.read_into(name, 100, 300, [(0, targets[:20]), (150, targets[20:60])])  # across inner chunks
        assert np.array_equal(targets[:20], values[100:120]) and np.array_equal(targets[20:], values[250:290])

    shard_file = tmp_path / "ours.zarr" / "layer_001" / "c" / "0" / "0"
    data = bytearray(shard_file.read_bytes())
    data[-20] ^= 0x01  # inside the index
    shard_file.write_bytes(bytes(data))
    with pytest.raises(OSError, match="crc32c"):
        shard_handle.ShardHandle(Location(tmp_path), "zarr", "ours.zarr")
    shard_file.write_bytes(bytes(data[:-1000]))  # truncated: its tail is no index
    with pytest.raises(OSError, match="truncated or damaged"):
        shard_handle.ShardHandle(Location(tmp_path), "zarr", "ours.zarr")
