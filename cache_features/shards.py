"""Shard files: HDF5 (local) and Zarr v3 (local or any fsspec URL) behind one small interface.

A shard holds, for a run of sentences in plan order:
  sentence_ids  int64 [S]          global line numbers
  offsets       int64 [S + 1]      token rows of sentence j are offsets[j]:offsets[j+1]
  layer_NNN     [N, d]             token features of hidden_states[NNN] (stored dtype)
  quant_NNN     float32 [N, 1+2k]  int8 only: per token its scale, then its k outliers' channels and values
  pooled        [S, P, 2, d]       first-token and mean vectors of the stored layers
Arrays are written sequentially (rows in order), so a shard's size in memory is one batch, not the shard.
The checksum is sha256 over each array's values (plus its name, dtype and shape): the same for
both backends, so `verify_cache` never depends on how a backend lays bytes on disk.
"""

from __future__ import annotations

import asyncio
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
CHUNK_BYTES = 256 * 1024  # zarr chunk target: a random sentence read touches one or two small files


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


IOV_MAX = 1024  # buffers one preadv takes (POSIX's smallest IOV_MAX)
SYNC_THREADS = 8  # fsyncs in flight at a zarr shard's commit


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _chunk_rows(spec: ArraySpec) -> int:
    return max(1, min(max(spec.shape[0], 1), CHUNK_BYTES // max(spec.row_bytes(), 1)))


class ZarrShardWriter(ShardWriter):
    """A Zarr v3 group of uncompressed arrays: zarr writes the metadata, the shard writes each chunk's bytes.

    Local: built in a temp directory and renamed on commit. URL: written in place; the caller
    counts it complete only once its progress record is written after commit().
    Rows are buffered into whole chunks, and a flush hands its chunks to the store together
    (zarr's Store API): with no codec but `bytes`, a chunk's stored value is its rows' little-endian
    bytes, the array's last chunk padded with the fill value to the chunk's shape as zarr stores it.
    The array's own indexing and codec pipeline, run per chunk, is slower at the same bytes
    (bench/zarr_commit.py's array_api lane).
    """

    def __init__(self, location: Location, name: str, specs: dict[str, ArraySpec]):
        import zarr

        super().__init__(specs)
        if location.url:
            location.remove(name)
            self.tmp = None
            store = location.zarr_store(name, read_only=False)
        else:
            self.final = location.path / name
            self.tmp = _temp_name(self.final)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.final.parent.mkdir(parents=True, exist_ok=True)
            store = zarr.storage.LocalStore(self.tmp)
        self.store = store
        self.arrays = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.flushed: dict[str, int] = {}
        try:
            group = zarr.open_group(store, mode="w")
            for array, spec in specs.items():
                self.arrays[array] = group.create_array(
                    array, shape=spec.shape, dtype=spec.dtype, chunks=(_chunk_rows(spec),) + spec.shape[1:],
                    compressors=None, fill_value=0,
                )
                self.pending[array] = []
                self.flushed[array] = 0
        except BaseException:
            self.abort()  # e.g. a full disk: the caller never gets a writer to abort
            raise

    def _write(self, name, start, rows):
        self.pending[name].append(rows)
        self._flush(name, final=False)

    def _flush(self, name: str, *, final: bool) -> None:
        chunk = self.arrays[name].chunks[0]
        pending_rows = sum(len(p) for p in self.pending[name])
        writable = pending_rows if final else (pending_rows // chunk) * chunk
        if writable == 0:
            return
        block = np.concatenate(self.pending[name]) if len(self.pending[name]) > 1 else self.pending[name][0]
        self._write_chunks(name, self.flushed[name] // chunk, block[:writable])
        self.flushed[name] += writable
        self.pending[name] = [block[writable:]] if writable < len(block) else []

    def _write_chunks(self, name: str, first_chunk: int, rows: np.ndarray) -> None:
        import zarr
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        array = self.arrays[name]
        chunk = array.chunks[0]
        rows = rows.astype(rows.dtype.newbyteorder("<"), copy=False)  # the `bytes` codec's default order
        buffer, values = default_buffer_prototype().buffer, []
        for i, start in enumerate(range(0, len(rows), chunk)):
            stored = np.ascontiguousarray(rows[start : start + chunk])
            if len(stored) < chunk:  # the array's last chunk
                stored = np.concatenate([stored, np.zeros((chunk - len(stored), *stored.shape[1:]), stored.dtype)])
            key = f"{name}/{array.metadata.encode_chunk_key((first_chunk + i,) + (0,) * (stored.ndim - 1))}"
            values.append((key, buffer.from_array_like(stored.reshape(-1).view(np.uint8))))

        async def set_all() -> None:
            # at most zarr's own number of writes in flight (an object store's PUTs included), and every write
            # finished before an error is raised, so abort() never races a write still in flight
            limit = asyncio.Semaphore(zarr.config.get("async.concurrency"))

            async def put(key: str, value) -> None:
                async with limit:
                    await self.store.set(key, value)

            results = await asyncio.gather(*(put(key, value) for key, value in values), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

        sync(set_all())

    def _finish(self):
        for name in self.arrays:
            self._flush(name, final=True)
        if self.tmp is not None:
            self._sync(self.tmp)
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)

    @staticmethod
    def _sync(directory: Path) -> None:
        """Every file of the shard on disk before the rename publishes it: fsyncs issued together, so the
        filesystem's journal commits many chunk files at once (bench/zarr_commit.py)."""
        walk = list(os.walk(directory))
        with ThreadPoolExecutor(SYNC_THREADS) as pool:
            list(pool.map(_fsync_file, [os.path.join(root, file) for root, _dirs, names in walk for file in names]))
        for root, _dirs, _names in reversed(walk):  # deepest first: each directory's entries, then its own
            fsync_dir(Path(root))

    def abort(self):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def create_shard(location: Location, backend: str, name: str, specs: dict[str, ArraySpec]) -> ShardWriter:
    if backend == "hdf5":
        if location.url:
            raise UserError(f"the hdf5 backend needs a local directory, got {location}; use --backend zarr for URLs")
        return Hdf5ShardWriter(location, name, specs)
    return ZarrShardWriter(location, name, specs)


# ----------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class _FileRegion(ArraySpec):
    """Where an HDF5 contiguous dataset's rows lie in its file (offset None: no rows were ever stored)."""

    offset: int | None


class ShardHandle:
    """Read access to one complete shard; arrays are sliced along their first axis.

    HDF5 shards are read with os.preadv at each dataset's offset, from a descriptor advised
    POSIX_FADV_RANDOM (random_access, the default; verify_cache reads sequentially): a shuffled epoch's
    small reads then fetch no pages ahead from the disk, and no h5py handle (with its per-file caches)
    stays open per shard in a loader worker. The writer lays every dataset out contiguously and
    uncompressed, which is what makes a row range one byte range.
    Open a handle in the process that reads: zarr arrays are not safe to use across fork.
    """

    def __init__(self, location: Location, backend: str, name: str, *, random_access: bool = True):
        self.backend = backend
        self.name = name
        self.fd: int | None = None
        if backend == "hdf5":
            import h5py

            self.fd = os.open(location.path / name, os.O_RDONLY)
            try:
                # Offsets read through this very descriptor: a shard replaced meanwhile cannot mix two files.
                with open(self.fd, "rb", closefd=False) as f, h5py.File(f, "r") as h5:
                    self.arrays = {key: self._region(h5[key]) for key in h5.keys()}
                if random_access and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            except BaseException:
                self.close()
                raise
        else:
            import zarr

            group = zarr.open_group(location.zarr_store(name, read_only=True), mode="r")
            self.arrays = {key: group[key] for key in group.array_keys()}

    def _region(self, dataset) -> _FileRegion:
        if dataset.chunks is not None or dataset.compression is not None:
            raise UserError(f"shard {self.name}: array {dataset.name.lstrip('/')} is not a contiguous uncompressed "
                            "dataset, so it was not written by prlmfuse; rebuild the cache with --force")
        return _FileRegion(tuple(dataset.shape), np.dtype(dataset.dtype), dataset.id.get_offset())

    def names(self) -> list[str]:
        return sorted(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.arrays[name].dtype)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        array = self.arrays[name]
        if self.fd is None:
            return np.asarray(array[slice(start, stop)])
        start, stop, _ = slice(start, stop).indices(array.shape[0])
        rows = np.empty((max(stop - start, 0),) + array.shape[1:], dtype=array.dtype)
        if rows.nbytes:
            self.read_into(name, start, stop, [(0, rows)])
        return rows

    def read_into(self, name: str, start: int, stop: int, targets: list[tuple[int, np.ndarray]]) -> None:
        """Rows start:stop of `name`, each target (first, array) receiving rows start + first onward, as many as
        it holds. Targets ascend and do not overlap; rows no target holds are read and dropped. An HDF5 shard
        reads the stretch with one scatter read (os.preadv) straight into the targets."""
        if self.fd is None:
            rows = self.read(name, start, stop)
            for first, target in targets:
                target[...] = rows[first : first + len(target)]
            return
        array = self.arrays[name]
        row_bytes = array.row_bytes()
        if array.offset is None and stop > start:
            raise OSError(f"{name} of shard {self.name} has no stored rows; the file is damaged")
        pieces, position = [], 0  # (rows dropped before it, the target's bytes)
        for first, target in targets:
            if target.dtype != array.dtype or target.shape[1:] != array.shape[1:]:
                raise ValueError(f"read_into {name}: a target of {target.dtype} {target.shape[1:]} rows for rows of "
                                 f"{array.dtype} {array.shape[1:]}")
            if len(target):
                pieces.append((first - position, memoryview(target).cast("B")))
                position = first + len(target)
        pieces.append((stop - start - position, None))
        if any(gap < 0 for gap, _ in pieces):
            raise ValueError(f"read_into {name} {start}:{stop}: targets overlap or lie outside the rows read")
        # rows between targets all land in one scratch buffer, overwritten each time
        scratch = memoryview(bytearray(max(gap for gap, _ in pieces) * row_bytes))
        buffers = [b for gap, piece in pieces for b in (scratch[: gap * row_bytes], piece) if b is not None and len(b)]
        offset, i = (array.offset or 0) + start * row_bytes, 0
        while i < len(buffers):  # a read may return less than asked: go on from where it stopped
            count = os.preadv(self.fd, buffers[i : i + IOV_MAX], offset)
            if count == 0:
                raise OSError(f"short read of {name} rows {start}:{stop} in shard {self.name}: the file is truncated")
            offset += count
            while i < len(buffers) and count >= len(buffers[i]):
                count -= len(buffers[i])
                i += 1
            if count:
                buffers[i] = buffers[i][count:]

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        self.arrays = {}

    def __del__(self):
        self.close()  # a raw descriptor: closing it is safe in any process, a forked child's copy included
