"""The cache key, the manifest, and the checks that a cache on disk is what its manifest says.

A cache directory (a local path or an fsspec URL) holds:
  manifest.json              written last: key, key_fields, counts, layers, dtype, backend, shard list (each
                             shard with its backend layout, shards.LAYOUT)
  build.json                 written first: key and plan parameters, so a rerun resumes or refuses
  progress/<shard>.json      one record (name, key, counts, sha256, layout) per finished shard
  shards/shard-NNNNN.zarr|.h5  the features (arrays in shards.py)
  .lock                      one build at a time (an flock; on remote URLs a renewed lock object)
key_fields["format"] is format_version(dtype); a cache of any other format is refused, never converted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

import prlmfuse
from prlmfuse.errors import UserError
from prlmfuse.fileio import StatMemo, sha256_file

from .extract import LayerSelection, parse_layers
from .codecs import STORAGE_DTYPES, check_dtype, pooled_storage_dtype, side_arrays, token_numpy_dtype
from .location import Location
from .shard_handle import ShardHandle
from .shards import BACKENDS, LAYOUT, ShardChecksum

FORMAT_VERSION = 1  # bump when what is stored or the key changes: caches of another format are refused, never read
# (how a backend lays the same arrays on disk has its own number, shards.LAYOUT, and the reader reads every one)
# Storage dtypes with a layout of their own carry its format number in their key (int8 2: each token's
# largest values kept apart), so a change to one dtype's layout never invalidates the others' caches.
DTYPE_FORMAT = {"int8": 2}


def format_version(dtype: str) -> int:
    """The format a cache of this storage dtype is written in, and the only one read for it."""
    return DTYPE_FORMAT.get(dtype, FORMAT_VERSION)


MANIFEST = "manifest.json"
BUILD_RECORD = "build.json"  # written when a build starts: lets a rerun resume or refuse a different key
SHARD_DIR = "shards"
PROGRESS_DIR = "progress"  # one record per complete shard, written after the shard itself
_SHARD_NAME = re.compile(r"^shard-\d{5}\.(zarr|h5)$")
HEAD_FRACTION = "1/4"  # extract.middle_cut keeps max_length // 4 head tokens


def cache_key(checkpoint_info, corpus_file, layers, dtype, *, precision: str = "fp32") -> dict:
    """The fields that decide a cache's content; `key_hash(fields)` is the cache's key.

    `precision` is the autocast precision the features were computed at (bf16, fp16 or fp32): a
    property of the computation, never of the machine, so a cache moves between machines and devices.
    """
    from prlmfuse.precision import check_precision_text

    check_dtype(dtype)
    if check_precision_text(precision) == "auto":
        raise ValueError("cache_key needs the resolved precision (bf16, fp16 or fp32), not 'auto'")
    selection = layers if isinstance(layers, LayerSelection) else parse_layers(layers, checkpoint_info.num_layers)
    corpus_sha = corpus_file if _looks_like_sha(corpus_file) else sha256_file(corpus_file)
    return {
        "format": format_version(dtype),
        "checkpoint": str(checkpoint_info.name),
        "checkpoint_identity": checkpoint_info.identity,
        "family": checkpoint_info.family,
        "num_layers": int(checkpoint_info.num_layers),
        "hidden_size": int(checkpoint_info.hidden_size),
        "layers": list(selection.token_layers),
        "pooled_layers": list(selection.pooled_layers),
        "dtype": dtype,
        "precision": precision,
        "truncation": {"max_length": int(checkpoint_info.max_length), "mode": "middle", "head": HEAD_FRACTION},
        "corpus_sha256": corpus_sha,
        "prlmfuse_version": prlmfuse.__version__,
    }


def _looks_like_sha(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def key_hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_name(index: int, suffix: str) -> str:
    return f"shard-{index:05d}{suffix}"


def check_shard_name(name: str, where: str) -> str:
    """Names come from a JSON file: they must be a plain shard name, never a path out of the cache."""
    if not isinstance(name, str) or not _SHARD_NAME.match(name) or os.path.basename(name) != name:
        raise UserError(f"{where}: invalid shard name {name!r}; the manifest is corrupt or hostile, rebuild the cache")
    return name


def read_json_at(location: Location, name: str, what: str) -> dict:
    try:
        data = location.read_bytes(name)
    except (FileNotFoundError, IsADirectoryError):
        if not location.url and not location.path.exists():
            raise UserError(f"cache directory not found: {location}; check the path, or build the cache first "
                            "(prlmfuse cache build)") from None
        raise UserError(f"{what} not found: {location.full(name)}; build the cache first (prlmfuse cache build)") from None
    except NotADirectoryError:
        raise UserError(f"{location} is a file, not a cache directory; give the directory that holds {MANIFEST}") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {location.full(name)} is truncated or corrupt ({e.msg if hasattr(e, 'msg') else e}); "
                        "rebuild with --force") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {location.full(name)} is not a JSON object; rebuild with --force")
    return obj


def write_json_at(location: Location, name: str, obj: dict) -> None:
    location.write_bytes(name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def load_manifest(path_or_url) -> tuple[Location, dict]:
    """Read and structurally validate manifest.json (complete, shard names safe, counts consistent)."""
    location = path_or_url if isinstance(path_or_url, Location) else Location(path_or_url)
    where = location.full(MANIFEST)
    manifest = read_json_at(location, MANIFEST, "cache manifest")
    fields = manifest.get("key_fields")
    found = fields.get("format") if isinstance(fields, dict) else None
    dtype = fields.get("dtype") if isinstance(fields, dict) else None
    if found != format_version(dtype):
        raise UserError(f"{where}: cache format {found}, this prlmfuse reads format {format_version(dtype)} for "
                        f"{dtype} caches; rebuild the cache with --force")
    required = ("key", "num_sentences", "num_tokens", "layers", "pooled_layers", "hidden_size", "dtype",
                "pooled_dtype", "backend", "shards", "truncated_sentences", "truncated_tokens", "max_length",
                "complete")
    missing = [k for k in required if k not in manifest]
    if missing:
        raise UserError(f"{where}: manifest lacks {', '.join(missing)}; rebuild the cache with --force")
    if manifest["complete"] is not True:
        raise UserError(f"{where}: cache is incomplete; rerun the build to finish it")
    if manifest["dtype"] not in STORAGE_DTYPES or manifest["backend"] not in BACKENDS:
        raise UserError(f"{where}: unknown dtype/backend {manifest['dtype']}/{manifest['backend']}; rebuild the cache")
    if key_hash(manifest["key_fields"]) != manifest["key"]:
        raise UserError(f"{where}: key does not match its key_fields (edited by hand?); rebuild with --force")
    shards = manifest["shards"]
    if not isinstance(shards, list) or not all(isinstance(x, dict) for x in shards):
        raise UserError(f"{where}: 'shards' is not a list of shard records; the manifest is corrupt, rebuild with --force")
    for i, shard in enumerate(shards):
        check_shard_name(shard.get("name"), where)
        bad = [k for k in ("num_sentences", "num_tokens") if not _count(shard.get(k))]
        if not isinstance(shard.get("sha256"), str):
            bad.append("sha256")
        if "layout" in shard and not (_count(shard["layout"]) and shard["layout"] >= 1):
            bad.append("layout")
        if bad:
            raise UserError(f"{where}: shard {i} ({shard['name']}) has no valid {', '.join(bad)}; "
                            "the manifest is corrupt, rebuild with --force")
    newer = [s["name"] for s in shards if s.get("layout", 1) > LAYOUT[manifest["backend"]]]
    if newer:
        raise UserError(f"{where}: shard {newer[0]} is in a {manifest['backend']} layout newer than this prlmfuse reads "
                        f"(layout {LAYOUT[manifest['backend']]}); upgrade prlmfuse")
    for k in ("num_sentences", "num_tokens", "hidden_size"):
        if not _count(manifest[k]):
            raise UserError(f"{where}: {k} is not a count ({manifest[k]!r}); the manifest is corrupt, rebuild with --force")
    for k in ("layers", "pooled_layers"):
        if not isinstance(manifest[k], list) or not all(_count(x) for x in manifest[k]):
            raise UserError(f"{where}: {k} is not a list of layer indices; the manifest is corrupt, rebuild with --force")
    if sum(s["num_sentences"] for s in manifest["shards"]) != manifest["num_sentences"]:
        raise UserError(f"{where}: shard sentence counts do not add up to num_sentences; rebuild with --force")
    return location, manifest


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def expected_arrays(manifest: dict, shard: dict) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Array names, shapes and dtypes a shard must hold (used by verify and the reader)."""
    d = manifest["hidden_size"]
    n, s = shard["num_tokens"], shard["num_sentences"]
    dtype = manifest["dtype"]
    arrays = {
        "sentence_ids": ((s,), np.dtype(np.int64)),
        "offsets": ((s + 1,), np.dtype(np.int64)),
        "pooled": ((s, len(manifest["pooled_layers"]), 2, d), token_numpy_dtype(pooled_storage_dtype(dtype))),
    }
    for layer in manifest["layers"]:
        arrays[f"layer_{layer:03d}"] = ((n, d), token_numpy_dtype(dtype))
        for name, (row, side_dtype) in side_arrays(dtype, d).items():
            arrays[f"{name}_{layer:03d}"] = ((n, *row), side_dtype)
    return arrays


