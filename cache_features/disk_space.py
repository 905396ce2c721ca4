"""Reserve a file's disk blocks up front, so that a full disk fails before HDF5 writes metadata.

HDF5 does not survive a write that fails inside its metadata flush: the dataset or file close
that hits the full disk leaves an id it cannot release, and the process segfaults (h5py#914).
With every block the shard needs reserved first, a full disk fails as a plain OSError instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

HDF5_METADATA_BYTES = 4096  # room for HDF5's own bytes per object (superblock, one header per dataset)
_FALLOC_FL_KEEP_SIZE = 1


def reserve_space(path: Path, nbytes: int) -> None:
    """Allocate disk blocks for the first `nbytes` of `path` without changing its size."""
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
