"""Small file helpers shared by every stage: prlmfuse's home directory, atomic writes, hashing (with
the size+mtime memo that makes re-checking an unchanged file cheap), checked text reading."""

from __future__ import annotations

import contextlib
import fcntl
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from prlmfuse.errors import UserError


def prlmfuse_home() -> Path:
    """Where prepared PrLMs, the file-digest cache and fetched apt lists live: $PRLMFUSE_HOME or
    ~/.cache/prlmfuse."""
    env = os.environ.get("PRLMFUSE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prlmfuse"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Filesystem timestamps are coarse (a tick of several ms), so a second write soon after the first
# could leave size and mtime unchanged ("racy git"): nothing modified this recently is remembered.
RACY_SECONDS = 3.0


class StatMemo:
    """Facts about files remembered by their (size, mtime) in $PRLMFUSE_HOME/<name>, so that checking
    a file again costs a stat call instead of a read. Losing or damaging the memo only costs re-reading;
    concurrent writers each replace it whole, and the last one wins."""

    def __init__(self, name: str) -> None:
        self.path = prlmfuse_home() / name
        try:
            with open(self.path, encoding="utf-8") as f:
                entries = json.load(f).get("entries", {})
        except (OSError, ValueError, AttributeError):
            entries = {}
        self.entries: dict[str, dict] = entries if isinstance(entries, dict) else {}
        self.dirty = False

    def get(self, key: str, stamp) -> object | None:
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == stamp:
            return entry.get("value")
        return None

    def put(self, key: str, stamp, value, *, newest_mtime: float) -> None:
        """Remember `value` for `key` while it has `stamp`, unless a file behind it changed too recently."""
        if time.time() - newest_mtime > RACY_SECONDS:
            self.entries[key] = {"stamp": stamp, "value": value}
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, {"version": 2, "entries": live})
        self.dirty = False


class FileDigests:
    """sha256 of files, re-hashed only when a file's size or mtime changed since it was last hashed."""

    def __init__(self) -> None:
        self.memo = StatMemo("file_digests.json")

    def sha256(self, path: str | os.PathLike) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        stamp = [st.st_size, st.st_mtime_ns]
        digest = self.memo.get(real, stamp)
        if not isinstance(digest, str):
            digest = sha256_file(real)
            self.memo.put(real, stamp, digest, newest_mtime=st.st_mtime)
        return digest

    def save(self) -> None:
        self.memo.save()


def is_disk_full(error: BaseException) -> bool:
    """A full disk or an exhausted quota, however the writing library reports it.

    Python, h5py and zarr raise OSError with errno set; safetensors (Rust) raises SafetensorError
    whose text ends in "(os error 28)".
    """
    codes = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(error, OSError) and error.errno in codes:
        return True
    return any(f"(os error {code})" in str(error) for code in codes)


def disk_full_error(what: str, where: str | os.PathLike) -> UserError:
    """The one line every stage gives when a write finds the disk full: what, where, and that a rerun resumes."""
    return UserError(f"disk full while writing {what} in {where}; free space and rerun to resume")


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def publish_directory(tmp: Path, final: Path) -> None:
    """Rename a fully written temp directory into place, replacing a stale copy if one exists."""
    _fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it into place.

    A crash at any moment leaves either the old file or the new one, never half of one,
    so the next run can trust whatever it finds under the final name.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp, str(tmp_path)):
            # Name the file being written, not its temp name (OSError picks the subclass from errno).
            raise OSError(e.errno, e.strerror, str(final)) from e
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` atomically; a file that already holds exactly these bytes is left untouched,
    so re-running a finished step changes nothing on disk (not even modification times)."""
    p = Path(path)
    with contextlib.suppress(OSError):
        if p.stat().st_size == len(data) and p.read_bytes() == data:
            return
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """Read JSON written by us; a truncated or corrupt file is a UserError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} is corrupt or truncated ({e}); rebuild it") from None


# Control characters a sentence never holds (tab is text, '\n' ends lines): a NUL or an escape code
# would reach the BPE and the PrLM as tokens, and a lone CR means the file's line endings are not '\n'.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def read_lines(path: str | os.PathLike, *, check_text: bool = True) -> list[str]:
    """Read a line-aligned UTF-8 corpus file; invalid UTF-8 is reported as file:line.

    Only '\\n' separates lines (str.splitlines would also split on U+2028 and friends,
    which silently breaks line alignment between source and target files). A UTF-8 byte-order
    mark at the start is dropped, never passed on as U+FEFF. With `check_text`, CR-only line
    endings and control characters inside a line are refused with file:line:column.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"corpus file not found: {p}") from None
    except IsADirectoryError:
        raise UserError(f"corpus path is a directory, expected a text file: {p}") from None
    return decode_lines(data, str(p), check_text=check_text)


def decode_lines(data: bytes, where: str, *, check_text: bool = True) -> list[str]:
    """read_lines on bytes already read (stdin, say); `where` names them in errors."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{where}:{line_no}: invalid UTF-8 (byte 0x{data[e.start]:02x}); re-encode the file as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if text.endswith("\n"):
        text = text[:-1]
    if text == "":
        return [] if not data else [""]
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if check_text and _CONTROL.search(text):  # searched in place: no copy of a whole corpus file
        _check_control_characters(where, lines)
    return lines


def _check_control_characters(path: str, lines: list[str]) -> None:
    for number, line in enumerate(lines, 1):
        found = _CONTROL.search(line)
        if found is None:
            continue
        column = found.start() + 1
        if found.group() == "\r":
            raise UserError(
                f"{path}:{number}:{column}: carriage return inside a line (CR-only line endings?); "
                "convert the file to '\\n' line endings (e.g. `tr '\\r' '\\n'`)"
            )
        raise UserError(
            f"{path}:{number}:{column}: control character U+{ord(found.group()):04X} inside a line; "
            "remove it or replace it with a space"
        )


@contextlib.contextmanager
def pid_lock(lock_path: Path, *, when_held: Callable[[str], None], purpose: str = "",
             while_waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """An exclusive flock on `lock_path` that records the holder's pid (and `purpose`, after a space).

    When another process holds it, `when_held(holder)` decides, given what the holder recorded:
    return to wait for the lock, or raise (e.g. a UserError naming the holder) to give up. While
    waiting, `while_waiting(holder)` (if given) is called about once a second and may raise to give
    up. The kernel drops the lock when its holder dies, so a kill -9 never leaves a stale lock behind.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            when_held(holder)
            if while_waiting is None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            else:
                while True:
                    try:
                        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        while_waiting(holder)
                        time.sleep(1.0)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} {purpose}".strip())
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
