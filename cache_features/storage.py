"""Shard storage: HDF5 (local) and Zarr v3 (local or any fsspec URL) behind one small interface.

A shard holds, for a run of sentences in plan order:
  sentence_ids  int64 [S]          global line numbers
  offsets       int64 [S + 1]      token rows of sentence j are offsets[j]:offsets[j+1]
  layer_NNN     [N, d]             token features of hidden_states[NNN] (stored dtype)
  scale_NNN     float32 [N]        per-token absmax / 127, int8 only
  pooled        [S, P, 2, d]       first-token and mean vectors of layers 0..P-1
Arrays are written sequentially (rows in order), so a shard's size in memory is one batch, not the shard.
The checksum is sha256 over each array's raw bytes (plus its name, dtype and shape): the same for
both backends, so `verify_cache` never depends on how a backend lays bytes on disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from prlmfuse.errors import UserError
from prlmfuse.fileio import fsync_dir

STORAGE_DTYPES = ("float16", "bfloat16", "float32", "int8")
BACKENDS = ("zarr", "hdf5")
CHUNK_BYTES = 256 * 1024  # zarr chunk target: a random sentence read touches one or two small files


# ----------------------------------------------------------------------------- dtype codecs


def check_dtype(dtype: str) -> str:
    if dtype not in STORAGE_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(STORAGE_DTYPES)}")
    return dtype


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def token_numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype({"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int8": np.int8}[dtype])


def pooled_storage_dtype(dtype: str) -> str:
    # pooled vectors are few; int8 caches keep them in float16 rather than quantizing them too
    return "float16" if dtype == "int8" else dtype


def token_bytes_per_row(dtype: str, hidden_size: int) -> int:
    return hidden_size * token_numpy_dtype(dtype).itemsize + (4 if dtype == "int8" else 0)


def encode(x: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [..., d] -> (stored values, per-row float32 scales for int8 else None)."""
    if dtype == "float32":
        return x.float().contiguous().numpy(), None
    if dtype == "float16":
        return x.to(torch.float16).contiguous().numpy(), None
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), None
    if dtype == "int8":
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
        return q.contiguous().numpy(), scale.squeeze(-1).float().contiguous().numpy()
    raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(STORAGE_DTYPES)}")


