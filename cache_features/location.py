"""Location: a cache directory that is either a local path or an fsspec URL, addressed by relative names."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from prlmfuse.fileio import atomic_write_bytes


def is_url(path_or_url: str | os.PathLike) -> bool:
    return "://" in str(path_or_url)


class Location:
    """A cache directory: a local path or an fsspec URL. Files are addressed by relative names."""

    def __init__(self, path_or_url: str | os.PathLike):
        self.raw = str(path_or_url)
        self.url = is_url(self.raw)
        self._fs, self._fs_pid = None, None
        if self.url:
            self._fs, self.root = self._filesystem()
            self._fs_pid = os.getpid()
        else:
            self.path = Path(self.raw)

    def _filesystem(self):
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(self.raw)
        return fs, root.rstrip("/")

    @property
    def fs(self):
        """The URL's fsspec filesystem, made in the process that uses it: async filesystems (s3, gcs, http)
        refuse to run in a process forked from the one that made them, and a reader is handed to workers."""
        if self._fs_pid != os.getpid():
            self._fs, _ = self._filesystem()
            self._fs_pid = os.getpid()
        return self._fs

    def __getstate__(self):
        return {**self.__dict__, "_fs": None, "_fs_pid": None}

    def __str__(self) -> str:
        return self.raw

    def full(self, name: str) -> str:
        return f"{self.root}/{name}" if self.url else str(self.path / name)

    def url_of(self, name: str) -> str:
        """What zarr's FsspecStore.from_url receives for a child of this location."""
        return f"{self.raw.rstrip('/')}/{name}"

    def zarr_store(self, name: str, *, read_only: bool):
        """A zarr store for the child `name`: LocalStore for a path, FsspecStore for a URL."""
        import zarr

        if not self.url:
            return zarr.storage.LocalStore(self.path / name, read_only=read_only)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        # fsspec's local filesystem does not create the parent directories of what zarr writes by itself
        options = {"auto_mkdir": True} if protocol in ("file", "local") and not read_only else None
        return zarr.storage.FsspecStore.from_url(self.url_of(name), storage_options=options, read_only=read_only)

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.full(name)) if self.url else (self.path / name).exists()

    def read_bytes(self, name: str) -> bytes:
        if self.url:
            with self.fs.open(self.full(name), "rb") as f:
                return f.read()
        return (self.path / name).read_bytes()

    def open_for_writing(self, name: str):
        """A new binary file at `name`, its parent directories made (object stores have none)."""
        if self.url:
            parent = self.full(name).rsplit("/", 1)[0]
            with contextlib.suppress(Exception):
                self.fs.makedirs(parent, exist_ok=True)
            return self.fs.open(self.full(name), "wb")
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")

    def write_bytes(self, name: str, data: bytes) -> None:
        """Local: temp + fsync + rename. URL: one object put (whole or absent on object stores)."""
        if self.url:
            with self.open_for_writing(name) as f:
                f.write(data)
        else:
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
