"""Stage one, the feature cache: extraction semantics, storage round trips, keys, errors, verify."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

from prlmfuse.cache_features import (
    CacheReader,
    build_cache,
    cache_key,
    feature_scale,
    inspect_cache,
    parse_layers,
    verify_cache,
)
from prlmfuse.cache_features.extract import (
    FeatureExtractor,
    collate,
    encode_corpus,
    middle_cut,
    pad_token_id,
    plan_batches,
)
from prlmfuse.errors import UserError

from helpers import tiny_prlms

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> directory of a saved tiny random-weight checkpoint (built once per module)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: tiny_prlms.build_tiny(family, root / family) for family in tiny_prlms.FAMILIES}


@pytest.fixture
def corpus(tmp_path):
    return tiny_prlms.write_corpus(tmp_path / "train.src", tiny_prlms.SENTENCES * 3)


def _load(path):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _reference(path, lines, layer, max_length):
    """Per-sentence fp32 features from a plain full forward, one sentence at a time."""
    model, tokenizer = _load(path)
    encoded = encode_corpus(tokenizer, lines, max_length=max_length)
    out = []
    with torch.inference_mode():
        for i in range(encoded.num_sentences):
            ids = torch.from_numpy(encoded.ids(i).astype(np.int64))[None]
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
            out.append(hidden[layer][0])
    return out


# ----------------------------------------------------------------------------- pure pieces


def test_parse_layers_forms_and_range():
    assert parse_layers("-2", 6).token_layers == (5,)
    assert parse_layers("-2,-3", 6).token_layers == (4, 5)
    assert parse_layers("all", 2).token_layers == (0, 1, 2)
    assert parse_layers([3, -1, 6], 6).token_layers == (3, 6)
    assert parse_layers("-2", 6).pooled_layers == (5,) and parse_layers("all", 2).pooled_layers == (0, 1, 2)
    with pytest.raises(UserError, match=r"valid range is -7\.\.6"):
        parse_layers("7", 6)
    with pytest.raises(UserError, match="comma-separated"):
        parse_layers("penultimate", 6)


def test_middle_cut_keeps_head_tail_and_specials():
    ids = [101] + list(range(1000, 1100)) + [102]
    cut = middle_cut(ids, 20)
    assert len(cut) == 20 and cut[0] == 101 and cut[-1] == 102
    assert cut[:5] == ids[:5] and cut[5:] == ids[-15:]
    assert middle_cut(ids[:10], 20) == ids[:10]


def test_plan_is_length_sorted_budgeted_and_stable():
    lengths = np.array([5, 3, 5, 9, 3, 1, 5, 40])
    batches = plan_batches(lengths, max_tokens=12)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(8))
    assert flat.tolist() == [5, 1, 4, 0, 2, 6, 3, 7]  # ties keep corpus order
    for batch in batches:
        assert len(batch) == 1 or len(batch) * lengths[batch].max() <= 12
    assert [b.tolist() for b in plan_batches(lengths, 12)] == [b.tolist() for b in batches]


def test_empty_lines_and_causal_without_bos(tiny):
    _, bert_tok = _load(tiny["bert"])
    _, gpt2_tok = _load(tiny["gpt2"])
    bert = encode_corpus(bert_tok, ["", "a"], max_length=16)
    assert bert.ids(0).tolist() == [bert_tok.cls_token_id, bert_tok.sep_token_id]
    gpt2 = encode_corpus(gpt2_tok, ["", "a"], max_length=16)
    assert gpt2.ids(0).tolist() == [gpt2_tok.bos_token_id]


# ----------------------------------------------------------------------------- model semantics


@pytest.mark.parametrize("family", tiny_prlms.FAMILIES)
def test_truncated_view_equals_full_forward_hidden_states(tiny, family):
    """Every layer k computed by the sliced view equals HF's hidden_states[k] (final norm only on the last)."""
    model, tokenizer = _load(tiny[family])
    num_layers = model.config.num_hidden_layers
    encoded = encode_corpus(tokenizer, tiny_prlms.SENTENCES, max_length=48)
    ids, mask = collate(encoded, np.arange(encoded.num_sentences), pad_token_id(tokenizer))
    with torch.inference_mode():
        full = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    real = mask.bool()
    for k in range(num_layers + 1):
        extractor = FeatureExtractor(model, parse_layers(str(k), num_layers))
        token_states, pooled = extractor(ids, mask)
        torch.testing.assert_close(token_states[0][real], full[k][real], rtol=0, atol=0)
        assert pooled.shape[1] == 1  # the stored layer's own vectors only
        torch.testing.assert_close(pooled[:, 0, 0], full[k][:, 0], rtol=0, atol=1e-6)
        mean = (full[k] * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        torch.testing.assert_close(pooled[:, 0, 1], mean, rtol=1e-5, atol=1e-6)
    # the caller's model is untouched: still all layers, final norm in place
    with torch.inference_mode():
        again = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(again) == num_layers + 1
    torch.testing.assert_close(again[-1], full[-1], rtol=0, atol=0)


def test_features_do_not_depend_on_batch_composition(tiny, corpus, tmp_path):
    small = build_cache(str(tiny["bert"]), corpus, tmp_path / "small", dtype="float32", max_tokens=24,
                        precision="fp32", progress=False, layers="all")
    large = build_cache(str(tiny["bert"]), corpus, tmp_path / "large", dtype="float32", max_tokens=4096,
                        precision="fp32", progress=False, layers="all")
    assert len(small.manifest["shards"]) >= 1
    a, b = CacheReader(small.path), CacheReader(large.path)
    assert a.key == b.key  # the budget is not part of what is cached
    reference = _reference(tiny["bert"], tiny_prlms.SENTENCES * 3, 2, max_length=64)
    for i in range(len(a)):
        torch.testing.assert_close(a.features(i), b.features(i), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.pooled(i), b.pooled(i), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.features(i)[2], reference[i], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- storage round trips


_TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2, "int8": 1.6e-2}


def test_a_cache_keeping_more_layers_pooled_vectors_is_reused(tiny, corpus, tmp_path, monkeypatch):
    """A complete cache that kept the pooled vectors of every layer up to its highest holds all a build
    of its stored layers writes: it is reused as it is, not refused as another cache."""
    from prlmfuse.cache_features.extract import LayerSelection

    out = tmp_path / "cache"
    with monkeypatch.context() as m:
        m.setattr(LayerSelection, "pooled_layers", property(lambda self: tuple(range(self.highest + 1))))
        first = build_cache(str(tiny["gpt2"]), corpus, out, layers="-2", precision="fp32", progress=False)
    assert first.manifest["pooled_layers"] == [0, 1, 2]
    again = build_cache(str(tiny["gpt2"]), corpus, out, layers="-2", precision="fp32", progress=False)
    assert again.reused and again.key == first.key
    other = build_cache(str(tiny["gpt2"]), corpus, tmp_path / "new", layers="-2", precision="fp32", progress=False)
    assert other.manifest["pooled_layers"] == [2] and other.key != first.key
    reader = CacheReader(out)
    assert torch.equal(reader.features(3), CacheReader(tmp_path / "new").features(3))
    # Its manifest damaged: no longer a cache to reuse, and never one to resume under the new fields.
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["num_tokens"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="holds a different cache"):
        build_cache(str(tiny["gpt2"]), corpus, out, layers="-2", precision="fp32", progress=False)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_roundtrip_every_backend_and_dtype(tiny, corpus, tmp_path, backend, dtype):
    out = tmp_path / "cache"
    result = build_cache(str(tiny["gpt2"]), corpus, out, layers="-2,-1", backend=backend, dtype=dtype,
                         max_tokens=64, precision="fp32", progress=False, shard_bytes=4096)
    assert not result.reused and len(result.manifest["shards"]) > 2
    verify_cache(out)
    reader = CacheReader(out)
    assert reader.layers == [2, 3] and reader.pooled_layers == [2, 3] and reader.hidden_size == 32
    lines = tiny_prlms.SENTENCES * 3
    ref2 = _reference(tiny["gpt2"], lines, 2, max_length=64)
    ref3 = _reference(tiny["gpt2"], lines, 3, max_length=64)
    for i in range(len(lines)):
        features = reader.features(i)
        assert features.dtype == torch.float32 and features.shape == (2, len(ref2[i]), 32)
        narrow = reader.features(i, widen=False)  # what a DataLoader worker hands over
        assert narrow.dtype == {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
        assert torch.equal(narrow.float(), features)
        for stored, ref in ((features[0], ref2[i]), (features[1], ref3[i])):
            # relative to each token's absmax: int8 is per-token absmax quantized
            err = (stored - ref).abs().amax(-1) / ref.abs().amax(-1)
            assert float(err.max()) <= _TOLERANCE[dtype], (i, float(err.max()))
        pooled = reader.pooled(i)
        assert pooled.shape == (2, 2, 32)
        pooled_tol = _TOLERANCE["float16" if dtype == "int8" else dtype] * 4
        torch.testing.assert_close(pooled[0, 0], ref2[i][0], rtol=pooled_tol, atol=pooled_tol)
        torch.testing.assert_close(pooled[1, 1], ref3[i].mean(0), rtol=pooled_tol, atol=pooled_tol)
    assert reader.lengths[8] == 1  # the empty line: one BOS token for a causal LM without one
    stats = inspect_cache(out)
    assert stats["num_sentences"] == len(lines) and stats["num_tokens"] == int(reader.lengths.sum())
    assert stats["truncated_sentences"] == 3 and stats["truncated_tokens"] > 0
    assert stats["size_on_disk"] > 0 and stats["bytes_per_token"] > 0
    build = stats["build"]  # how it was built, for the reader: never part of the key
    assert build["seconds"] > 0 and build["resumed_shards"] == 0 and build["precision"] == "fp32"
    assert build["max_tokens"] == 64 and build["world_size"] == 1
    assert "build" not in stats["key_fields"]


def test_in_memory_reader_equals_on_disk(tiny, corpus, tmp_path):
    build_cache(str(tiny["bert"]), corpus, tmp_path / "c", dtype="int8", progress=False, shard_bytes=2048)
    disk, memory = CacheReader(tmp_path / "c"), CacheReader(tmp_path / "c", in_memory=True)
    # row-range reads across chunk boundaries give what whole-array reads give
    for i in range(len(disk)):
        assert torch.equal(disk.features(i), memory.features(i))
        assert torch.equal(disk.pooled(i), memory.pooled(i))
    with pytest.raises(IndexError):
        disk.features(len(disk))


@pytest.mark.parametrize("in_memory", [False, True])
def test_writing_into_read_features_leaves_the_cache_alone(tiny, corpus, tmp_path, in_memory):
    """One float32 layer comes back without a copy from disk (a fresh buffer); never as a view of the in-memory cache."""
    build_cache(str(tiny["bert"]), corpus, tmp_path / "c", layers="-2", dtype="float32", progress=False)
    reader = CacheReader(tmp_path / "c", in_memory=in_memory)
    first = reader.features(0)
    expected = first.clone()
    first.mul_(0)
    assert torch.equal(reader.features(0), expected)


@pytest.mark.parametrize("url_scheme", ["memory", "file"])
def test_zarr_on_fsspec_urls(tiny, corpus, tmp_path, url_scheme):
    local = build_cache(str(tiny["distilbert"]), corpus, tmp_path / "local", progress=False, shard_bytes=2048)
    url = f"memory://prlmfuse-test-{tmp_path.name}/cache" if url_scheme == "memory" else f"file://{tmp_path}/remote"
    remote = build_cache(str(tiny["distilbert"]), corpus, url, progress=False, shard_bytes=2048)
    assert remote.key == local.key
    assert [s["sha256"] for s in remote.manifest["shards"]] == [s["sha256"] for s in local.manifest["shards"]]
    verify_cache(url)
    a, b = CacheReader(local.path), CacheReader(url)
    for i in range(len(a)):
        assert torch.equal(a.features(i), b.features(i))
    again = build_cache(str(tiny["distilbert"]), corpus, url, progress=False, shard_bytes=2048)
    assert again.reused
    with pytest.raises(UserError, match="hdf5 backend needs a local directory"):
        build_cache(str(tiny["distilbert"]), corpus, url + "-h5", backend="hdf5", progress=False)


@pytest.mark.parametrize("url_scheme", ["memory", "file"])
def test_zarr_at_a_url_is_read_by_one_ranged_read_a_stretch_its_index_checked_once(tiny, corpus, tmp_path,
                                                                                    url_scheme, monkeypatch):
    """Layout 2 at a URL: each row range one ranged read of the array's shard file (an object store's ranged
    GET), never zarr's API with its index fetch per read; a damaged index makes the shard unreadable."""
    import zarr

    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shard_handle import ShardHandle

    url = f"memory://prlmfuse-ranged-{tmp_path.name}/cache" if url_scheme == "memory" else f"file://{tmp_path}/remote"
    local = CacheReader(build_cache(str(tiny["distilbert"]), corpus, tmp_path / "local", progress=False,
                                    shard_bytes=2048).path)
    built = build_cache(str(tiny["distilbert"]), corpus, url, progress=False, shard_bytes=2048)
    reader = CacheReader(url)
    fs = Location(url).fs
    reads = []
    cat_file = type(fs).cat_file

    def counted(self, path, start=None, end=None, **kwargs):
        reads.append((path, start, end))
        return cat_file(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", counted)
    monkeypatch.setattr(zarr.Array, "__getitem__", lambda *a, **k: pytest.fail("read through zarr's API"))
    ids = list(range(len(reader)))
    for i in ids:  # opens every shard: each array's index is checked then, once
        assert torch.equal(reader.features(i), local.features(i))
    assert len(reader._handles) == len(built.manifest["shards"])
    assert all(a.fs is not None for h in reader._handles.values() for a in h.arrays.values() if a.shape[0])
    reads.clear()
    for i in ids[::-1]:
        assert torch.equal(reader.features(i), local.features(i))
    # float16, one layer: one ranged read of a sentence's rows, no index read
    assert len(reads) == len(ids) and all(start is not None and end > start for _, start, end in reads)
    reader.close()
    monkeypatch.undo()
    # flip a byte of one array's index (its last bytes): the shard no longer opens, and verify names it
    shard = built.manifest["shards"][0]["name"]
    location = Location(url)
    target = next(p for p in fs.find(location.full(f"shards/{shard}")) if "layer_" in p and p.endswith("/c/0/0"))
    data = bytearray(fs.cat_file(target))
    data[-6] ^= 0x01
    fs.pipe_file(target, bytes(data))
    with pytest.raises(OSError, match="crc32c"):
        ShardHandle(location, "zarr", f"shards/{shard}")
    with pytest.raises(UserError, match=shard):
        verify_cache(url)


def _serve_with_ranges(directory):
    """A local HTTP server over `directory` that answers Range requests (as object stores do); returns it."""
    import functools
    import http.server
    import io
    import re

    class RangeHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_head(self):
            path = self.translate_path(self.path)
            if os.path.isdir(path) or "Range" not in self.headers or not os.path.exists(path):
                return super().send_head()
            data = open(path, "rb").read()
            first, last = re.match(r"bytes=(\d+)-(\d*)", self.headers["Range"]).groups()
            start, end = int(first), int(last) + 1 if last else len(data)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            return io.BytesIO(data[start:end])

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _read_in_child(reader, expected, queue):
    try:
        queue.put(all(torch.equal(reader.features(i), expected[i]) for i in range(len(expected))))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
        queue.put(f"{type(e).__name__}: {e}")


def test_a_reader_of_an_http_cache_reads_in_a_forked_worker(tiny, corpus, tmp_path):
    """An async fsspec filesystem (http, s3, gcs) refuses to run in a process forked from the one that made it:
    a reader handed to a forked DataLoader worker makes its own."""
    pytest.importorskip("aiohttp")
    import multiprocessing

    built = build_cache(str(tiny["distilbert"]), corpus, tmp_path / "served" / "cache", progress=False,
                        shard_bytes=2048)
    local = CacheReader(built.path)
    expected = [local.features(i) for i in range(len(local))]
    server = _serve_with_ranges(tmp_path / "served")
    try:
        reader = CacheReader(f"http://127.0.0.1:{server.server_address[1]}/cache")
        assert torch.equal(reader.features(0), expected[0])  # the parent reads, and keeps its filesystem
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_read_in_child, args=(reader, expected, queue))
        child.start()
        read = queue.get(timeout=60)
        assert read is True, read
        child.join(timeout=60)
        reader.close()
    finally:
        server.shutdown()


def test_hdf5_shards_read_by_file_offset_match_h5py_and_a_truncated_one_is_named(tiny, corpus, tmp_path,
                                                                                  monkeypatch):
    """The reader's preadv path returns exactly what h5py reads, for every array, dtype and row range,
    also when the system hands a read back in pieces."""
    import os

    import h5py

    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shard_handle import ShardHandle

    out = tmp_path / "c"
    result = build_cache(str(tiny["gpt2"]), corpus, out, layers="-2,-1", backend="hdf5", dtype="int8",
                         max_tokens=64, precision="fp32", progress=False, shard_bytes=4096)
    shards = [s["name"] for s in result.manifest["shards"]]
    for name in shards:
        handle = ShardHandle(Location(out), "hdf5", f"shards/{name}")
        with h5py.File(out / "shards" / name, "r") as f:
            assert sorted(f.keys()) == handle.names()
            for array in handle.names():
                n = f[array].shape[0]
                for start, stop in ((None, None), (0, 1), (1, n), (n - 1, n), (2, 2), (3, 1)):
                    ours = handle.read(array, start, stop)
                    theirs = f[array][slice(start, stop)]
                    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (array, start, stop)
                    assert ours.tobytes() == theirs.tobytes(), (array, start, stop)
        handle.close()
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(fd, [buffers[0][:7]], offset))
    handle = ShardHandle(Location(out), "hdf5", f"shards/{shards[0]}")
    with h5py.File(out / "shards" / shards[0], "r") as f:
        assert handle.read("layer_003", 1, 4).tobytes() == f["layer_003"][1:4].tobytes()
    handle.close()
    monkeypatch.undo()
    victim = out / "shards" / shards[-1]
    handle = ShardHandle(Location(out), "hdf5", f"shards/{shards[-1]}")
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(OSError, match=f"short read of layer_003 .* in shard shards/{shards[-1]}"):
        handle.read("layer_003")  # truncated under an open handle: an error, never a short array
    handle.close()
    with pytest.raises(UserError, match=shards[-1]):
        verify_cache(out)


@pytest.mark.parametrize("backend, dtype", [("hdf5", "float16"), ("hdf5", "bfloat16"), ("hdf5", "float32"),
                                            ("hdf5", "int8"), ("zarr", "float16")])
def test_features_into_writes_each_sentence_into_its_padded_row_and_nothing_else(tiny, corpus, tmp_path, monkeypatch,
                                                                                  backend, dtype):
    """features_into fills out[k][:, :length] with what features() gives, whether the rows are read straight into
    out (a scatter read, split over several preadv calls here) or copied: sentences asked in any order, a
    sentence asked twice, neighbours across shards; the rows past each sentence are left as they were."""
    from prlmfuse.cache_features import shard_handle
    from prlmfuse.cache_features.codecs import numpy_view

    monkeypatch.setattr(shard_handle, "IOV_MAX", 3)  # a stretch's scatter read takes many preadv calls
    preadv = os.preadv
    # and each call returns less than asked, as reads from a network filesystem may
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(fd, [buffers[0][:1000]], offset))
    build_cache(str(tiny["bert"]), corpus, tmp_path / "c", layers="1,-1", backend=backend, dtype=dtype,
                progress=False, shard_bytes=4096, max_tokens=64)
    for in_memory in (False, True):
        reader = CacheReader(tmp_path / "c", in_memory=in_memory)
        stored = reader.stored_order().tolist()
        # neighbours; every other stored sentence (the rows between are read and dropped); one asked twice; any
        for asked in (stored[2:30][::-1], stored[0:40:2], stored[5:12] + [stored[7]],
                      np.random.RandomState(1).permutation(len(reader))[:25].tolist()):
            width = int(reader.lengths[asked].max()) + 3
            padded = torch.full((len(asked), 2, width, reader.hidden_size), -5.0).to(reader.transfer_dtype)
            reader.features_into(asked, [1, 0], list(numpy_view(padded)))
            for k, i in enumerate(asked):
                n = int(reader.lengths[i])
                assert torch.equal(padded[k, :, :n], reader.features(i, [1, 0], widen=False)), (in_memory, k, i)
                assert (padded[k, :, n:] == -5).all()


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_read_into_fills_its_targets_skips_empty_ones_and_refuses_a_wrong_row_layout(tmp_path, backend):
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shard_handle import ShardHandle
    from prlmfuse.cache_features.shards import ArraySpec, create_shard, shard_suffix

    rows = np.arange(40 * 6, dtype=np.float16).reshape(40, 6)
    name = f"s{shard_suffix(backend)}"
    writer = create_shard(Location(tmp_path), backend, name, {"layer_001": ArraySpec(rows.shape, rows.dtype)})
    writer.append("layer_001", rows)
    writer.commit()
    handle = ShardHandle(Location(tmp_path), backend, name)
    a, empty, b = np.zeros((3, 6), np.float16), np.zeros((0, 6), np.float16), np.zeros((5, 6), np.float16)
    handle.read_into("layer_001", 10, 30, [(2, a), (5, empty), (14, b)])
    assert np.array_equal(a, rows[12:15]) and np.array_equal(b, rows[24:29])
    if backend == "hdf5":  # the scatter read: a target must hold rows as stored
        with pytest.raises(ValueError, match="a target of float32"):
            handle.read_into("layer_001", 0, 4, [(0, np.zeros((4, 6), np.float32))])
    handle.close()