def decode(values: np.ndarray, scales: np.ndarray | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode`, always float32."""
    return decode_to_transfer(values, scales, dtype).float()


def transfer_dtype(dtype: str) -> torch.dtype:
    """The narrowest torch dtype that holds a stored dtype's values exactly (int8: dequantized float32)."""
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)


def decode_to_transfer(values: np.ndarray, scales: np.ndarray | None, dtype: str) -> torch.Tensor:
    """Inverse of `encode` in `transfer_dtype(dtype)`: float16/bfloat16 values are not widened."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    t = torch.from_numpy(np.ascontiguousarray(values))
    if dtype == "int8":
        return t.float().mul_(torch.from_numpy(np.ascontiguousarray(scales)).float().unsqueeze(-1))
    return t


# ----------------------------------------------------------------------------- locations


def is_url(path_or_url: str | os.PathLike) -> bool:
    return "://" in str(path_or_url)


class Location:
    """A cache directory: a local path or an fsspec URL. Files are addressed by relative names."""

    def __init__(self, path_or_url: str | os.PathLike):
        self.raw = str(path_or_url)
        self.url = is_url(self.raw)
        if self.url:
            import fsspec.core

            self.fs, root = fsspec.core.url_to_fs(self.raw)
            self.root = root.rstrip("/")
        else:
            self.path = Path(self.raw)

    def __str__(self) -> str:
        return self.raw

    def full(self, name: str) -> str:
        return f"{self.root}/{name}" if self.url else str(self.path / name)

    def url_of(self, name: str) -> str:
        """What zarr's FsspecStore.from_url receives for a child of this location."""
        return f"{self.raw.rstrip('/')}/{name}"

    def zarr_store(self, name: str, *, read_only: bool):
        import zarr

        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        # fsspec's local filesystem does not create parent directories of chunk files by itself
        options = {"auto_mkdir": True} if protocol in ("file", "local") and not read_only else None
        return zarr.storage.FsspecStore.from_url(self.url_of(name), storage_options=options, read_only=read_only)

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.full(name)) if self.url else (self.path / name).exists()

    def read_bytes(self, name: str) -> bytes:
        if self.url:
            with self.fs.open(self.full(name), "rb") as f:
                return f.read()
        return (self.path / name).read_bytes()

    def write_bytes(self, name: str, data: bytes) -> None:
        """Local: temp + fsync + rename. URL: one object put (whole or absent on object stores)."""
        if self.url:
            parent = self.full(name).rsplit("/", 1)[0]
            with contextlib.suppress(Exception):
                self.fs.makedirs(parent, exist_ok=True)
            with self.fs.open(self.full(name), "wb") as f:
                f.write(data)
        else:
            from prlmfuse.fileio import atomic_write_bytes

            atomic_write_bytes(self.path / name, data)

    def remove(self, name: str) -> None:
        if self.url:
            if self.fs.exists(self.full(name)):
                self.fs.rm(self.full(name), recursive=True)
            return
        target = self.path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()

    def listdir(self, name: str = "") -> list[str]:
        if self.url:
            base = self.full(name) if name else self.root
            if not self.fs.exists(base):
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        base = self.path / name if name else self.path
        return sorted(os.listdir(base)) if base.is_dir() else []

    def size(self, name: str = "") -> int:
        if self.url:
            return int(self.fs.du(self.full(name) if name else self.root, total=True))
        base = self.path / name if name else self.path
        if base.is_file():
            return base.stat().st_size
        return sum(p.stat().st_size for p in base.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- checksum


class ShardChecksum:
    """sha256 over each array's bytes in row order, combined with names, dtypes and shapes."""

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


class Hdf5ShardWriter(ShardWriter):
    """Contiguous datasets in a temp file; fsync + rename on commit (local paths only)."""

    def __init__(self, location: Location, name: str, specs: dict[str, ArraySpec]):
        import h5py

        super().__init__(specs)
        self.final = location.path / name
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.file = None
        try:
            self.file = h5py.File(self.tmp, "w", libver="latest")
            _reserve_space(self.tmp, sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
                                         for s in specs.values()) + _HDF5_METADATA_BYTES * (1 + len(specs)))
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
        # Flush while the file is open: a full disk then fails here as a plain OSError. The same
        # failure inside close() leaves HDF5 an id it cannot release, and the process segfaults
        # (h5py#914; seen here on a full tmpfs).
        self.file.flush()
        self.file.close()
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)

    def abort(self):
        if self.file is not None:
            # Give the temp file's space back first, so that the metadata close() still writes
            # finds room even when the disk is full (a failing close can crash, see _finish).
            with contextlib.suppress(OSError):
                os.truncate(self.tmp, 0)
            with contextlib.suppress(Exception):
                self.file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


# Room for HDF5's own bytes (superblock, one object header per dataset): ~400 B each, measured.
_HDF5_METADATA_BYTES = 4096
_FALLOC_FL_KEEP_SIZE = 1


def _reserve_space(path: Path, nbytes: int) -> None:
    """Allocate disk blocks for the first `nbytes` of `path` without changing its size.

    HDF5 does not survive a write that fails inside its metadata flush: the dataset or file close
    that hits the full disk leaves an id it cannot release, and the process segfaults (h5py#914,
    reproduced on a full tmpfs). With every block the shard needs reserved up front, a full disk
    fails here, as a plain OSError, before HDF5 has written anything it must flush.
    """
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    except (AttributeError, OSError):
        fallocate = None  # not Linux: fall back to a free-space check
    if fallocate is not None:
        fd = os.open(path, os.O_RDWR)
        try:
            if fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
                return
            code = ctypes.get_errno()
        finally:
            os.close(fd)
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(path))
    stats = os.statvfs(path.parent)
    if stats.f_bavail * stats.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))




def _chunk_rows(spec: ArraySpec) -> int:
    return max(1, min(max(spec.shape[0], 1), CHUNK_BYTES // max(spec.row_bytes(), 1)))


class ZarrShardWriter(ShardWriter):
    """A Zarr v3 group, uncompressed. Rows are buffered so every write covers whole chunks
    (a partial-chunk write would read the chunk back and rewrite it).

    Local: built in a temp directory and renamed on commit. URL: written in place; the caller
    counts it complete only once its progress record is written after commit().

    Locally, zarr writes the metadata and we write the chunk files: an uncompressed chunk is its
    rows' raw little-endian bytes (the layout _RawChunks reads). zarr's own write path runs a lot
    of Python under the GIL in its async machinery, which on a 2-core machine took ~10% from the
    PrLM's forward pass. commit() reads the first and last rows of every array back through
    zarr and refuses the shard if they differ from what was written.
    """

    def __init__(self, location: Location, name: str, specs: dict[str, ArraySpec]):
        import zarr

        super().__init__(specs)
        self.location, self.name = location, name
        if location.url:
            location.remove(name)
            store = location.zarr_store(name, read_only=False)
            self.tmp = None
        else:
            self.final = location.path / name
            self.tmp = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}")
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.final.parent.mkdir(parents=True, exist_ok=True)
            store = zarr.storage.LocalStore(self.tmp)
        self.arrays = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.flushed = {}
        self.raw: dict[str, _RawChunks | None] = {}
        self.probes: dict[str, dict[int, np.ndarray]] = {}  # row index -> row, checked at commit
        try:
            self.group = zarr.open_group(store, mode="w")
            for array, spec in specs.items():
                self.arrays[array] = self.group.create_array(
                    array, shape=spec.shape, dtype=spec.dtype, chunks=(_chunk_rows(spec),) + spec.shape[1:],
                    compressors=None, fill_value=0,
                )
                self.pending[array] = []
                self.flushed[array] = 0
                self.raw[array] = None if self.tmp is None else _RawChunks.layout_of(self.tmp / array, self.arrays[array])
                self.probes[array] = {}
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
        start = self.flushed[name]
        raw = self.raw[name]
        if raw is None:
            self.arrays[name][start : start + writable] = block[:writable]
        else:
            raw.write_chunks(start, block[:writable])
            total = self.specs[name].shape[0]
            for row in {0, total - 1}:
                if start <= row < start + writable:
                    self.probes[name][row] = block[row - start].copy()
        self.flushed[name] = start + writable
        self.pending[name] = [block[writable:]] if writable < len(block) else []

    def _finish(self):
        for name in self.arrays:
            self._flush(name, final=True)
        for name, probes in self.probes.items():
            for row, expected in probes.items():
                if not np.array_equal(np.asarray(self.arrays[name][row]), expected):
                    raise RuntimeError(f"shard array {name}: zarr reads row {row} differently from what was written")
        if self.tmp is not None:
            for root, _dirs, files in os.walk(self.tmp):
                for file in files:
                    with open(os.path.join(root, file), "rb+") as f:
                        os.fsync(f.fileno())
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)

    def abort(self):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def shard_suffix(backend: str) -> str:
    return {"zarr": ".zarr", "hdf5": ".h5"}[check_backend(backend)]


def create_shard(location: Location, backend: str, name: str, specs: dict[str, ArraySpec]) -> ShardWriter:
    if backend == "hdf5":
        if location.url:
            raise UserError(f"the hdf5 backend needs a local directory, got {location}; use --backend zarr for URLs")
        return Hdf5ShardWriter(location, name, specs)
    return ZarrShardWriter(location, name, specs)


# ----------------------------------------------------------------------------- readers


class _RawChunks:
    """Reads rows of a local, uncompressed Zarr v3 array straight from its chunk files.

    We write those arrays ourselves (raw little-endian bytes, default chunk keys, no compressor),
    so a row range is a file offset. Going through zarr costs ~1 ms a call in its async
    machinery, which the training DataLoader workers pay per sentence per layer and which a
    2-core machine takes straight out of the training step; this costs one pread.
    `of()` returns None for any array not laid out like that, and zarr reads it instead.
    """

    def __init__(self, directory: Path, shape: tuple[int, ...], chunk_rows: int, dtype: np.dtype):
        self.directory = directory
        self.shape = shape
        self.chunk_rows = chunk_rows
        self.dtype = dtype
        self.row_items = int(np.prod(shape[1:], dtype=np.int64))
        self.suffix = "/0" * (len(shape) - 1)
        # Chunk file names as plain strings: a Path join per read costs more than the read's syscalls.
        self._chunk_prefix = os.path.join(str(directory), "c", "")

    @classmethod
    def layout_of(cls, directory: Path, array) -> "_RawChunks | None":
        """A _RawChunks for `array` if its metadata says raw little-endian chunks under default keys."""
        from zarr.codecs import BytesCodec
        from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding

        meta = array.metadata
        codecs = getattr(meta, "codecs", ())
        if (
            getattr(meta, "zarr_format", None) != 3
            or len(codecs) != 1
            or not isinstance(codecs[0], BytesCodec)
            or codecs[0].endian not in (None,) and codecs[0].endian.value != "little"
            or not isinstance(meta.chunk_key_encoding, DefaultChunkKeyEncoding)
            or meta.chunk_key_encoding.separator != "/"
            or tuple(array.chunks[1:]) != tuple(array.shape[1:])
            or array.shape[0] == 0
        ):
            return None
        return cls(directory, tuple(array.shape), int(array.chunks[0]), np.dtype(array.dtype).newbyteorder("<"))

    @classmethod
    def of(cls, directory: Path, array) -> "_RawChunks | None":
        raw = cls.layout_of(directory, array)
        if raw is None:
            return None
        n = array.shape[0]
        # Trust the layout only once it reads what zarr reads, at both ends (the last chunk is the edge one).
        n = array.shape[0]
        for probe in (slice(0, min(2, n)), slice(max(0, n - 2), n)):
            try:
                if not np.array_equal(raw.read(probe.start, probe.stop), np.asarray(array[probe])):
                    return None
            except OSError:
                return None
        return raw

    def write_chunks(self, start: int, rows: np.ndarray) -> None:
        """Write rows[...] at row `start` (a chunk boundary) as whole chunk files; zarr stores the
        edge chunk at full size too, so the last one is padded with the fill value (0)."""
        assert start % self.chunk_rows == 0, (start, self.chunk_rows)
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        for lo in range(0, len(rows), self.chunk_rows):
            part = rows[lo : lo + self.chunk_rows]
            path = self.directory / "c" / f"{(start + lo) // self.chunk_rows}{self.suffix}"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(part.view(np.uint8).data)
                if len(part) < self.chunk_rows:
                    f.write(bytes((self.chunk_rows - len(part)) * self.row_items * self.dtype.itemsize))

    def _chunk_rows(self, chunk: int, lo: int, hi: int) -> np.ndarray:
        path = f"{self._chunk_prefix}{chunk}{self.suffix}"
        count = (hi - lo) * self.row_items
        try:
            flat = np.fromfile(path, dtype=self.dtype, count=count, offset=lo * self.row_items * self.dtype.itemsize)
        except FileNotFoundError:  # zarr skips writing chunks that hold only the fill value (0)
            flat = np.zeros(count, dtype=self.dtype)
        if flat.size != count:
            raise OSError(f"chunk file {path} is shorter than its array says")
        return flat.reshape((hi - lo,) + self.shape[1:])

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(start, 0), min(stop, self.shape[0])
        if stop <= start:
            return np.zeros((0,) + self.shape[1:], dtype=self.dtype)
        parts = []
        for chunk in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            base = chunk * self.chunk_rows
            parts.append(self._chunk_rows(chunk, max(start, base) - base, min(stop, base + self.chunk_rows) - base))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class ShardHandle:
    """Read access to one complete shard; arrays are sliced along their first axis."""

    def __init__(self, location: Location, backend: str, name: str):
        self.backend = backend
        self._raw: dict[str, _RawChunks | None] = {}
        if backend == "hdf5":
            import h5py

            # rdcc: HDF5's chunk cache is useless for contiguous datasets; keep per-process memory flat
            self.file = h5py.File(location.path / name, "r", rdcc_nbytes=0)
            self.arrays = {key: self.file[key] for key in self.file.keys()}
        else:
            import zarr

            if location.url:
                store = location.zarr_store(name, read_only=True)
            else:
                store = zarr.storage.LocalStore(location.path / name, read_only=True)
            group = zarr.open_group(store, mode="r")
            self.file = None
            self.arrays = {key: group[key] for key in group.array_keys()}
            if not location.url:
                self._raw = {key: _RawChunks.of(location.path / name / key, arr) for key, arr in self.arrays.items()}

    def names(self) -> list[str]:
        return sorted(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.arrays[name].dtype)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        raw = self._raw.get(name)
        if raw is not None and start is not None and stop is not None:
            return raw.read(start, stop)
        return np.asarray(self.arrays[name][slice(start, stop)])

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.file.close()
        self.arrays = {}
        self._raw = {}
