"""Helpers for the reliability tests: a pre-imported "zygote" that forks jobs to be killed, the CLI
run in-process, a corpus of distinct sentences, and whole-cache comparisons and damage.

Why a zygote: importing torch + transformers takes seconds, and the crash trials start dozens of
builds and training runs. The zygote pays that once, then forks one child per job; each child
starts its own process session (so killpg also takes its DataLoader workers) and runs the job at
once, so a kill offset measures time spent in the job, not in imports.
"""

from __future__ import annotations

import shutil
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

from helpers import small_runs, tiny_prlms

TESTS = Path(__file__).parents[1]


def distinct_sentences(n: int, seed: int = 0) -> list[str]:
    """n different sentences of 1..40 words from the tiny tokenizer's vocabulary (plus one empty line)."""
    words = " ".join(tiny_prlms.SENTENCES).replace(",", "").replace(".", "").split()
    rng = random.Random(seed)
    seen: set[str] = set()
    lines = [""]
    while len(lines) < n:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------ jobs
# Functions the zygote's children run; everything arrives as JSON.


def job_build_cache(checkpoint: str, corpus: str, out: str, result: str, **kwargs) -> None:
    from prlmfuse.cache_features import build_cache

    built = build_cache(checkpoint, corpus, out, **kwargs)
    Path(result).write_text(json.dumps({"reused": built.reused, "key": built.key}))


def job_train(corpus: str, ckpt: str, paths: dict, out: str, run: dict) -> None:
    from prlmfuse.corpora import load_corpus
    from prlmfuse.train_fused import PrLMUse, train_run

    use = PrLMUse(checkpoint=ckpt, layer=-2)
    train_run(small_runs.tiny_run("killed", prlms=[use], **run), load_corpus(corpus),
              [small_runs.caches_for(use, paths)], out, progress=False)


def skip_without_private_mounts(path: Path) -> None:
    """Skip the test unless this user may mount a tmpfs on `path` in a private mount namespace
    (`unshare -Urm`), where the real full-disk and read-only tests run."""
    import pytest

    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {path}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here ({probe.stderr.decode().strip()[:80]})")


def run_cli(args, capsys, monkeypatch) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `prlmfuse ARGS`, run through the real entry point."""
    from prlmfuse import cli

    monkeypatch.setattr(sys, "argv", ["prlmfuse", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(result, *needles: str) -> str:
    """The CLI's contract for bad input: exit 2 and one `error: ...` line holding every needle, no traceback."""
    code, _, err = result
    lines = err.splitlines()
    assert code == 2, err
    # Progress lines the command logged before it failed may come first; the error is one line, the last.
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


_ZYGOTE = r"""
import json, os, sys, traceback
import torch
torch.set_num_threads(1)
from transformers import BertModel, BertTokenizerFast, PreTrainedTokenizerFast  # noqa: F401 - preload
import prlmfuse.cache_features, prlmfuse.prlms, prlmfuse.corpora  # noqa: F401
import prlmfuse.train_fused.trainer  # noqa: F401
from prlmfuse.errors import UserError
sys.path.insert(0, {tests!r})
from helpers import reliability
print(json.dumps({{"ready": os.getpid()}}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["cmd"] == "wait":
        _, status = os.waitpid(msg["pid"], 0)
        print(json.dumps({{"status": os.waitstatus_to_exitcode(status)}}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()  # its own process group: killpg takes its DataLoader workers too
            log = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1); os.dup2(log, 2)
            sys.stdin.close()
            getattr(reliability, msg["fn"])(**msg["kwargs"])
            code = 0
        except UserError as e:
            print(f"error: {{e}}", file=sys.stderr)
            code = 2
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    print(json.dumps({{"pid": pid}}), flush=True)
"""


