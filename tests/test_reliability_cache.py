"""Stage one under crashes, contention, full disks and damage.

Fast: a simulated full disk (the storage backends' lowest Python-level write raises ENOSPC) for
both backends; stale temp files of killed builds never block or survive a rerun.
Slow: ten kill -9 trials at seeded random moments of real builds; two concurrent builds of one
directory; a real full disk (a small tmpfs in a private mount namespace, when the kernel allows it).
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prlmfuse.cache_features import build_cache, verify_cache
from prlmfuse.errors import UserError

from helpers import reliability, tiny_prlms

torch.set_num_threads(1)
# 300 distinct sentences, 28 shards of one 256-token batch each: a build takes a second or two.
BUILD_ARGS = dict(layers="-2,-1", dtype="float16", max_tokens=256, shard_bytes=3000, precision="fp32")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-cache")
    checkpoint = tiny_prlms.build_tiny("bert", root / "bert")
    corpus = tiny_prlms.write_corpus(root / "train.src", reliability.distinct_sentences(300))
    references = {
        backend: build_cache(str(checkpoint), corpus, root / f"reference-{backend}", backend=backend, progress=False,
                             **BUILD_ARGS)
        for backend in ("zarr", "hdf5")
    }
    assert len(references["zarr"].manifest["shards"]) >= 20
    return {"root": root, "checkpoint": str(checkpoint), "corpus": str(corpus), "references": references}


# ------------------------------------------------------------------------------------ full disk (simulated)


def _shard_index(path: str) -> int | None:
    # temp shards are ".shard-00003.zarr.tmp-<pid>" / ".shard-00003.h5.tmp-<pid>"
    marker = ".shard-"
    at = path.rfind(marker)
    return int(path[at + len(marker): at + len(marker) + 5]) if at >= 0 else None


@pytest.fixture
def disk_full_from_shard(monkeypatch):
    """Make every write into shard >= N fail with ENOSPC, at the backends' own write calls: h5py's, zarr's store (its
    metadata) and the zarr writer's own shard files."""
    import h5py
    import zarr

    from prlmfuse.cache_features.location import Location

    state = {"from": None}
    original_set = zarr.storage.LocalStore.set
    original_setitem = h5py.Dataset.__setitem__
    original_open = Location.open_for_writing

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def zarr_set(self, key, value):
        index = _shard_index(str(self.root))
        if state["from"] is not None and index is not None and index >= state["from"]:
            raise full()
        return await original_set(self, key, value)

    def h5_setitem(self, key, value):
        index = _shard_index(self.file.filename)
        if state["from"] is not None and index is not None and index >= state["from"]:
            raise full()
        return original_setitem(self, key, value)

    class FullFile:
        def __init__(self, location, name):
            self.file, self.index = original_open(location, name), _shard_index(location.full(name))

        def write(self, data):
            if state["from"] is not None and self.index is not None and self.index >= state["from"]:
                raise full()
            return self.file.write(data)

        def close(self):
            self.file.close()

    monkeypatch.setattr(zarr.storage.LocalStore, "set", zarr_set)
    monkeypatch.setattr(h5py.Dataset, "__setitem__", h5_setitem)
    monkeypatch.setattr(Location, "open_for_writing", lambda location, name: FullFile(location, name))
    return state


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_disk_full_is_one_line_keeps_finished_shards_and_the_rerun_completes(world, tmp_path, backend,
                                                                              disk_full_from_shard):
    out = tmp_path / "cache"
    reference = world["references"][backend]
    suffix = {"zarr": ".zarr", "hdf5": ".h5"}[backend]
    disk_full_from_shard["from"] = 5
    with pytest.raises(UserError) as failed:
        build_cache(world["checkpoint"], world["corpus"], out, backend=backend, progress=False, **BUILD_ARGS)
    assert str(failed.value) == (
        f"disk full while writing shard shard-00005{suffix} in {out}; free space and rerun to resume"
    )
    # The five finished shards are there and recorded, the torn sixth is gone (its space freed).
    assert sorted(p.name for p in (out / "progress").iterdir()) == [f"shard-{i:05d}{suffix}.json" for i in range(5)]
    assert sorted(p.name for p in (out / "shards").iterdir()) == [f"shard-{i:05d}{suffix}" for i in range(5)]
    assert not (out / "manifest.json").exists()
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "shards").iterdir()}

    disk_full_from_shard["from"] = None  # space is back
    resumed = build_cache(world["checkpoint"], world["corpus"], out, backend=backend, progress=False, **BUILD_ARGS)
    assert not resumed.reused and resumed.key == reference.key
    # The earlier shards were reused as they were, not rewritten, and they check out.
    after = {n: ((out / "shards" / n).stat().st_ino, (out / "shards" / n).stat().st_mtime_ns) for n in before}
    assert after == before
    reliability.assert_same_cache(out, Path(reference.path))


