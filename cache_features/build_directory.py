"""The state of a cache directory during a build: its lock, and the reuse / resume / refuse decision.

What a directory may hold (layout in manifest.py): manifest.json once complete, build.json from the
start of a build, progress/<shard>.json per finished shard, shards/, and the temp names a killed
build leaves behind, which are never trusted and are removed on resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.fileio import disk_full_error, is_disk_full, pid_lock

from .location import Location
from .manifest import BUILD_RECORD, MANIFEST, PROGRESS_DIR, SHARD_DIR, load_manifest, read_json_at, write_json_at

logger = logging.getLogger(__name__)

_OUR_NAMES = {MANIFEST, BUILD_RECORD, SHARD_DIR, PROGRESS_DIR, ".lock"}
# Temp names of fileio.atomic_path (".<final name>.<random>.tmp") and of the shard writers
# (".<shard>.tmp-<pid>"): what a kill -9 mid-write leaves behind.
_STALE_TEMP = {
    "": re.compile(r"^\.(manifest|build)\.json\..+\.tmp$"),
    PROGRESS_DIR: re.compile(r"^\.shard-\d{5}\.(zarr|h5)\.json\..+\.tmp$"),
    SHARD_DIR: re.compile(r"^\.shard-\d{5}\.(zarr|h5)\.tmp-\d+$"),
}


# A build waiting for another one to finish the same directory gives up when the other has not
# finished a shard for this long (a hung or stopped process), instead of waiting forever.
LOCK_WAIT_TIMEOUT = 1800.0
# A URL store's lock object not renewed for this long belongs to a build that died.
URL_LEASE_SECONDS = 300.0


@contextlib.contextmanager
def directory_lock(location: Location, enabled: bool, *, wait_timeout: float = LOCK_WAIT_TIMEOUT):
    """A second build of the same local directory waits for the first (then finds its cache).

    The wait ends with a UserError when the first build finishes no shard for `wait_timeout`
    seconds. file:// URLs are locked like the local directory they are; other URLs (object stores
    have no flock) take a lock object, and a build that finds another's live lock object is refused.
    """
    if not enabled:
        yield
        return
    local = _local_path(location)
    if local is None:
        with _url_lease(location):
            yield
        return
    lock_path = local / ".lock"
    seen = {"state": None, "since": time.monotonic()}

    def give_up_when_stalled(holder: str) -> None:
        state = location.listdir(PROGRESS_DIR), location.exists(MANIFEST)
        now = time.monotonic()
        if state != seen["state"]:
            seen["state"], seen["since"] = state, now
        elif now - seen["since"] > wait_timeout:
            raise UserError(
                f"gave up waiting for {lock_path}: the build holding it (pid {holder}) finished no shard in "
                f"{wait_timeout:.0f} s; if that process is stuck, stop it and rerun (the build resumes)"
            )

    with pid_lock(lock_path, when_held=lambda pid: logger.warning("waiting: another build (pid %s) holds %s",
                                                                  pid, lock_path),
                  while_waiting=give_up_when_stalled):
        yield


def _local_path(location: Location):
    """The local directory behind a path or a file:// URL; None for a remote store."""
    if not location.url:
        return location.path
    protocol = location.fs.protocol if isinstance(location.fs.protocol, str) else location.fs.protocol[0]
    return Path(location.root) if protocol in ("file", "local") else None


@contextlib.contextmanager
def _url_lease(location: Location):
    """An advisory lock object (`.lock`: host, pid, time) renewed while the build runs, removed after."""
    import socket
    import threading
    import uuid

    mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
    held = _read_lease(location)
    if held is not None and not _lease_is_stale(held, mine["host"]):
        age = time.time() - float(held["time"])
        raise UserError(
            f"cache {location} is being built by another process (pid {held.get('pid')} on {held.get('host')}, "
            f"lock object renewed {age:.0f} s ago); rerun once it has finished, or if no build is running "
            f"delete {location.full('.lock')}"
        )
    renew = threading.Event()

    def write() -> None:
        location.write_bytes(".lock", json.dumps({**mine, "time": time.time()}).encode())

    def keep_renewing() -> None:
        while not renew.wait(URL_LEASE_SECONDS / 5):
            with contextlib.suppress(Exception):  # a missed renewal only shortens the lease
                write()

    write()
    thread = threading.Thread(target=keep_renewing, name="prlmfuse-cache-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        renew.set()
        thread.join()
        with contextlib.suppress(Exception):
            if (_read_lease(location) or {}).get("token") == mine["token"]:
                location.remove(".lock")


def _read_lease(location: Location) -> dict | None:
    try:
        held = json.loads(location.read_bytes(".lock"))
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) and isinstance(held.get("time"), (int, float)) else None