class Zygote:
    """A Python process with torch, transformers and prlmfuse imported, forking one child per job."""

    def __init__(self, env: dict | None = None):
        script = textwrap.dedent(_ZYGOTE.format(tests=str(TESTS)))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        assert "ready" in self._read(), "zygote failed to start"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"zygote exited with {self.proc.wait()}")
        return json.loads(line)

    def start(self, fn: str, log: Path, **kwargs) -> int:
        """Fork a child running reliability.<fn>(**kwargs), stdout and stderr appended to `log`; its pid."""
        self.proc.stdin.write(json.dumps({"cmd": "start", "fn": fn, "log": str(log), "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()["pid"]

    def wait(self, pid: int) -> int:
        """Exit status of a child: 0, 2 for a UserError, 1 for any other exception, -9 when killed."""
        self.proc.stdin.write(json.dumps({"cmd": "wait", "pid": pid}) + "\n")
        self.proc.stdin.flush()
        return self._read()["status"]

    def run(self, fn: str, log: Path, **kwargs) -> tuple[int, float]:
        """Run a job to its end: (exit status, seconds)."""
        started = time.perf_counter()
        pid = self.start(fn, log, **kwargs)
        status = self.wait(pid)
        return status, time.perf_counter() - started

    def run_and_kill(self, fn: str, log: Path, after: float, **kwargs) -> int:
        """Start a job and SIGKILL its whole process group `after` seconds later (if still running)."""
        pid = self.start(fn, log, **kwargs)
        time.sleep(after)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # already finished (or not yet in its own group)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.wait(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


_HOLD_LOCK = r"""
import fcntl, os, sys, time
with open(sys.argv[1], "a+") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    f.seek(0); f.truncate(); f.write(f"{os.getpid()} {sys.argv[2]}".strip()); f.flush()
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def hold_lock(lock_path: Path, purpose: str, seconds: float) -> subprocess.Popen:
    """Another process holding `lock_path` as prlmfuse's locks do (pid and purpose inside) for `seconds`."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock_path), purpose, str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ------------------------------------------------------------------------------------------ caches


def temp_leftovers(directory: Path) -> list[str]:
    """Names of temp files/dirs (anything hidden except the lock file) anywhere under `directory`."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".*") if p.name != ".lock")


def assert_same_cache(path: Path, reference: Path) -> None:
    """Same manifest shards (names, counts, sha256), every sentence exactly once, equal features."""
    from prlmfuse.cache_features import CacheReader, verify_cache
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shard_handle import ShardHandle

    verify_cache(path)
    a, b = CacheReader(path), CacheReader(reference)
    assert a.key == b.key
    assert a.manifest["shards"] == b.manifest["shards"]
    location = Location(path)
    ids = []
    for shard in a.manifest["shards"]:
        handle = ShardHandle(location, a.backend, f"shards/{shard['name']}")
        ids.append(handle.read("sentence_ids"))
        handle.close()
    ids = np.concatenate(ids)
    assert len(ids) == a.num_sentences and np.array_equal(np.sort(ids), np.arange(a.num_sentences))  # none lost or doubled
    assert np.array_equal(a.lengths, b.lengths)
    for i in range(len(b)):
        assert torch.equal(a.features(i), b.features(i)), i
        assert torch.equal(a.pooled(i), b.pooled(i)), i
    a.close()
    b.close()
    assert temp_leftovers(path) == []


def _read_shard_array(cache: Path, manifest: dict, shard: str, array: str) -> np.ndarray:
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shard_handle import ShardHandle

    handle = ShardHandle(Location(cache), manifest["backend"], f"shards/{shard}")
    try:
        return handle.read(array, 0, handle.shape(array)[0])
    finally:
        handle.close()


def damage_cache(kind: str, cache: Path) -> str:
    """Damage a built cache one way; returns what `cache verify` must say about it."""
    manifest = json.loads((cache / "manifest.json").read_text())
    shard = manifest["shards"][0]["name"]
    if kind == "flipped byte":
        # A byte of the first token's features of the first stored layer (zarr: its first chunk
        # file; hdf5: the contiguous dataset's first bytes in the .h5 file), never metadata or padding.
        array = f"layer_{manifest['layers'][0]:03d}"
        if manifest["backend"] == "hdf5":
            import h5py

            target = cache / "shards" / shard
            with h5py.File(target, "r") as f:
                offset = f[array].id.get_offset() + 10
        else:
            target = next(p for p in sorted((cache / "shards" / shard / array).rglob("*"))
                          if p.is_file() and p.name != "zarr.json")
            offset = 10
        before = _read_shard_array(cache, manifest, shard, array)
        assert before.nbytes > 10, before.shape
        with open(target, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ 0x40]))
        # the reader sees a changed feature value, so only the checksum can tell
        assert _read_shard_array(cache, manifest, shard, array).tobytes() != before.tobytes()
        return f"shard {shard} fails its sha256 check"
    if kind == "missing shard":
        path = cache / "shards" / shard
        if path.is_dir():  # zarr: a directory; hdf5: one .h5 file
            shutil.rmtree(path)
        else:
            path.unlink()
        return f"shard {shard} is missing"
    (cache / "manifest.json").write_text((cache / "manifest.json").read_text()[:150])
    return "truncated or corrupt"
