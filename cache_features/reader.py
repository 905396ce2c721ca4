"""CacheReader: random access to cached features by sentence index, for stage two.

The sentence -> (shard, row range) index is plain numpy, built once; HDF5/Zarr handles are opened
lazily and per process (a pid check drops handles inherited through fork), so one reader can be
handed to DataLoader workers.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from prlmfuse.errors import UserError

from .manifest import SHARD_DIR, expected_arrays, load_manifest
from .codecs import decode, decode_to_transfer, numpy_view, side_arrays, transfer_dtype
from .location import Location
from .shard_handle import ShardHandle


# Neighbouring sentences at most this far apart in a shard are fetched with one read (the gap read and
# dropped): a few rows more cost less than another request to the disk.
READ_GAP_TOKENS = 64
READ_GAP_ROWS = 16


def _held_arrays(manifest: dict, layers, pooled: bool) -> set[str] | None:
    """Names of the arrays a reader holding `layers` (and the pooled rows if `pooled`) keeps in memory, None for
    every array: the index, and each of those layers' token arrays."""
    if layers is None and pooled:
        return None
    stored = [int(x) for x in manifest["layers"]]
    layers = stored if layers is None else layers
    if missing := sorted(set(layers) - set(stored)):
        raise ValueError(f"layers {missing} are not stored in this cache (it holds {stored})")
    side = side_arrays(manifest["dtype"], int(manifest["hidden_size"]))
    return ({"sentence_ids", "offsets"} | ({"pooled"} if pooled else set())
            | {f"{name}_{layer:03d}" for layer in layers for name in ("layer", *side)})


def in_memory_bytes(path_or_url, layers=None, *, pooled: bool = True, manifest: dict | None = None) -> int:
    """The bytes a CacheReader of this cache holds in memory once it holds `layers` (stored hidden_states
    indices; None: every stored layer) and, if `pooled`, the pooled rows, as stored. manifest: the cache's, where
    the caller has read it."""
    if manifest is None:
        _, manifest = load_manifest(Location(path_or_url))
    held = _held_arrays(manifest, layers, pooled)
    total = 0
    for shard in manifest["shards"]:
        for name, (shape, dtype) in expected_arrays(manifest, shard).items():
            if held is None or name in held:
                total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return total