def test_disk_full_while_writing_the_manifest_is_named_too(world, tmp_path, monkeypatch):
    from prlmfuse.cache_features import builder

    original = builder.write_json_at

    def write_json_at(location, name, obj):
        if name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(location, name, obj)

    monkeypatch.setattr(builder, "write_json_at", write_json_at)
    out = tmp_path / "cache"
    with pytest.raises(UserError, match=rf"^disk full while writing manifest\.json in {out}; free space and rerun"):
        build_cache(world["checkpoint"], world["corpus"], out, backend="hdf5", progress=False, **BUILD_ARGS)
    monkeypatch.setattr(builder, "write_json_at", original)
    resumed = build_cache(world["checkpoint"], world["corpus"], out, backend="hdf5", progress=False, **BUILD_ARGS)
    assert not resumed.reused
    reliability.assert_same_cache(out, Path(world["references"]["hdf5"].path))


def test_temp_files_of_a_killed_build_neither_block_nor_survive_the_rerun(world, tmp_path):
    """A kill during the very first atomic write leaves only '.build.json.<x>.tmp' (and the lock)."""
    out = tmp_path / "cache"
    out.mkdir()
    (out / ".lock").write_text("12345")
    (out / ".build.json.k3j2h1.tmp").write_text('{"key": "ab')
    first = build_cache(world["checkpoint"], world["corpus"], out, backend="hdf5", progress=False, **BUILD_ARGS)
    assert not first.reused and reliability.temp_leftovers(out) == []

    # Kill leftovers at every level of a half-built cache: manifest, progress record and shard temps.
    (out / "manifest.json").unlink()
    (out / "progress" / "shard-00003.h5.json").unlink()
    (out / ".manifest.json.a1b2c3.tmp").write_text("{")
    (out / "progress" / ".shard-00003.h5.json.x9y8z7.tmp").write_text("{")
    (out / "shards" / ".shard-00004.h5.tmp-999999").write_bytes(b"\x89HDF")
    second = build_cache(world["checkpoint"], world["corpus"], out, backend="hdf5", progress=False, **BUILD_ARGS)
    assert not second.reused
    reliability.assert_same_cache(out, Path(world["references"]["hdf5"].path))


# ------------------------------------------------------------------------------------ slow: real processes


@pytest.fixture(scope="module")
def zygote(world):
    z = reliability.Zygote(env={"PRLMFUSE_HOME": str(world["root"] / "home")})
    yield z
    z.close()


def _build_kwargs(world, out: Path, backend: str, result: Path, **overrides) -> dict:
    return dict(checkpoint=world["checkpoint"], corpus=world["corpus"], out=str(out), result=str(result),
                backend=backend, progress=True, **{**BUILD_ARGS, **overrides})


def _partial_state(out: Path) -> dict:
    progress = out / "progress"
    return {
        "records": len(list(progress.glob("shard-*.json"))) if progress.is_dir() else 0,
        "manifest": (out / "manifest.json").exists(),
        "temps": reliability.temp_leftovers(out) if out.is_dir() else [],
    }