@pytest.mark.parametrize("backend, dtype", [("hdf5", "int8"), ("zarr", "float16")])
def test_neighbouring_stored_sentences_are_read_together_and_match_one_by_one(tiny, corpus, tmp_path, monkeypatch,
                                                                               backend, dtype):
    """features_many / pooled_many equal features / pooled sentence by sentence, in the order asked, and a
    stretch of the stored order costs one read per array and shard."""
    from prlmfuse.cache_features.shard_handle import ShardHandle

    build_cache(str(tiny["bert"]), corpus, tmp_path / "c", layers="1,-1", backend=backend, dtype=dtype,
                progress=False, shard_bytes=4096, max_tokens=64)
    reader = CacheReader(tmp_path / "c")
    assert len(reader.manifest["shards"]) > 2
    stored = reader.stored_order()
    assert sorted(stored.tolist()) == list(range(len(reader)))
    asked = np.random.RandomState(0).permutation(len(reader))[: len(reader) // 2].tolist() + [stored[0], stored[0]]
    for widen in (True, False):
        got = reader.features_many(asked, [1], widen=widen)
        for i, features in zip(asked, got):
            assert torch.equal(features, reader.features(i, [1], widen=widen)), i
    assert torch.equal(reader.pooled_many(asked), torch.stack([reader.pooled(i) for i in asked]))
    memory = CacheReader(tmp_path / "c", in_memory=True)
    kept = memory.features(stored[0], widen=False).clone()
    for features in memory.features_many([stored[0], stored[1]], widen=False):
        features.fill_(7)  # a caller's copy: the cache in memory is not written
    assert torch.equal(memory.features(stored[0], widen=False), kept)
    assert reader.features_many([]) == [] and reader.pooled_many([]).shape == (0, len(reader.pooled_layers), 2,
                                                                                reader.hidden_size)

    reads = []
    read = ShardHandle.read
    monkeypatch.setattr(ShardHandle, "read", lambda self, name, *a: reads.append((self.name, name)) or read(self, name, *a))
    stretch = stored[3:40][::-1].tolist()  # neighbours, asked in any order
    shards_touched = {int(reader._shard_of[i]) for i in stretch}
    assert len(shards_touched) > 1
    assert [f.shape[1] for f in reader.features_many(stretch)] == [int(reader.lengths[i]) for i in stretch]
    arrays = 2 * (2 if dtype == "int8" else 1)  # two layers, each with its quantisation scales in int8
    assert len(reads) == len(set(reads)) == arrays * len(shards_touched)
    reads.clear()
    reader.pooled_many(stretch)
    assert len(reads) == len(shards_touched)


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_reader_in_forked_dataloader_workers(tiny, corpus, tmp_path, backend):
    """Handles the parent opened are replaced in forked workers (pid check); pickled state carries none."""
    build_cache(str(tiny["bert"]), corpus, tmp_path / "c", backend=backend, progress=False, shard_bytes=2048,
                max_tokens=64)
    reader = CacheReader(tmp_path / "c")
    assert len(reader.manifest["shards"]) > 2
    expected = [reader.features(i).sum().item() for i in range(len(reader))]  # parent now holds open handles
    assert reader._handles
    loader = torch.utils.data.DataLoader(
        range(len(reader)), batch_size=4, num_workers=2, multiprocessing_context="fork",
        collate_fn=lambda idx: torch.tensor([reader.features(i).sum().item() for i in idx]),
    )
    assert torch.cat(list(loader)).tolist() == pytest.approx(expected)
    assert reader.__getstate__()["_handles"] == {}
    reader.close()
    assert not reader._handles


# ----------------------------------------------------------------------------- key, reuse, force, lock


def test_autocast_bf16_is_close_to_fp32_and_keyed(tiny, corpus, tmp_path):
    fp32 = build_cache(str(tiny["xlm-roberta"]), corpus, tmp_path / "fp32", dtype="float32", precision="fp32",
                       progress=False)
    bf16 = build_cache(str(tiny["xlm-roberta"]), corpus, tmp_path / "bf16", dtype="float32", precision="bf16",
                       progress=False)
    assert fp32.key != bf16.key and bf16.manifest["key_fields"]["precision"] == "bf16"
    a, b = CacheReader(fp32.path), CacheReader(bf16.path)
    worst = 0.0
    for i in range(len(a)):
        x, y = a.features(i), b.features(i)
        worst = max(worst, float(((x - y).norm(dim=-1) / x.norm(dim=-1)).max()))
    assert 0 < worst < 0.05  # bf16 has ~3 significant digits; 3 layers keep the relative error small


def test_reuse_mismatch_and_force(tiny, corpus, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="prlmfuse.cache_features")
    out = tmp_path / "c"
    first = build_cache(str(tiny["electra"]), corpus, out, progress=True)
    assert not first.reused
    second = build_cache(str(tiny["electra"]), corpus, out, progress=True)
    assert second.reused and second.key == first.key
    assert "cached" in caplog.text
    with pytest.raises(UserError, match="different cache.*--force"):
        build_cache(str(tiny["electra"]), corpus, out, layers="-1", progress=False)
    with pytest.raises(UserError, match="different cache"):
        build_cache(str(tiny["electra"]), corpus, out, backend="hdf5", progress=False)
    replaced = build_cache(str(tiny["electra"]), corpus, out, layers="-1", force=True, progress=False)
    assert not replaced.reused and replaced.key != first.key
    assert CacheReader(out).layers == [3]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no prlmfuse cache"):
        build_cache(str(tiny["electra"]), corpus, tmp_path / "foreign", force=True, progress=False)


def test_cache_key_fields(tiny, corpus):
    from prlmfuse.prlms import resolve_checkpoint

    info = resolve_checkpoint(str(tiny["bert"]))
    fields = cache_key(info, corpus, "-2", "float16", precision="fp32")
    assert fields["checkpoint_identity"] == info.identity
    assert fields["layers"] == [2] and fields["dtype"] == "float16" and fields["precision"] == "fp32"
    assert fields["truncation"]["max_length"] == info.max_length
    assert len(fields["corpus_sha256"]) == 64 and fields["prlmfuse_version"]


def test_second_build_waits_for_the_lock(tiny, corpus, tmp_path, caplog):
    import fcntl

    out = tmp_path / "c"
    out.mkdir()
    results = []
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        worker = threading.Thread(
            target=lambda: results.append(build_cache(str(tiny["bert"]), corpus, out, progress=True))
        )
        worker.start()
        for _ in range(200):  # wait until the build announces that it waits (it cannot finish while we hold it)
            if "waiting" in caplog.text:
                break
            time.sleep(0.05)
        else:
            pytest.fail("second build did not report waiting for the lock")
        assert worker.is_alive() and not results
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
    worker.join(60)
    assert results and not results[0].reused
    verify_cache(out)


# ----------------------------------------------------------------------------- bad input


def test_user_errors(tiny, corpus, tmp_path):
    ckpt = str(tiny["bert"])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(UserError, match=r"bad.txt:2: invalid UTF-8"):
        build_cache(ckpt, bad, tmp_path / "o1", progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match="is empty"):
        build_cache(ckpt, empty, tmp_path / "o2", progress=False)
    with pytest.raises(UserError, match="unknown dtype 'fp8'; valid: float16, bfloat16, float32, int8"):
        build_cache(ckpt, corpus, tmp_path / "o3", dtype="fp8", progress=False)
    with pytest.raises(UserError, match="unknown backend 'lmdb'; valid: zarr, hdf5"):
        build_cache(ckpt, corpus, tmp_path / "o4", backend="lmdb", progress=False)
    with pytest.raises(UserError, match=r"valid range is -4\.\.3"):
        build_cache(ckpt, corpus, tmp_path / "o5", layers="-5", progress=False)
    with pytest.raises(UserError) as unknown:
        build_cache(str(tmp_path / "no-such-checkpoint"), corpus, tmp_path / "o6", progress=False)
    assert "\n" not in str(unknown.value)


def test_verify_names_bad_shard_and_truncated_manifest(tiny, corpus, tmp_path):
    for backend in ("zarr", "hdf5"):
        out = tmp_path / backend
        result = build_cache(str(tiny["bert"]), corpus, out, backend=backend, dtype="float32", progress=False,
                             shard_bytes=2048, max_tokens=64, precision="fp32")
        verify_cache(out)
        victim = result.manifest["shards"][1]["name"]
        shard_path = out / "shards" / victim
        target = max((p for p in shard_path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size) \
            if shard_path.is_dir() else shard_path
        data = bytearray(target.read_bytes())
        data[-7] ^= 0xFF
        target.write_bytes(bytes(data))
        with pytest.raises(UserError, match=victim):
            verify_cache(out)
    # a missing shard
    import shutil

    missing = result.manifest["shards"][0]["name"]
    (tmp_path / "hdf5" / "shards" / missing).unlink()
    with pytest.raises(UserError, match=f"{missing} is missing"):
        verify_cache(tmp_path / "hdf5")
    # a truncated manifest
    manifest = tmp_path / "zarr" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    with pytest.raises(UserError, match="truncated or corrupt"):
        verify_cache(tmp_path / "zarr")
    with pytest.raises(UserError, match="truncated or corrupt"):
        inspect_cache(tmp_path / "zarr")
    shutil.rmtree(tmp_path / "zarr")


def test_open_cache_parses_the_path_and_reads_the_manifest_once(tiny, corpus, tmp_path, monkeypatch):
    """open_cache checks a cache and opens its reader on one Location and one reading of manifest.json,
    whichever check runs: a full verify, check_cache re-hashing the shards, or check_cache trusting its memo."""
    from prlmfuse import fileio
    from prlmfuse.cache_features import manifest as manifest_module
    from prlmfuse.cache_features import open_cache
    from prlmfuse.cache_features.location import Location

    out = tmp_path / "c"
    build_cache(str(tiny["bert"]), corpus, out, progress=False, shard_bytes=2048)
    monkeypatch.setenv("PRLMFUSE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fileio, "RACY_SECONDS", -1.0)  # the memo keeps the cache just built
    counts = {"locations": 0, "manifest reads": 0, "shard checks": 0}
    init, read_bytes, verify = Location.__init__, Location.read_bytes, manifest_module.verify_cache

    def counting_init(self, path_or_url):
        counts["locations"] += 1
        init(self, path_or_url)

    def counting_read(self, name):
        counts["manifest reads"] += name == manifest_module.MANIFEST
        return read_bytes(self, name)

    def counting_verify(path):
        counts["shard checks"] += 1
        return verify(path)

    monkeypatch.setattr(Location, "__init__", counting_init)
    monkeypatch.setattr(Location, "read_bytes", counting_read)
    monkeypatch.setattr(manifest_module, "verify_cache", counting_verify)  # what check_cache calls
    source = dict(source=str(corpus), source_name="train source", source_sha256=fileio.sha256_file(corpus),
                  source_lines=len(corpus.read_text(encoding="utf-8").splitlines()))
    # verify=True; then check_cache without a memo (it re-hashes and remembers); then with it (no re-hash)
    for verify_all, shard_checks in ((True, 0), (False, 1), (False, 0)):
        counts.update({k: 0 for k in counts})
        reader = open_cache(str(out), expected_fields=None, verify=verify_all, **source)
        assert counts == {"locations": 1, "manifest reads": 1, "shard checks": shard_checks}, verify_all
        assert reader.num_sentences == source["source_lines"] and reader.path == str(out)
        assert torch.equal(reader.features(1), CacheReader(out).features(1))
    # the reader of a Location and its manifest handed over serves what a reader of the path does
    location, manifest = manifest_module.load_manifest(out)
    counts.update({k: 0 for k in counts})
    handed = CacheReader(location, manifest=manifest, in_memory=True)
    assert counts["manifest reads"] == 0 and counts["locations"] == 0
    assert handed.manifest is manifest and handed.location is location
    assert torch.equal(handed.features(2), CacheReader(out).features(2))


def test_manifest_shard_names_cannot_escape(tiny, corpus, tmp_path):
    out = tmp_path / "c"
    build_cache(str(tiny["bert"]), corpus, out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0]["name"] = "../../etc/passwd"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="invalid shard name"):
        CacheReader(out)
    with pytest.raises(UserError, match="invalid shard name"):
        verify_cache(out)


def test_a_cache_of_another_format_version_is_refused(tiny, corpus, tmp_path):
    out = tmp_path / "c"
    build_cache(str(tiny["bert"]), corpus, out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["key_fields"]["format"] = 0
    (out / "manifest.json").write_text(json.dumps(manifest))
    for open_it in (CacheReader, verify_cache, inspect_cache):
        with pytest.raises(UserError, match="cache format 0, this prlmfuse reads format 1 for float16 caches; rebuild"):
            open_it(out)
    # int8 caches of format 1 scaled each token by its absmax alone: their layout is refused, not misread.
    build_cache(str(tiny["bert"]), corpus, tmp_path / "int8", dtype="int8", progress=False)
    manifest = json.loads((tmp_path / "int8" / "manifest.json").read_text())
    assert manifest["key_fields"]["format"] == 2
    manifest["key_fields"]["format"] = 1
    (tmp_path / "int8" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="cache format 1, this prlmfuse reads format 2 for int8 caches; rebuild"):
        CacheReader(tmp_path / "int8")


# ----------------------------------------------------------------------------- the real checkpoint


def test_real_minilm_penultimate_layer(tmp_path):
    lines = [
        "In the beginning God created the heavens and the earth.",
        "",
        "Jesus wept.",
        "And God said, Let there be light: and there was light. " * 80,  # > 512 tokens: middle cut
    ]
    corpus = tiny_prlms.write_corpus(tmp_path / "c.txt", lines)
    checkpoint = str(tiny_prlms.minilm_dir())
    result = build_cache(checkpoint, corpus, tmp_path / "c", precision="fp32", dtype="float32", progress=False)
    assert result.manifest["truncated_sentences"] == 1 and result.manifest["max_length"] == 512
    reader = CacheReader(result.path)
    assert reader.hidden_size == 384 and reader.layers == [5] and reader.pooled_layers == [5]
    reference = _reference(tiny_prlms.minilm_dir(), lines, 5, max_length=512)
    for i in range(len(lines)):
        torch.testing.assert_close(reader.features(i)[0], reference[i], rtol=1e-4, atol=1e-4)
    assert reader.lengths[1] == 2 and reader.lengths[3] == 512
    # The scale figures of `cache inspect`: a LayerNorm'd encoder's states are of order 1.
    states = torch.cat([reader.features(i)[0] for i in range(len(lines))])
    norms = states.norm(dim=-1)
    scale = feature_scale(result.path)
    assert list(scale) == ["5"]
    assert scale["5"] == pytest.approx({"absmax": float(states.abs().max()), "rms": float(states.pow(2).mean().sqrt()),
                                        "token_norm_median": float(norms.median()), "token_norm_max": float(norms.max())},
                                       abs=1e-3)
    assert 0.1 < scale["5"]["rms"] < 2 and scale["5"]["absmax"] < 50
    assert list(feature_scale(result.path, sentences=1)) == ["5"]


def test_cache_built_at_one_precision_is_reused_where_the_default_differs(tiny, corpus, tmp_path):
    # Built where the default is bf16 (an AMX CPU, a recent GPU) ...
    out = tmp_path / "c"
    first = build_cache(str(tiny["bert"]), corpus, out, dtype="float32", precision="bf16", progress=False)
    assert first.manifest["key_fields"]["precision"] == "bf16"
    stamp = (out / "manifest.json").stat().st_mtime_ns
    # ... read where it is fp32: no rebuild, no --force, the cache's precision is kept.
    again = build_cache(str(tiny["bert"]), corpus, out, dtype="float32", precision="auto", progress=False)
    assert again.reused and again.key == first.key
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    # Asking for another precision explicitly is a different cache.
    with pytest.raises(UserError, match="different cache.*--force"):
        build_cache(str(tiny["bert"]), corpus, out, dtype="float32", precision="fp32", progress=False)


def test_cache_key_records_precision_not_the_machine(tiny, corpus):
    from prlmfuse.prlms import resolve_checkpoint

    info = resolve_checkpoint(str(tiny["bert"]))
    fields = cache_key(info, corpus, "-2", "float16", precision="bf16")
    assert fields["precision"] == "bf16" and "autocast" not in fields
    assert cache_key(info, corpus, "-2", "float16", precision="bf16") == fields
    with pytest.raises(ValueError):
        cache_key(info, corpus, "-2", "float16", precision="auto")