def verify_cache(path) -> tuple[Location, dict]:
    """Re-hash every shard against the manifest; a missing, truncated or altered shard is a UserError naming it.

    Returns (location, manifest) as `load_manifest` read them, the manifest the shards were checked against,
    so that a reader can be opened on them without parsing the path or reading the manifest again."""
    location, manifest = load_manifest(path)
    block_rows = 1 << 16
    for shard in manifest["shards"]:
        name = shard["name"]
        rel = f"{SHARD_DIR}/{name}"
        if not location.exists(rel):
            raise UserError(f"cache {location}: shard {name} is missing; rebuild with --force")
        arrays = expected_arrays(manifest, shard)
        try:
            handle = ShardHandle(location, manifest["backend"], rel, random_access=False)
        except Exception as e:  # noqa: BLE001 - any open failure means the shard file is damaged
            raise UserError(f"cache {location}: shard {name} cannot be opened ({type(e).__name__}: {e}); "
                            "rebuild with --force") from None
        try:
            checksum = ShardChecksum(arrays)
            for array, (shape, dtype) in arrays.items():
                if array not in handle.arrays or handle.shape(array) != tuple(shape) or handle.dtype(array) != dtype:
                    raise UserError(f"cache {location}: shard {name} array {array} is missing or has the wrong "
                                    "shape/dtype; rebuild with --force")
                for start in range(0, max(shape[0], 1), block_rows):
                    checksum.update(array, handle.read(array, start, min(start + block_rows, shape[0])))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - unreadable chunk = damaged shard
            raise UserError(f"cache {location}: shard {name} is unreadable ({type(e).__name__}: {e}); "
                            "rebuild with --force") from None
        finally:
            handle.close()
        if checksum.hexdigest() != shard["sha256"]:
            raise UserError(f"cache {location}: shard {name} fails its sha256 check (corrupt); rebuild with --force")
    return location, manifest