@pytest.mark.slow
def test_ten_kill_9_trials_at_random_moments_then_rerun_equal_an_uninterrupted_build(world, zygote, tmp_path):
    rng = random.Random(20240607)
    # How long an uninterrupted build takes in a zygote child (model load included), per backend.
    duration = {}
    for backend in ("zarr", "hdf5"):
        status, seconds = zygote.run("job_build_cache", tmp_path / f"timing-{backend}.log",
                                     **_build_kwargs(world, tmp_path / f"timing-{backend}", backend, tmp_path / "t.json"))
        assert status == 0, (tmp_path / f"timing-{backend}.log").read_text()
        duration[backend] = seconds

    observed = []
    for trial in range(10):
        backend = ("zarr", "hdf5")[trial % 2]
        out = tmp_path / f"trial-{trial}"
        log = tmp_path / f"trial-{trial}.log"
        # Every other trial also kills the first resume: a resume of a resume must hold up too.
        for kill in range(1 + (trial % 4 == 0)):
            offset = rng.uniform(0.02, 0.95) * duration[backend]
            status = zygote.run_and_kill("job_build_cache", log, offset,
                                         **_build_kwargs(world, out, backend, tmp_path / "r.json"))
            state = _partial_state(out)
            observed.append((trial, kill, backend, round(offset, 2), status, state["records"], state["manifest"]))
            if state["manifest"]:  # killed after the end: whatever is there is complete and correct
                verify_cache(out)
        status, _ = zygote.run("job_build_cache", log, **_build_kwargs(world, out, backend, tmp_path / "r.json"))
        assert status == 0, log.read_text()[-3000:]
        reliability.assert_same_cache(out, Path(world["references"][backend].path))

    killed_mid_build = [o for o in observed if o[4] == -9 and not o[6]]
    print("\n".join(map(str, observed)))
    # The kills must have landed inside builds, at different stages (shards already done).
    assert len(killed_mid_build) >= 5, observed
    assert len({o[5] for o in killed_mid_build}) >= 3, observed


@pytest.mark.slow
def test_two_concurrent_builds_of_one_directory(world, zygote, tmp_path):
    reference = Path(world["references"]["zarr"].path)
    out = tmp_path / "shared"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    results = [tmp_path / "a.json", tmp_path / "b.json"]
    pids = [zygote.start("job_build_cache", logs[i], **_build_kwargs(world, out, "zarr", results[i])) for i in range(2)]
    statuses = [zygote.wait(pid) for pid in pids]
    assert statuses == [0, 0], [log.read_text()[-2000:] for log in logs]
    reused = sorted(json.loads(r.read_text())["reused"] for r in results)
    assert reused == [False, True]  # one built it, the other waited and then found it finished
    text = "".join(log.read_text() for log in logs)
    assert "waiting: another build (pid" in text and f"holds {out / '.lock'}" in text
    reliability.assert_same_cache(out, reference)

    # Same directory, different key: whichever takes the lock first builds; the other waits, then
    # refuses with one clear line. Which one wins is up to the scheduler, so the test accepts either.
    fresh = tmp_path / "contested"
    jobs = {"c": {}, "d": {"layers": "-1"}}
    pids = {name: zygote.start("job_build_cache", tmp_path / f"{name}.log",
                               **_build_kwargs(world, fresh, "zarr", tmp_path / f"{name}.json", **extra))
            for name, extra in jobs.items()}
    statuses = {name: zygote.wait(pid) for name, pid in pids.items()}
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in jobs}
    assert sorted(statuses.values()) == [0, 2], logs
    winner = next(name for name, status in statuses.items() if status == 0)
    loser = next(name for name, status in statuses.items() if status == 2)
    refusal = [line for line in logs[loser].splitlines() if line.startswith("error: ")]
    assert len(refusal) == 1 and "holds a different cache" in refusal[0] and "--force" in refusal[0]
    if winner == "c":
        reliability.assert_same_cache(fresh, reference)
    else:
        assert json.loads((tmp_path / "d.json").read_text())["reused"] is False

