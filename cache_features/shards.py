"""Shard files: HDF5 (local) and Zarr v3 (local or any fsspec URL) behind one small interface.

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


IOV_MAX = 1024  # buffers one preadv takes (POSIX's smallest IOV_MAX)
SYNC_THREADS = 8  # fsyncs in flight at a zarr shard's commit
# The on-disk layout each backend writes, recorded in every shard's progress record and the manifest (a cache
# written before the record existed is layout 1). The reader reads every layout.
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


def _shard_index(chunks: int, chunk_bytes: int) -> bytes:
    """The sharding codec's index of `chunks` inner chunks of `chunk_bytes` each, back to back from the file's start,
    with its crc32c: what zarr writes after a shard whose every inner chunk is stored."""
    index = np.empty((chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(chunks, dtype=np.uint64) * np.uint64(chunk_bytes)
    index[:, 1] = chunk_bytes
    data = index.tobytes()
    return data + _crc32c(data)


def _crc32c(data: bytes) -> bytes:
    """The 4 bytes zarr's crc32c codec appends to `data`."""
    import google_crc32c  # zarr's own crc32c codec uses it

    return np.array([google_crc32c.value(data)], dtype="<u4").tobytes()


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
                if not _plain_sharding(created):
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
            file.write(_shard_index(chunks, rows * spec.row_bytes()))
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


# ----------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class _FileRegion(ArraySpec):
    """Where an array's rows lie back to back in a file (offset None: no rows were ever stored): an HDF5 contiguous
    dataset in the shard's file (path None), or a zarr array's shard file of LAYOUT 2 (path; at a URL, fs is the
    fsspec filesystem that serves it)."""

    offset: int | None
    path: str | None = None
    fs: object | None = None


class ShardHandle:
    """Read access to one complete shard; arrays are sliced along their first axis.

    HDF5 shards are read with os.preadv at each dataset's offset, from a descriptor advised
    POSIX_FADV_RANDOM (random_access, the default; verify_cache reads sequentially): a shuffled epoch's
    small reads then fetch no pages ahead from the disk, and no h5py handle (with its per-file caches)
    stays open per shard in a loader worker. The writer lays every dataset out contiguously and
    uncompressed, which is what makes a row range one byte range. A local zarr array of LAYOUT 2 whose index says
    its inner chunks lie back to back (what the writer writes) is read the same way from its shard file, opened
    per read; at a URL each row range is one ranged read of that file (its index checked once, when the handle
    opens); any other zarr array (layout 1, a file another tool wrote) is read through zarr's array API.
    Open a handle in the process that reads: zarr arrays are not safe to use across fork.
    """

    def __init__(self, location: Location, backend: str, name: str, *, random_access: bool = True):
        self.backend = backend
        self.name = name
        self.random_access = random_access
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
            self.arrays = {}
            for key in group.array_keys():
                array = group[key]
                region = _back_to_back(location, f"{name}/{key}", array)
                self.arrays[key] = array if region is None else region

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
        if not isinstance(array, _FileRegion):
            return np.asarray(array[slice(start, stop)])
        start, stop, _ = slice(start, stop).indices(array.shape[0])
        rows = np.empty((max(stop - start, 0),) + array.shape[1:], dtype=array.dtype)
        if rows.nbytes:
            self.read_into(name, start, stop, [(0, rows)])
        return rows

    def read_into(self, name: str, start: int, stop: int, targets: list[tuple[int, np.ndarray]]) -> None:
        """Rows start:stop of `name`, each target (first, array) receiving rows start + first onward, as many as
        it holds. Targets ascend and do not overlap; rows no target holds are read and dropped. An HDF5 shard
        reads the stretch with one scatter read (os.preadv) straight into the targets, as does a zarr shard file
        whose inner chunks lie back to back."""
        array = self.arrays[name]
        if not isinstance(array, _FileRegion):
            rows = self.read(name, start, stop)
            for first, target in targets:
                target[...] = rows[first : first + len(target)]
            return
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
        if array.fs is not None:  # at a URL: the stretch in one ranged read, copied into the targets
            _copy_pieces(_read_range(array, start * row_bytes, stop * row_bytes, f"{name} rows {start}:{stop}"),
                         pieces, row_bytes)
            return
        # rows between targets all land in one scratch buffer, overwritten each time
        scratch = memoryview(bytearray(max(gap for gap, _ in pieces) * row_bytes))
        buffers = [b for gap, piece in pieces for b in (scratch[: gap * row_bytes], piece) if b is not None and len(b)]
        fd = self.fd if array.path is None else os.open(array.path, os.O_RDONLY)
        try:
            if array.path is not None and self.random_access and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            _preadv_all(fd, buffers, (array.offset or 0) + start * row_bytes,
                        f"{name} rows {start}:{stop} in shard {self.name}")
        finally:
            if fd != self.fd:
                os.close(fd)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        self.arrays = {}

    def __del__(self):
        try:
            self.close()  # a raw descriptor: closing it is safe in any process, a forked child's copy included
        except Exception:  # noqa: BLE001 - at interpreter exit the modules close() uses may be gone
            pass


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, what: str) -> None:
    """Fill `buffers` from `offset` on: a read may return less than asked, so go on from where it stopped."""
    i = 0
    while i < len(buffers):
        count = os.preadv(fd, buffers[i : i + IOV_MAX], offset)
        if count == 0:
            raise OSError(f"short read of {what}: the file is truncated")
        offset += count
        while i < len(buffers) and count >= len(buffers[i]):
            count -= len(buffers[i])
            i += 1
        if count:
            buffers[i] = buffers[i][count:]


