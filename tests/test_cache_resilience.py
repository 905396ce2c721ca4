"""Stage one under stress: kill -9 mid-build then resume, and two torchrun-style ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from prlmfuse.cache_features import CacheReader, build_cache, verify_cache

from helpers import tiny_prlms

torch.set_num_threads(1)
BUILD_ARGS = dict(layers="-2,-1", dtype="float16", max_tokens=96, shard_bytes=3000, progress=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resilience")
    checkpoint = tiny_prlms.build_tiny("bert", root / "bert")
    corpus = tiny_prlms.write_corpus(root / "train.src", tiny_prlms.SENTENCES * 8)
    reference = build_cache(str(checkpoint), corpus, root / "reference", **BUILD_ARGS)
    assert len(reference.manifest["shards"]) >= 6
    return root, checkpoint, corpus, reference


def _child(script: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_kill_9_mid_shard_then_resume_is_byte_identical(setup, tmp_path, backend):
    root, checkpoint, corpus, _ = setup
    out = tmp_path / "cache"
    uninterrupted = build_cache(str(checkpoint), corpus, tmp_path / "whole", backend=backend, **BUILD_ARGS)
    # here every shard is one batch with 2 layer arrays: the child SIGKILLs itself between the two layer
    # appends of shard 7, after shards 0..6 were renamed and recorded
    child = _child(f"""
        import os, signal, torch
        torch.set_num_threads(1)
        from prlmfuse.cache_features import build_cache, shards
        calls = {{"n": 0}}
        original = shards.ShardWriter.append
        def append(self, name, rows):
            if name.startswith("layer_"):
                calls["n"] += 1
                if calls["n"] == 7 * 2 + 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(self, name, rows)
        shards.ShardWriter.append = append
        build_cache({str(checkpoint)!r}, {str(corpus)!r}, {str(out)!r}, backend={backend!r}, **{BUILD_ARGS!r})
    """)
    _, err = child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL, err
    assert not (out / "manifest.json").exists()
    # a record being written when the kill came (the other shard writer's) is a temp file, not a record
    recorded = sorted(p.name for p in (out / "progress").iterdir() if not p.name.startswith("."))
    assert 1 <= len(recorded) < len(uninterrupted.manifest["shards"])
    assert any(p.name.startswith(".shard-") for p in (out / "shards").iterdir())  # the torn temp shard

    resumed = build_cache(str(checkpoint), corpus, out, backend=backend, **{**BUILD_ARGS, "progress": True})
    assert not resumed.reused and resumed.key == uninterrupted.key
    assert resumed.manifest["shards"] == uninterrupted.manifest["shards"]  # names, counts and sha256 of bytes
    assert resumed.manifest["build"]["resumed_shards"] == len(recorded)  # its time covers only the shards it built
    assert not any(p.name.startswith(".shard-") for p in (out / "shards").iterdir())
    verify_cache(out)
    a, b = CacheReader(out), CacheReader(tmp_path / "whole")
    for i in range(len(a)):
        assert torch.equal(a.features(i), b.features(i)) and torch.equal(a.pooled(i), b.pooled(i))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_ranks_match_a_single_process_build(setup, tmp_path):
    _, checkpoint, corpus, reference = setup
    out = tmp_path / "dist"
    port = _free_port()
    script = f"""
        import torch
        torch.set_num_threads(1)
        from prlmfuse.cache_features import build_cache
        result = build_cache({str(checkpoint)!r}, {str(corpus)!r}, {str(out)!r}, **{BUILD_ARGS!r})
        print("KEY", result.key, result.reused)
    """
    children = [
        _child(script, {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for rank in range(2)
    ]
    outputs = [child.communicate(timeout=300) for child in children]
    for child, (stdout, stderr) in zip(children, outputs):
        assert child.returncode == 0, stderr
        assert f"KEY {reference.key} False" in stdout
    records = {p.name for p in (out / "progress").iterdir()}
    assert len(records) == len(reference.manifest["shards"])
    manifest = CacheReader(out).manifest
    assert manifest["shards"] == reference.manifest["shards"]
    verify_cache(out)
