"""The writer thread of a cache build: it owns the open shard while the model thread keeps computing."""

from __future__ import annotations

import queue
import threading

import numpy as np

from prlmfuse.fileio import disk_full_error, is_disk_full

from .location import Location
from .manifest import PROGRESS_DIR, SHARD_DIR, write_json_at
from .shards import ArraySpec, create_shard

_QUEUE_BATCHES = 4  # bounded: at most this many encoded batches wait for the disk


class BackgroundWriter:
    """Owns the open shard; the model thread only enqueues encoded rows (bounded queue).

    After a shard is renamed into place, its progress record is written: only then does the
    shard count as complete (the rule that also makes fsspec URLs, which cannot rename, safe).
    """

    def __init__(self, location: Location, backend: str, key: str):
        self.location, self.backend, self.key = location, backend, key
        self.queue: queue.Queue = queue.Queue(maxsize=_QUEUE_BATCHES)
        self.error: BaseException | None = None
        self.records: list[dict] = []
        self.thread = threading.Thread(target=self._run, name="prlmfuse-cache-writer", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def open(self, name: str, specs: dict[str, ArraySpec], first_rows: dict[str, np.ndarray], meta: dict) -> None:
        self._put(("open", name, specs, first_rows, meta))

    def append(self, rows: dict[str, np.ndarray]) -> None:
        self._put(("rows", rows))

    def commit(self) -> None:
        self._put(("commit",))

    def close(self) -> list[dict]:
        # The sentinel goes in even after an error: the thread keeps draining, so this never
        # blocks, and the thread ends instead of waiting forever on an abandoned queue.
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.records

    def _run(self) -> None:
        writer = None
        name = meta = None
        while True:
            item = self.queue.get()
            if item is None:
                break
            if self.error is not None:
                continue  # drain so the model thread never blocks on a dead writer
            try:
                if item[0] == "open":
                    _, name, specs, first_rows, meta = item
                    writer = create_shard(self.location, self.backend, f"{SHARD_DIR}/{name}", specs)
                    for array, rows in first_rows.items():
                        writer.append(array, rows)
                elif item[0] == "rows":
                    for array, rows in item[1].items():
                        writer.append(array, rows)
                else:
                    checksum = writer.commit()
                    writer = None
                    record = {"name": name, "sha256": checksum, "key": self.key, **meta}
                    write_json_at(self.location, f"{PROGRESS_DIR}/{name}.json", record)
                    self.records.append(record)
            except BaseException as e:  # noqa: BLE001 - re-raised in the model thread
                self.error = disk_full_error(f"shard {name}", self.location) if is_disk_full(e) else e
                if writer is not None:
                    writer.abort()
                    writer = None
        if writer is not None:
            writer.abort()