class CacheReader:
    def __init__(self, path_or_url, *, in_memory: bool = False, manifest: dict | None = None):
        """The cache at `path_or_url` (a directory, an fsspec URL or a Location).

        in_memory: hold every array in memory (`hold_in_memory` holds only some layers).
        manifest: the cache's manifest as `load_manifest` (or `check_cache` / `verify_cache`, which return
        the Location and manifest they checked) read it from this location; None reads it here.
        """
        location = path_or_url if isinstance(path_or_url, Location) else Location(path_or_url)
        if manifest is None:
            location, manifest = load_manifest(location)
        self.location, self.manifest = location, manifest
        m = self.manifest
        self.path = str(path_or_url)
        self.key: str = m["key"]
        self.layers: list[int] = list(m["layers"])
        self.pooled_layers: list[int] = list(m["pooled_layers"])
        self.hidden_size: int = int(m["hidden_size"])
        self.num_sentences: int = int(m["num_sentences"])
        self.dtype: str = m["dtype"]
        self.pooled_dtype: str = m["pooled_dtype"]
        self.backend: str = m["backend"]
        self.in_memory = False
        self._side = tuple(side_arrays(self.dtype, self.hidden_size))
        self._shard_names = [s["name"] for s in m["shards"]]
        self._handles: dict[int, ShardHandle] = {}
        self._memory: dict[int, dict[str, np.ndarray]] = {}
        self._pid = os.getpid()
        self._build_index()
        if in_memory:
            self.hold_in_memory()

    # -- index ---------------------------------------------------------------------------------

    def _build_index(self) -> None:
        n = self.num_sentences
        self._shard_of = np.full(n, -1, dtype=np.int32)
        self._row_of = np.zeros(n, dtype=np.int64)  # row of the sentence inside its shard
        self._token_start = np.zeros(n, dtype=np.int64)
        self.lengths = np.zeros(n, dtype=np.int64)
        for s, shard in enumerate(self.manifest["shards"]):
            handle = self._open(s)
            expected = expected_arrays(self.manifest, shard)
            for array, (shape, _dtype) in expected.items():
                if array not in handle.arrays or handle.shape(array) != tuple(shape):
                    raise UserError(f"cache {self.location}: shard {shard['name']} array {array} is missing or "
                                    "has the wrong shape; run `prlmfuse cache verify` and rebuild with --force")
            ids = handle.read("sentence_ids")
            offsets = handle.read("offsets")
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise UserError(f"cache {self.location}: shard {shard['name']} has sentence ids outside 0..{n - 1}; "
                                "rebuild with --force")
            self._shard_of[ids] = s
            self._row_of[ids] = np.arange(len(ids))
            self._token_start[ids] = offsets[:-1]
            self.lengths[ids] = np.diff(offsets)
        if n and (self._shard_of < 0).any():
            missing = int(np.flatnonzero(self._shard_of < 0)[0])
            raise UserError(f"cache {self.location}: sentence {missing} is in no shard; rebuild with --force")
        # handles opened for the index are dropped: the process that reads may be a forked worker
        self._close_handles()

    def hold_in_memory(self, layers=None, *, pooled: bool = True) -> None:
        """Read the token arrays of `layers` (stored hidden_states indices; None: every stored layer) and, if
        `pooled`, the pooled rows into memory: reads never touch the store again, and reading anything not held
        raises. A run that reads one layer of an every-layer cache holds that layer only."""
        held = _held_arrays(self.manifest, layers, pooled)
        for s in range(len(self._shard_names)):
            handle = self._open(s)
            self._memory[s] = {name: handle.read(name) for name in handle.names() if held is None or name in held}
        self.in_memory = True
        self._held = (self.layers if layers is None else sorted(layers), pooled)
        self._close_handles()

    # -- handles -------------------------------------------------------------------------------

    def _open(self, s: int) -> ShardHandle:
        if self._pid != os.getpid():
            # Inherited through fork: the parent's zarr state must not be used here. close() uses none of
            # it (an hdf5 handle is a raw descriptor), and frees the child's copies.
            for handle in self._handles.values():
                handle.close()
            self._handles = {}
            self._pid = os.getpid()
        handle = self._handles.get(s)
        if handle is None:
            handle = ShardHandle(self.location, self.backend, f"{SHARD_DIR}/{self._shard_names[s]}")
            self._handles[s] = handle
        return handle

    def _close_handles(self) -> None:
        if self._pid == os.getpid():
            for handle in self._handles.values():
                handle.close()
        self._handles = {}

    def close(self) -> None:
        self._close_handles()

    def __getstate__(self):
        # spawn/forkserver workers receive the index, never open handles
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pid = os.getpid()

    def __del__(self):
        try:
            self._close_handles()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- access --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_sentences

    def _check_index(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.num_sentences:
            raise IndexError(f"sentence {i} out of range 0..{self.num_sentences - 1} in cache {self.location}")
        return i

    def _read(self, s: int, name: str, start: int, stop: int) -> np.ndarray:
        if self.in_memory:
            arrays = self._memory[s]
            if name not in arrays:
                layers, pooled = self._held
                what = "its pooled rows are" if name == "pooled" else f"layer {int(name.rsplit('_', 1)[1])} is"
                raise ValueError(f"cache {self.location}: {what} not held in memory, only layers {layers}"
                                 + (" and the pooled rows" if pooled else "") + "; hold what the run reads")
            return arrays[name][start:stop]
        return self._open(s).read(name, start, stop)

    def features(self, i: int, rows: list[int] | None = None, *, widen: bool = True) -> torch.Tensor:
        """float32 [n_layers, T_i, d]: the stored layers' token features of sentence i.

        rows: positions in `self.layers` to read (default all), so a run that uses one layer of
        an all-layer cache reads that layer only. widen=False returns `self.transfer_dtype`
        instead (float16 stays float16), the same values in half the bytes for a worker to hand over.
        """
        return self.features_many([i], rows, widen=widen)[0]

    def features_many(self, indices, rows: list[int] | None = None, *, widen: bool = True) -> list[torch.Tensor]:
        """`features(i, rows, widen=widen)` for each i of `indices`, in that order.

        Sentences stored next to each other (up to READ_GAP_TOKENS apart) are read with one read per
        array, so a window of neighbouring stored sentences costs a few large reads, not one per sentence.
        """
        layers = self.layers if rows is None else [self.layers[r] for r in rows]
        out: list[torch.Tensor | None] = [None] * len(indices)
        for s, members, start, stop in self._runs(indices, self._token_start, self.lengths, READ_GAP_TOKENS):
            spans = []
            for layer in layers:
                values = self._read(s, f"layer_{layer:03d}", start, stop)
                side = {name: self._read(s, f"{name}_{layer:03d}", start, stop) for name in self._side}
                spans.append(decode(values, side, self.dtype) if widen else decode_to_transfer(values, side, self.dtype))
            span = spans[0].unsqueeze(0) if len(spans) == 1 else torch.stack(spans)  # [n_layers, stop - start, d]
            for k, i in members:
                first = int(self._token_start[i]) - start
                rows_of_i = span[:, first : first + int(self.lengths[i])]
                # one in-memory layer's span is a view into the cache (several are stacked into a new
                # tensor): a copy, so no caller can write into the cache
                out[k] = rows_of_i.clone() if self.in_memory and len(spans) == 1 else rows_of_i
        return out

    def features_into(self, indices, rows: list[int] | None, out: list[np.ndarray]) -> None:
        """Write `features(i, rows, widen=False)` into out[k][:, :lengths[i]] for each i = indices[k].

        out[k]: [n_layers, >= lengths[i], d], the memory of a `transfer_dtype` tensor as `codecs.numpy_view`
        gives it, e.g. a sentence's row of a padded batch. Where the stored values are the transferred ones
        (float16, bfloat16, float32) and no rows are asked twice, an HDF5 cache, or a local zarr cache of layout 2,
        reads each stretch of neighbouring sentences with one scatter read per layer straight into out: no read
        buffer, no copy.
        """
        layers = self.layers if rows is None else [self.layers[r] for r in rows]
        direct = not self.in_memory and not self._side
        for s, members, start, stop in self._runs(indices, self._token_start, self.lengths, READ_GAP_TOKENS):
            firsts = (self._token_start[[i for _, i in members]] - start).tolist()
            counts = self.lengths[[i for _, i in members]].tolist()
            if any(out[k].shape[1] < n for n, (k, _) in zip(counts, members)):
                raise ValueError("features_into: an out row shorter than its sentence")
            if direct and all(a + n <= b for a, n, b in zip(firsts, counts, firsts[1:])):
                for row, layer in enumerate(layers):
                    targets = [(first, out[k][row, :n]) for first, n, (k, _) in zip(firsts, counts, members)]
                    self._open(s).read_into(f"layer_{layer:03d}", start, stop, targets)
                continue
            for row, layer in enumerate(layers):  # decoded into a buffer, then copied
                values = self._read(s, f"layer_{layer:03d}", start, stop)
                side = {name: self._read(s, f"{name}_{layer:03d}", start, stop) for name in self._side}
                span = numpy_view(decode_to_transfer(values, side, self.dtype))
                for first, n, (k, _) in zip(firsts, counts, members):
                    out[k][row, :n] = span[first : first + n]

    def pooled_many(self, indices) -> torch.Tensor:
        """float32 [len(indices), n_pooled_layers, 2, d]: `pooled(i)` for each i, neighbouring rows read together."""
        out = torch.empty(len(indices), len(self.pooled_layers), 2, self.hidden_size, dtype=torch.float32)
        for s, members, start, stop in self._runs(indices, self._row_of, None, READ_GAP_ROWS):
            span = decode(self._read(s, "pooled", start, stop), None, self.pooled_dtype)
            for k, i in members:
                out[k] = span[int(self._row_of[i]) - start]
        return out

    def _runs(self, indices, first: np.ndarray, count: np.ndarray | None, gap: int):
        """(shard, [(position in indices, sentence)], start, stop): runs of the sentences' [first, first + count)
        ranges (count None: one row each) that lie in one shard no more than `gap` apart, in stored order."""
        ids = np.fromiter((self._check_index(i) for i in indices), dtype=np.int64, count=len(indices))
        shard, begin = self._shard_of[ids], first[ids]
        run: list[tuple[int, int]] = []
        start = stop = s = -1
        for k in np.lexsort((begin, shard)).tolist():
            i = int(ids[k])
            b = int(begin[k])
            e = b + (1 if count is None else int(count[i]))
            if run and (int(shard[k]) != s or b > stop + gap):
                yield s, run, start, stop
                run = []
            if not run:
                s, start, stop = int(shard[k]), b, e
            run.append((k, i))
            stop = max(stop, e)
        if run:
            yield s, run, start, stop

    def stored_order(self) -> np.ndarray:
        """Sentence indices in the order the shards store them (shard by shard, row by row)."""
        return np.lexsort((self._row_of, self._shard_of))

    @property
    def transfer_dtype(self) -> torch.dtype:
        return transfer_dtype(self.dtype)

    def pooled(self, i: int) -> torch.Tensor:
        """float32 [n_pooled_layers, 2, d]: [:, 0] first-token vector, [:, 1] mean over real tokens."""
        return self.pooled_many([i])[0]


def feature_scale(path_or_url, sentences: int = 200) -> dict[str, dict[str, float]]:
    """Scale of the cached token features over the first `sentences` sentences, per stored layer.

    Why: the fused model projects these features as they are. A BERT-style encoder hands over
    LayerNorm'd states (values of order 1), while a causal LM's intermediate residual stream can
    carry values and token norms in the thousands, which a branch initialised for unit-scale
    inputs learns from poorly (PrLMUse.feature_norm is the remedy). absmax: largest |value|; rms: root mean
    square of all values; token_norm_median / token_norm_max: L2 norms of token vectors.
    """
    reader = CacheReader(path_or_url)
    n = min(int(sentences), reader.num_sentences)
    if n < 1:
        return {}
    states = torch.cat([reader.features(i) for i in range(n)], dim=1).float()  # [n_layers, tokens, d]
    norms = states.norm(dim=-1)
    return {
        str(layer): {
            "absmax": round(float(states[row].abs().max()), 4),
            "rms": round(float(states[row].pow(2).mean().sqrt()), 4),
            "token_norm_median": round(float(norms[row].median()), 4),
            "token_norm_max": round(float(norms[row].max()), 4),
        }
        for row, layer in enumerate(reader.layers)
    }
