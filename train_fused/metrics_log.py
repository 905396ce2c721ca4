"""Where training's records go: metrics.jsonl on rank 0 (a record reaches the file whole or not at all),
TensorBoard when the run asks for it, and the progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from prlmfuse.distributed import DistContext
from prlmfuse.fileio import disk_full_error, is_disk_full
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig

logger = logging.getLogger(__name__)


class MetricsLog:
    """metrics.jsonl (rank 0), optional TensorBoard, tqdm."""

    def __init__(self, run_dir: Path, run: RunConfig, ctx: DistContext, progress: bool, total: int | None, initial: int):
        self.enabled = ctx.is_main
        self.path = run_dir / rundir.METRICS
        self.tb = None
        self.bar = None
        if not self.enabled:
            return
        if run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / rundir.TENSORBOARD_DIR))
            except ImportError:
                logger.warning("run.tensorboard is set but the tensorboard package is not installed; logging to metrics.jsonl only")
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=run.name, unit="upd", dynamic_ncols=True, file=sys.stderr)
        # Unbuffered bytes: a record either reaches the file whole or is cut back off it.
        self.file = open(self.path, "ab", buffering=0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        data = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        size = os.fstat(self.file.fileno()).st_size
        try:
            written = 0
            while written < len(data):
                written += self.file.write(data[written:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.file.fileno(), size)
            if is_disk_full(e):
                raise disk_full_error(rundir.METRICS, self.path.parent) from None
            raise
        if self.tb is not None:
            for k, v in record.items():
                if k != "update" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["update"])

    def tick(self, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
