"""Zarr's layout 1 as a bench lane: a shard's arrays in 256 KB chunks, a file each (the library writes layout 2,
each array one file through zarr's sharding codec; cache_features/shards.py). bench/zarr_commit.py and
bench/cache_at_scale.py --compare time it beside the library; the library's reader still reads it.

    with chunk_file_writes():   # every zarr shard written meanwhile is of layout 1
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from unittest import mock

import numpy as np

from prlmfuse.cache_features import shards


class ChunkFilesWriter(shards.ZarrShardWriter):
    """Rows buffered into whole chunks; each flush's chunks handed to zarr's store together (Store.set), at most
    zarr's `async.concurrency` writes in flight; at commit every chunk file fsynced (shards.SYNC_THREADS at once)."""

    layout = 1

    def __init__(self, location, name, specs):
        import zarr

        shards.ShardWriter.__init__(self, specs)
        self.files = {}
        if location.url:
            location.remove(name)
            self.tmp = None
            store = location.zarr_store(name, read_only=False)
        else:
            self.final = location.path / name
            self.tmp = shards._temp_name(self.final)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.final.parent.mkdir(parents=True, exist_ok=True)
            store = zarr.storage.LocalStore(self.tmp)
        self.store = store
        self.arrays, self.pending, self.flushed = {}, {}, {}
        try:
            group = zarr.open_group(store, mode="w")
            for array, spec in specs.items():
                self.arrays[array] = group.create_array(
                    array, shape=spec.shape, dtype=spec.dtype, chunks=(shards._chunk_rows(spec),) + spec.shape[1:],
                    compressors=None, fill_value=0,
                )
                self.pending[array], self.flushed[array] = [], 0
        except BaseException:
            self.abort()
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
        rows = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
        buffer, values = default_buffer_prototype().buffer, []
        for i, start in enumerate(range(0, len(rows), chunk)):
            stored = np.ascontiguousarray(rows[start : start + chunk])
            if len(stored) < chunk:  # the array's last chunk, padded with the fill value as zarr stores it
                stored = np.concatenate([stored, np.zeros((chunk - len(stored), *stored.shape[1:]), stored.dtype)])
            key = f"{name}/{array.metadata.encode_chunk_key((first_chunk + i,) + (0,) * (stored.ndim - 1))}"
            values.append((key, buffer.from_array_like(stored.reshape(-1).view(np.uint8))))

        async def set_all() -> None:
            limit = asyncio.Semaphore(zarr.config.get("async.concurrency"))

            async def put(key, value) -> None:
                async with limit:
                    await self.store.set(key, value)

            # every write finished before an error is raised, so abort() never races a write in flight
            results = await asyncio.gather(*(put(key, value) for key, value in values), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

        sync(set_all())

    def _finish(self):
        for name in self.arrays:
            self._flush(name, final=True)
        super()._finish()  # no files of its own to close: fsyncs and the rename


@contextlib.contextmanager
def chunk_file_writes():
    """Every zarr shard created meanwhile (shards.create_shard) is written in layout 1."""
    with mock.patch.object(shards, "ZarrShardWriter", ChunkFilesWriter):
        yield
