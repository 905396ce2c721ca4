"""Reading one complete shard (cache_features.shards writes them): HDF5 datasets and zarr arrays of LAYOUT 2 by
byte ranges straight from their files, any other zarr array through zarr's API."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from prlmfuse.errors import UserError

from .location import Location
from .shards import ArraySpec, crc32c, plain_sharding, shard_index

IOV_MAX = 1024  # buffers one preadv takes (POSIX's smallest IOV_MAX)


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
    if not plain_sharding(array):
        return None
    shard_shape, inner = tuple(array.shards), tuple(array.chunks)
    if shard_shape[0] < shape[0] or shard_shape[1:] != shape[1:] or inner[1:] != shape[1:]:
        return None  # more than one shard file along the rows, or inner chunks that split a row
    spec = ArraySpec(shape, dtype)
    if shape[0] == 0:
        return _FileRegion(shape, dtype, None)
    path = location.full(f"{name}/{meta.encode_chunk_key((0,) * len(shape))}")
    chunks, chunk_bytes = shard_shape[0] // inner[0], inner[0] * spec.row_bytes()
    expected = shard_index(chunks, chunk_bytes)
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
    if len(stored) == len(expected) and crc32c(stored[:-4]) == stored[-4:]:
        return None  # a valid index of another arrangement (e.g. empty chunks left out): zarr's API reads it
    raise OSError(f"{path}: the shard index fails its crc32c; the file is truncated or damaged")
