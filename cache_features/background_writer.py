"""The storage side of a cache build: encoders and shard writers running beside the model's thread.

The model thread hands over each batch as host tensors (`HostBatch`; on a GPU a copy that may still be
in flight) and goes on to the next forward. A pool of encoder threads packs, checks and quantizes the
batches (torch's ops release the GIL); a pool of writer threads each owns one open shard at a time, so
one shard's commit (flush, fsync, rename, progress record) runs while the next shard is written. A
shard's rows reach its writer in batch order. At most IN_FLIGHT batches are held between the model and
the disk, whatever the number of threads.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from prlmfuse.fileio import disk_full_error, is_disk_full

from .codecs import encode, pooled_storage_dtype
from .location import Location
from .manifest import PROGRESS_DIR, SHARD_DIR, write_json_at
from .shards import ArraySpec, create_shard

IN_FLIGHT = 4  # batches handed over and not yet written: what bounds the build's memory beside the model
WRITERS = 2  # shards open at once: one commits while the next is written


def default_encoders() -> int:
    """Encoder threads: one per four cores, 1 to 4 (on a 2-core CPU the model's own threads need the cores)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass
class HostBatch:
    """One batch's features on the host, as the model thread hands them over.

    token_states [n_layers, B, T, d] with real_rows the flat indices of real tokens in B*T, or
    [n_layers, n_real_tokens, d] already packed (real_rows None); pooled [B, n_pooled, 2, d].
    ready() returns once the tensors may be read (a device-to-host copy has landed).
    """

    token_states: torch.Tensor
    pooled: torch.Tensor
    real_rows: torch.Tensor | None = None
    ready: Callable[[], None] | None = None


def encode_batch(batch: HostBatch, layers: tuple[int, ...], dtype: str) -> dict[str, np.ndarray]:
    """A batch's features -> the rows each shard array receives (padding dropped, sentence-major)."""
    if batch.ready is not None:
        batch.ready()
    rows: dict[str, np.ndarray] = {}
    for i, layer in enumerate(layers):
        # [n_real_tokens, d]: the real rows of [B, T, d], or all of an already packed [n_real_tokens, d]
        values, side = encode(batch.token_states[i], dtype, rows=batch.real_rows, what=f"hidden_states[{layer}]")
        rows[f"layer_{layer:03d}"] = values
        for name, array in side.items():
            rows[f"{name}_{layer:03d}"] = array
    rows["pooled"] = encode(batch.pooled, pooled_storage_dtype(dtype), what="the pooled (first-token and mean) vectors")[0]
    return rows


class BackgroundWriter:
    """Encodes and writes the shards of a build while the model thread computes.

    After a shard is renamed into place, its progress record is written: only then does the shard
    count as complete (the rule that also makes fsspec URLs, which cannot rename, safe). An error of any
    thread is raised in the model thread at its next call; once close() has drained every writer, the
    error it raises is the earliest shard's, whichever writer failed first, so that a full disk names the
    shard a rerun resumes from.
    """

    def __init__(self, location: Location, backend: str, key: str, layers: tuple[int, ...], dtype: str, *,
                 writers: int = WRITERS, encoders: int | None = None):
        self.location, self.backend, self.key = location, backend, key
        self.layers, self.dtype = layers, dtype
        self.failures: dict[int, BaseException] = {}  # shard's open order -> its first error
        self.failures_lock = threading.Lock()
        self.records: list[dict] = []
        self.slots = threading.BoundedSemaphore(IN_FLIGHT)
        self.encoders = ThreadPoolExecutor(encoders or default_encoders(), thread_name_prefix="prlmfuse-cache-encode")
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(writers)]
        self.threads = [threading.Thread(target=self._run, args=(q,), name=f"prlmfuse-cache-writer-{i}", daemon=True)
                        for i, q in enumerate(self.queues)]
        for thread in self.threads:
            thread.start()
        self.opened = 0  # shards opened so far: shard n goes to writer n % writers
        self.current: queue.Queue | None = None

    @property
    def error(self) -> BaseException | None:
        with self.failures_lock:
            return self.failures[min(self.failures)] if self.failures else None

    def raised(self, error: BaseException) -> bool:
        """Whether `error` is one of this writer's threads' errors (not the model thread's own)."""
        with self.failures_lock:
            return any(error is failure for failure in self.failures.values())

    def _check(self) -> None:
        error = self.error
        if error is not None:
            raise error

    def open(self, name: str, specs: dict[str, ArraySpec], first_rows: dict[str, np.ndarray], meta: dict) -> None:
        self._check()
        self.current = self.queues[self.opened % len(self.queues)]
        self.current.put(("open", self.opened, name, specs, first_rows, meta))
        self.opened += 1

    def append(self, take: Callable[[], HostBatch]) -> None:
        """Queue one batch for encoding and writing: take() hands it over once a slot is free, so that
        no more than IN_FLIGHT batches' host copies exist; blocks while IN_FLIGHT batches wait for the disk."""
        while not self.slots.acquire(timeout=0.5):
            self._check()
        try:
            self._check()
            future = self.encoders.submit(encode_batch, take(), self.layers, self.dtype)
        except BaseException:
            self.slots.release()
            raise
        self.current.put(("rows", future))

    def commit(self) -> None:
        self._check()
        self.current.put(("commit",))

    def close(self) -> list[dict]:
        # The sentinels go in even after an error: the threads keep draining, so this never blocks,
        # and they end instead of waiting forever on an abandoned queue.
        for q in self.queues:
            q.put(None)
        for thread in self.threads:
            thread.join()
        self.encoders.shutdown(wait=True)
        self._check()
        return self.records

    def _fail(self, error: BaseException, order: int, name: str | None) -> None:
        if is_disk_full(error):
            cause, error = error, disk_full_error(f"shard {name}", self.location)
            error.__cause__ = cause  # the OSError's traceback, for a debugger; the CLI prints the one line
        with self.failures_lock:
            self.failures.setdefault(order, error)

    def _run(self, items: queue.Queue) -> None:
        # A writer whose own work failed drains its queue. Another thread's error does not stop it: the
        # shard it holds was queued whole (its commit before the next shard's first rows), so it finishes
        # it, and a rerun rebuilds no shard it need not; an incomplete one is aborted at the sentinel.
        writer = None
        order, name, meta = -1, None, None
        failed = False
        while True:
            item = items.get()
            if item is None:
                break
            try:
                if item[0] == "rows":
                    try:
                        rows = item[1].result()
                        if not failed:
                            for array, values in rows.items():
                                writer.append(array, values)
                    finally:
                        self.slots.release()
                elif failed:
                    pass  # drain: the model thread never blocks on a dead writer
                elif item[0] == "open":
                    _, order, name, specs, first_rows, meta = item
                    writer = create_shard(self.location, self.backend, f"{SHARD_DIR}/{name}", specs)
                    for array, values in first_rows.items():
                        writer.append(array, values)
                else:
                    checksum, layout = writer.commit(), writer.layout
                    writer = None
                    record = {"name": name, "sha256": checksum, "key": self.key, "layout": layout, **meta}
                    write_json_at(self.location, f"{PROGRESS_DIR}/{name}.json", record)
                    self.records.append(record)
            except BaseException as e:  # noqa: BLE001 - re-raised in the model thread
                failed = True
                self._fail(e, order, name)
                if writer is not None:
                    writer.abort()
                    writer = None
        if writer is not None:
            writer.abort()
