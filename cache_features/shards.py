"""Writing shard files: HDF5 (local) and Zarr v3 (local or any fsspec URL) behind one small interface
(cache_features.shard_handle reads them).

A shard holds, for a run of sentences in plan order:
  sentence_ids  int64 [S]          global line numbers
  offsets       int64 [S + 1]      token rows of sentence j are offsets[j]:offsets[j+1]
  layer_NNN     [N, d]             token features of hidden_states[NNN] (stored dtype)
  quant_NNN     float32 [N, 1+2k]  int8 only: per token its scale, then its k outliers' channels and values
  pooled        [S, P, 2, d]       first-token and mean vectors of the stored layers
Arrays are written sequentially (rows in order), so a shard's size in memory is one batch, not the shard
(on a URL, plus each array's upload buffer: fsspec's block size).
The checksum is sha256 over each array's values (plus its name, dtype and shape): the same for
both backends, so `verify_cache` never depends on how a backend lays bytes on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prlmfuse.errors import UserError
from prlmfuse.fileio import fsync_dir

from .disk_space import HDF5_METADATA_BYTES, reserve_space
from .location import Location

BACKENDS = ("zarr", "hdf5")
CHUNK_BYTES = 256 * 1024  # zarr (inner) chunk target: what a reader through zarr's API fetches for a random sentence


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def shard_suffix(backend: str) -> str:
    return {"zarr": ".zarr", "hdf5": ".h5"}[check_backend(backend)]


class ShardChecksum:
    """sha256 over each array's values in row order, combined with names, dtypes and shapes."""

    def __init__(self, arrays: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.arrays = arrays
        self.hashers = {name: hashlib.sha256() for name in arrays}

    def update(self, name: str, rows: np.ndarray) -> None:
        self.hashers[name].update(memoryview(np.ascontiguousarray(rows)).cast("B"))

    def hexdigest(self) -> str:
        total = hashlib.sha256()
        for name in sorted(self.arrays):
            shape, dtype = self.arrays[name]
            total.update(f"{name}:{np.dtype(dtype).str}:{tuple(shape)}:{self.hashers[name].hexdigest()}\n".encode())
        return total.hexdigest()


# ----------------------------------------------------------------------------- writers


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: np.dtype

    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class ShardWriter:
    """Sequential row appends into a shard of known array shapes; commit() publishes it."""

    layout: int  # the backend's on-disk layout it writes (LAYOUT)

    def __init__(self, specs: dict[str, ArraySpec]):
        self.specs = specs
        self.position = {name: 0 for name in specs}
        self.checksum = ShardChecksum({n: (s.shape, s.dtype) for n, s in specs.items()})

    def append(self, name: str, rows: np.ndarray) -> None:
        spec = self.specs[name]
        rows = np.asarray(rows, dtype=spec.dtype)
        start = self.position[name]
        if start + len(rows) > spec.shape[0]:
            raise RuntimeError(f"shard array {name} overflow: {start}+{len(rows)} > {spec.shape[0]}")
        self.checksum.update(name, rows)
        self._write(name, start, rows)
        self.position[name] = start + len(rows)

    def commit(self) -> str:
        for name, spec in self.specs.items():
            if self.position[name] != spec.shape[0]:
                raise RuntimeError(f"shard array {name} incomplete: {self.position[name]} of {spec.shape[0]} rows")
        self._finish()
        return self.checksum.hexdigest()

    def abort(self) -> None:
        raise NotImplementedError

    def _write(self, name: str, start: int, rows: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class Hdf5ShardWriter(ShardWriter):
    """Contiguous datasets in a temp file; fsync + rename on commit (local paths only)."""

    layout = 1

    def __init__(self, location: Location, name: str, specs: dict[str, ArraySpec]):
        import h5py

        super().__init__(specs)
        self.final = location.path / name
        self.tmp = _temp_name(self.final)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.file = None
        try:
            self.file = h5py.File(self.tmp, "w", libver="latest")
            reserve_space(self.tmp, sum(s.nbytes() for s in specs.values()) + HDF5_METADATA_BYTES * (1 + len(specs)))
            for array, spec in specs.items():
                # contiguous layout: a sentence read is one exact slice, no chunk over-read
                self.file.create_dataset(array, shape=spec.shape, dtype=spec.dtype)
        except BaseException:
            self.abort()  # e.g. a full disk: the caller never gets a writer to abort
            raise

    def _write(self, name, start, rows):
        if len(rows):
            self.file[name][start : start + len(rows)] = rows

    def _finish(self):
        # Flush while the file is open: a full disk then fails here as a plain OSError, whereas the
        # same failure inside close() leaves HDF5 an id it cannot release and the process segfaults (h5py#914).
        self.file.flush()
        self.file.close()
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)

    def abort(self):
        if self.file is not None:
            # Give the temp file's space back first, so the metadata close() still writes finds room.
            with contextlib.suppress(OSError):
                os.truncate(self.tmp, 0)
            with contextlib.suppress(Exception):
                self.file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


SYNC_THREADS = 8  # fsyncs in flight at a zarr shard's commit
# The on-disk layout each backend writes, recorded in every shard's progress record and the manifest (a cache
# written before the record existed is layout 1). The reader (shard_handle) reads every layout.
#   hdf5 1: contiguous uncompressed datasets.
#   zarr 1: uncompressed arrays of 256 KB chunks, a file each.
#   zarr 2: each array one file through zarr's sharding codec: its 256 KB inner chunks back to back (the last
#           padded with the fill value), then their index (offset and length, uint64 little-endian) and its crc32c.
LAYOUT = {"hdf5": 1, "zarr": 2}


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _chunk_rows(spec: ArraySpec) -> int:
    return max(1, min(max(spec.shape[0], 1), CHUNK_BYTES // max(spec.row_bytes(), 1)))


def shard_index(chunks: int, chunk_bytes: int) -> bytes:
    """The sharding codec's index of `chunks` inner chunks of `chunk_bytes` each, back to back from the file's start,
    with its crc32c: what zarr writes after a shard whose every inner chunk is stored."""
    index = np.empty((chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(chunks, dtype=np.uint64) * np.uint64(chunk_bytes)
    index[:, 1] = chunk_bytes
    data = index.tobytes()
    return data + crc32c(data)


def crc32c(data: bytes) -> bytes:
    """The 4 bytes zarr's crc32c codec appends to `data`."""
    import google_crc32c  # zarr's own crc32c codec uses it

    return np.array([google_crc32c.value(data)], dtype="<u4").tobytes()


def plain_sharding(array) -> bool:
    """Whether a zarr array is stored through the sharding codec alone, with uncompressed little-endian inner chunks
    and a little-endian index with its crc32c at the file's end: the arrangement LAYOUT 2 writes."""
    import sys

    from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

    codecs = getattr(array.metadata, "codecs", ())
    if sys.byteorder != "little" or len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        return False
    sharding = codecs[0]
    plain = lambda c: isinstance(c, BytesCodec) and getattr(c.endian, "value", c.endian) in (None, "little")  # noqa: E731
    return (len(sharding.codecs) == 1 and plain(sharding.codecs[0]) and sharding.index_location.value == "end"
            and len(sharding.index_codecs) == 2 and plain(sharding.index_codecs[0])
            and isinstance(sharding.index_codecs[1], Crc32cCodec))


class ZarrShardWriter(ShardWriter):
    """A Zarr v3 group of uncompressed arrays, each one file through zarr's sharding codec (LAYOUT["zarr"]).

    zarr writes the metadata; the writer streams each array's rows straight into its shard file, since with no
    codec but `bytes` a stored inner chunk is its rows' little-endian bytes and the inner chunks lie back to back.
    At commit it pads the last inner chunk with the fill value and appends the index: the file zarr itself would
    write for the same rows (with every chunk stored). A shard is a handful of files.
    Local: built in a temp directory and renamed on commit. URL: written in place; the caller counts it complete
    only once its progress record is written after commit().
    """

    layout = 2

    def __init__(self, location: Location, name: str, specs: dict[str, ArraySpec]):
        import zarr

        super().__init__(specs)
        self.files: dict[str, object] = {}
        if location.url:
            location.remove(name)
            self.tmp = None
            store = location.zarr_store(name, read_only=False)
            files_at, prefix = location, f"{name}/"
        else:
            self.final = location.path / name
            self.tmp = _temp_name(self.final)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.final.parent.mkdir(parents=True, exist_ok=True)
            store = zarr.storage.LocalStore(self.tmp)
            files_at, prefix = Location(self.tmp), ""
        self.inner: dict[str, tuple[int, int]] = {}  # array -> (rows of an inner chunk, inner chunks)
        try:
            group = zarr.open_group(store, mode="w")
            for array, spec in specs.items():
                rows = _chunk_rows(spec)
                chunks = -(-spec.shape[0] // rows)
                created = group.create_array(
                    array, shape=spec.shape, dtype=spec.dtype, chunks=(rows,) + spec.shape[1:],
                    shards=(max(chunks, 1) * rows,) + spec.shape[1:], compressors=None, fill_value=0,
                )
                if not plain_sharding(created):
                    raise RuntimeError(f"zarr {zarr.__version__} made {array} with codecs this writer does not write: "
                                       f"{created.metadata.codecs}")
                self.inner[array] = (rows, chunks)
                if chunks:  # an array of no rows has no shard file
                    key = created.metadata.encode_chunk_key((0,) * len(spec.shape))
                    self.files[array] = files_at.open_for_writing(f"{prefix}{array}/{key}")
        except BaseException:
            self.abort()  # e.g. a full disk: the caller never gets a writer to abort
            raise

    def _write(self, name, start, rows):
        if len(rows):
            rows = np.ascontiguousarray(rows, dtype=rows.dtype.newbyteorder("<"))  # the `bytes` codec's order
            self.files[name].write(memoryview(rows).cast("B"))

    def _finish(self):
        for name, file in self.files.items():
            spec, (rows, chunks) = self.specs[name], self.inner[name]
            file.write(bytes((chunks * rows - spec.shape[0]) * spec.row_bytes()))
            file.write(shard_index(chunks, rows * spec.row_bytes()))
        self._close_files()
        if self.tmp is not None:
            self._sync(self.tmp)
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)

    def _close_files(self) -> None:
        while self.files:  # one failing close (a full disk) leaves the rest to abort()
            _, file = self.files.popitem()
            file.close()

    @staticmethod
    def _sync(directory: Path) -> None:
        """Every file of the shard on disk before the rename publishes it (fsyncs issued together)."""
        walk = list(os.walk(directory))
        with ThreadPoolExecutor(SYNC_THREADS) as pool:
            list(pool.map(_fsync_file, [os.path.join(root, file) for root, _dirs, names in walk for file in names]))
        for root, _dirs, _names in reversed(walk):  # deepest first: each directory's entries, then its own
            fsync_dir(Path(root))

    def abort(self):
        while self.files:
            _, file = self.files.popitem()
            with contextlib.suppress(Exception):
                # an fsspec upload is thrown away where the filesystem can; closing would finish it
                file.discard() if self.tmp is None and hasattr(file, "discard") else file.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def create_shard(location: Location, backend: str, name: str, specs: dict[str, ArraySpec]) -> ShardWriter:
    if backend == "hdf5":
        if location.url:
            raise UserError(f"the hdf5 backend needs a local directory, got {location}; use --backend zarr for URLs")
        return Hdf5ShardWriter(location, name, specs)
    return ZarrShardWriter(location, name, specs)