def check_cache(path) -> tuple[Location, dict]:
    """The check every reader runs before it trusts a cache: `verify_cache`, skipped when neither the
    manifest nor any shard file changed (size, mtime) since the cache last passed it on this machine
    (remembered in $PRLMFUSE_HOME). URLs have no cheap stamp, so they are re-hashed every time.

    Returns (location, manifest): the path parsed once and the manifest read once (by `verify_cache`, or by
    `load_manifest` alone when the shards are known unchanged), for `CacheReader(location, manifest=...)`."""
    location = path if isinstance(path, Location) else Location(path)
    stamp = None if location.url else _local_stamp(location.path)
    memo = StatMemo("verified_caches.json")
    key = os.path.realpath(location.path) if stamp else ""
    if stamp and memo.get(key, stamp[0]):
        return load_manifest(location)
    checked = verify_cache(location)
    if stamp:
        memo.put(key, stamp[0], True, newest_mtime=stamp[1])
        memo.save()
    return checked


def _local_stamp(root) -> tuple[str, float] | None:
    """(sha256 over the name, size and mtime of manifest.json and every file under shards/, newest mtime)."""
    files = [root / MANIFEST, *sorted(p for p in (root / SHARD_DIR).rglob("*") if p.is_file())]
    h, newest = hashlib.sha256(), 0.0
    for f in files:
        try:
            st = f.stat()
        except OSError:
            return None  # verify_cache names what is missing
        h.update(f"{f.relative_to(root).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8"))
        newest = max(newest, st.st_mtime)
    return h.hexdigest(), newest


def inspect_cache(path) -> dict:
    """Key, counts and sizes of a complete cache (no re-hashing; see verify_cache)."""
    location, manifest = load_manifest(path)
    shard_bytes = sum(location.size(f"{SHARD_DIR}/{s['name']}") for s in manifest["shards"])
    tokens = max(int(manifest["num_tokens"]), 1)
    n_layers = len(manifest["layers"])
    d = manifest["hidden_size"]
    pooled_dtype = token_numpy_dtype(pooled_storage_dtype(manifest["dtype"]))
    pooled_bytes = int(manifest["num_sentences"]) * len(manifest["pooled_layers"]) * 2 * d * pooled_dtype.itemsize
    info = {
        "path": str(location),
        "key": manifest["key"],
        "key_fields": manifest["key_fields"],
        "backend": manifest["backend"],
        # the on-disk layout of the backend its shards were written in (shards.LAYOUT; none recorded: 1)
        "layout": sorted({s.get("layout", 1) for s in manifest["shards"]}),
        "dtype": manifest["dtype"],
        "layers": manifest["layers"],
        "pooled_layers": manifest["pooled_layers"],
        "hidden_size": d,
        "num_sentences": manifest["num_sentences"],
        "num_tokens": manifest["num_tokens"],
        "num_shards": len(manifest["shards"]),
        "truncated_sentences": manifest["truncated_sentences"],
        "truncated_tokens": manifest["truncated_tokens"],
        "size_on_disk": location.size(),
        "shard_bytes": shard_bytes,
        "pooled_bytes": pooled_bytes,
        # measured on disk: shard bytes except the pooled vectors (token features, int8 scales, ids,
        # offsets, metadata) per token and stored layer -- the number to compare with d
        "bytes_per_token": (shard_bytes - pooled_bytes) / tokens / max(n_layers, 1),
        # everything on disk (pooled vectors, ids, metadata) divided by tokens
        "bytes_per_token_total": location.size() / tokens,
    }
    if "build" in manifest:  # wall time, machine and precision of the build, where the manifest records them
        info["build"] = manifest["build"]
    return info