_TMPFS_DRIVER = r"""
import json, shutil, subprocess, sys
import torch
torch.set_num_threads(1)
from prlmfuse.cache_features import build_cache
from prlmfuse.errors import UserError
args = json.loads(sys.argv[1])
report = {}
for backend, size in args["sizes"].items():
    out = args["out"] + "-" + backend
    subprocess.run(["mkdir", "-p", out], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", out], check=True)
    entry = report[backend] = {}
    try:
        build_cache(args["checkpoint"], args["corpus"], out, backend=backend, progress=False, **args["build"])
        entry["first"] = "completed"
    except UserError as e:
        entry["first"] = str(e)
    entry["progress_after_failure"] = sorted(__import__("os").listdir(out + "/progress"))
    subprocess.run(["mount", "-o", "remount,size=256m", out], check=True)  # space is back
    build_cache(args["checkpoint"], args["corpus"], out, backend=backend, progress=False, **args["build"])
    shutil.copytree(out, args["copy"] + "-" + backend)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_real_full_disk_on_a_small_tmpfs(world, tmp_path):
    reliability.skip_without_private_mounts(tmp_path)
    sizes = {}
    for backend in ("zarr", "hdf5"):
        reference = Path(world["references"][backend].path)
        pages = sum(-(-p.stat().st_size // 4096) for p in reference.rglob("*") if p.is_file())
        sizes[backend] = f"{pages * 4096 // 2 // 1024}k"  # room for about half the cache
    args = {"checkpoint": world["checkpoint"], "corpus": world["corpus"], "out": str(tmp_path / "mnt"),
            "copy": str(tmp_path / "copy"), "sizes": sizes, "build": BUILD_ARGS}
    done = subprocess.run(["unshare", "-Urm", sys.executable, "-c", textwrap.dedent(_TMPFS_DRIVER), json.dumps(args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PRLMFUSE_HOME": str(world["root"] / "home"), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for backend, entry in report.items():
        message = entry["first"]
        assert message.startswith("disk full while writing ") and message.endswith("; free space and rerun to resume")
        assert f" in {tmp_path / 'mnt'}-{backend};" in message and "\n" not in message
        assert 0 < len(entry["progress_after_failure"]) < len(world["references"][backend].manifest["shards"])
        reliability.assert_same_cache(tmp_path / f"copy-{backend}", Path(world["references"][backend].path))


# ------------------------------------------------------------------------------------ waiting builds and URL locks


@pytest.mark.parametrize("as_url", [False, True])
def test_a_waiting_build_gives_up_on_a_build_that_finishes_no_shard(world, tmp_path, as_url):
    out = tmp_path / "cache"
    holder = reliability.hold_lock(out / ".lock", "", 120)  # a build that hangs before its first shard
    try:
        with pytest.raises(UserError) as gave_up:
            build_cache(world["checkpoint"], world["corpus"], f"file://{out}" if as_url else out, progress=False,
                        lock_timeout=2, **BUILD_ARGS)
    finally:
        holder.kill()
        holder.wait()
    assert str(gave_up.value) == (
        f"gave up waiting for {out / '.lock'}: the build holding it (pid {holder.pid}) finished no shard in 2 s; "
        "if that process is stuck, stop it and rerun (the build resumes)")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written meanwhile
    built = build_cache(world["checkpoint"], world["corpus"], out, progress=False, lock_timeout=2, **BUILD_ARGS)
    assert built.key == world["references"]["zarr"].key


def test_url_caches_take_a_lock_object_and_refuse_a_live_one(world, tmp_path):
    import socket
    import time

    import fsspec

    url = f"memory://prlmfuse-lock-{tmp_path.name}/cache"
    fs = fsspec.filesystem("memory")
    lock = f"/prlmfuse-lock-{tmp_path.name}/cache/.lock"
    fs.makedirs(lock.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe(lock, json.dumps({"host": "elsewhere", "pid": 7, "token": "x", "time": time.time()}).encode())
    with pytest.raises(UserError) as refused:
        build_cache(world["checkpoint"], world["corpus"], url, progress=False, **BUILD_ARGS)
    assert str(refused.value).startswith(f"cache {url} is being built by another process (pid 7 on elsewhere, ")
    assert f"delete {lock}" in str(refused.value)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(lock.rsplit("/", 1)[0], detail=False)) == [".lock"]
    # A lock object nobody renewed (a build that died elsewhere), or one of a dead process on this
    # machine, is taken over; the build's own lock object is gone once it finishes.
    for stale in ({"host": "elsewhere", "pid": 7, "time": time.time() - 3600},
                  {"host": socket.gethostname(), "pid": _dead_pid(), "time": time.time()}):
        fs.pipe(lock, json.dumps({**stale, "token": "x"}).encode())
        built = build_cache(world["checkpoint"], world["corpus"], url, progress=False, **BUILD_ARGS)
        assert built.key == world["references"]["zarr"].key and not fs.exists(lock)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)