def _copy_pieces(data: bytes, pieces: list[tuple[int, memoryview | None]], row_bytes: int) -> None:
    """Fill each piece from `data`, skipping `gap` rows before it (read_into's plan of a stretch)."""
    data, position = memoryview(data), 0
    for gap, piece in pieces:
        position += gap * row_bytes
        if piece is not None:
            piece[:] = data[position : position + len(piece)]
            position += len(piece)


def _read_range(region: _FileRegion, begin: int, end: int, what: str) -> bytes:
    """Bytes begin:end of a region at a URL, in one ranged read (an object store's ranged GET)."""
    begin, end = region.offset + begin, region.offset + end
    data = region.fs.cat_file(region.path, start=begin, end=end)
    if len(data) != end - begin:
        raise OSError(f"short read of {what} in {region.path}: the file is truncated")
    return data


def _back_to_back(location: Location, name: str, array) -> _FileRegion | None:
    """The region of a zarr array (`name`, relative to `location`) stored as LAYOUT 2 writes it: one shard file over
    all rows, uncompressed inner chunks back to back from the file's start. None for any other layout (read through
    zarr's API). Raises OSError when the file is missing (zarr would read the fill value: a shard prlmfuse wrote
    lacks a file), its index fails its crc32c, or it is shorter than its index says. At a URL the check costs two
    requests (the size, the index) once per shard a process opens; each read after it is one ranged read."""
    meta = array.metadata
    shape, dtype = tuple(array.shape), np.dtype(array.dtype)
    if not _plain_sharding(array):
        return None
    shard_shape, inner = tuple(array.shards), tuple(array.chunks)
    if shard_shape[0] < shape[0] or shard_shape[1:] != shape[1:] or inner[1:] != shape[1:]:
        return None  # more than one shard file along the rows, or inner chunks that split a row
    spec = ArraySpec(shape, dtype)
    if shape[0] == 0:
        return _FileRegion(shape, dtype, None)
    path = location.full(f"{name}/{meta.encode_chunk_key((0,) * len(shape))}")
    chunks, chunk_bytes = shard_shape[0] // inner[0], inner[0] * spec.row_bytes()
    expected = _shard_index(chunks, chunk_bytes)
    if location.url:
        size = location.fs.size(path)  # FileNotFoundError (an OSError) when it is missing
        if size is None:
            return None  # a server that names no size (HTTP without Content-Length): zarr's API reads it
        stored = location.fs.cat_file(path, start=max(int(size) - len(expected), 0), end=int(size))
    else:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(size - len(expected), 0))
            stored = f.read()
    if stored == expected and size == chunks * chunk_bytes + len(expected):
        return _FileRegion(shape, dtype, 0, path, location.fs if location.url else None)
    if len(stored) == len(expected) and _crc32c(stored[:-4]) == stored[-4:]:
        return None  # a valid index of another arrangement (e.g. empty chunks left out): zarr's API reads it
    raise OSError(f"{path}: the shard index fails its crc32c; the file is truncated or damaged")


def _plain_sharding(array) -> bool:
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