def _lease_is_stale(held: dict, host: str) -> bool:
    if time.time() - float(held["time"]) > URL_LEASE_SECONDS:
        return True
    if held.get("host") == host and isinstance(held.get("pid"), int):
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return True  # died on this machine
        except PermissionError:
            return False
    return False


def completed_records(location: Location, key: str, names: dict[int, str]) -> dict[int, dict]:
    """Progress records of shards finished by an earlier (possibly killed) run of the same build."""
    done = {}
    for index, name in names.items():
        rel = f"{PROGRESS_DIR}/{name}.json"
        if not location.exists(rel):
            continue
        try:
            record = read_json_at(location, rel, "progress record")
        except UserError:
            continue  # a torn record (URL stores) just means: redo this shard
        if record.get("key") == key and record.get("name") == name and location.exists(f"{SHARD_DIR}/{name}"):
            done[index] = record
    return done


def _has_shards(location: Location) -> bool:
    return bool(location.listdir(SHARD_DIR) or location.listdir(PROGRESS_DIR))


def _clear_build_state(location: Location) -> None:
    for name in (MANIFEST, BUILD_RECORD, PROGRESS_DIR, SHARD_DIR):
        location.remove(name)


def _remove_stale_temps(location: Location) -> None:
    """Delete what killed builds left half-written (called under the directory lock)."""
    if location.url:
        return
    for sub, pattern in _STALE_TEMP.items():
        directory = location.path / sub
        if directory.is_dir():
            for entry in os.listdir(directory):
                if pattern.match(entry):
                    location.remove(f"{sub}/{entry}" if sub else entry)


def prepare_directory(location: Location, key: str, fields: dict, backend: str, plan_params: dict,
                      force: bool) -> dict | None:
    """Decide reuse / resume / fresh build. Returns the manifest when the cache can be reused."""
    entries = {e for e in location.listdir() if not _STALE_TEMP[""].match(e)}
    foreign = entries - _OUR_NAMES
    if foreign and not (entries & {MANIFEST, BUILD_RECORD}):
        raise UserError(
            f"output directory {location} is not empty and holds no prlmfuse cache "
            f"(found {sorted(foreign)[:3]}); choose an empty or new directory"
        )
    if force:
        if entries & {MANIFEST, BUILD_RECORD, SHARD_DIR, PROGRESS_DIR}:
            logger.info("%s: replacing what is there (--force)", location)
        _clear_build_state(location)
    else:
        found = None  # (key, backend) of what the directory holds
        if MANIFEST in entries:
            try:
                manifest = read_json_at(location, MANIFEST, "cache manifest")
                if manifest.get("key") == key and manifest.get("backend") == backend and manifest.get("complete") is True:
                    return load_manifest(location)[1]  # reused only when its shard list is sound
                found = (manifest.get("key"), manifest.get("backend"))
            except UserError as e:
                # a torn or malformed manifest is rewritten at the end of the resumed build, if build.json agrees
                logger.info("%s: %s; resuming the build to rewrite it", location, e)
        if found is None and BUILD_RECORD in entries:
            record = read_json_at(location, BUILD_RECORD, "build record")
            found = (record.get("key"), record.get("backend"))
            if found == (key, backend) and record.get("plan") != plan_params:
                logger.info("%s: the interrupted build used another plan %s; starting over", location, record.get("plan"))
                _clear_build_state(location)
        elif found is None and entries & {SHARD_DIR, PROGRESS_DIR}:
            found = ("unknown", "unknown")
        if found is not None and found != (key, backend) and MANIFEST not in entries and not _has_shards(location):
            # A build that stopped before its first shard (a checkpoint that failed to load, say) leaves
            # nothing to keep: the fixed rerun starts over instead of being refused.
            logger.info("%s: an earlier build stopped before its first shard; starting over", location)
            _clear_build_state(location)
            found = None
        if found is not None and found != (key, backend):
            raise UserError(
                f"output directory {location} holds a different cache (key {str(found[0])[:12]}, backend "
                f"{found[1]}; this build is key {key[:12]}, backend {backend}); use --force to replace it "
                "or choose another --out"
            )
    _remove_stale_temps(location)
    try:
        write_json_at(location, BUILD_RECORD, {"key": key, "key_fields": fields, "backend": backend, "plan": plan_params})
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(BUILD_RECORD, location) from None
        raise
    return None
