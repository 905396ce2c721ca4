"""build_cache: run one frozen checkpoint once over a corpus file and store its hidden states.

Life of a build (directory layout in manifest.py):
  1. check inputs, hash corpus and checkpoint -> key; a complete cache with this key is reused as is
  2. lock the directory (local paths), record build.json (key + plan parameters)
  3. tokenize, middle-cut, plan batches by token budget, group batches into shards
  4. for every shard not yet recorded complete (this rank's share under torchrun): forward each batch,
     hand the rows to a background writer thread that appends them to the shard under a temp name,
     renames it on completion and then records progress/<shard>.json with its checksum
  5. once every shard has a progress record, write manifest.json (rank 0, after a barrier)
A killed build resumes at step 4 with the shards it had finished, so the result is byte-identical
to an uninterrupted run: shard bounds are a function of the plan only.

Lock policy: a second build of the same local directory waits for the first (with a message) and
then, seeing the finished cache, reuses it. URLs are not locked (object stores have no flock).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from prlmfuse.distributed import DistContext, all_reduce_max, destroy, init_distributed, join_group
from prlmfuse.errors import UserError
from prlmfuse.precision import cpu_has_fast_bf16
from prlmfuse.fileio import pid_lock, is_disk_full, read_lines, sha256_file
from prlmfuse.runtime import keep_freed_memory

from .extract import (
    EncodedCorpus,
    FeatureExtractor,
    ShardPlan,
    collate,
    encode_corpus,
    pad_token_id,
    parse_layers,
    plan_batches,
    plan_shards,
)
from .manifest import (
    BUILD_RECORD,
    MANIFEST,
    PROGRESS_DIR,
    SHARD_DIR,
    cache_key,
    check_shard_name,
    key_hash,
    read_json_at,
    write_json_at,
)
from .storage import (
    ArraySpec,
    Location,
    check_backend,
    check_dtype,
    create_shard,
    encode,
    pooled_storage_dtype,
    shard_suffix,
    token_bytes_per_row,
    token_numpy_dtype,
)

DEFAULT_SHARD_BYTES = 64 << 20
_WRITER_QUEUE_BATCHES = 4  # bounded: at most this many encoded batches wait for the disk
_OUR_NAMES = {MANIFEST, BUILD_RECORD, SHARD_DIR, PROGRESS_DIR, ".lock"}
# Temp names of fileio.atomic_path (".<final name>.<random>.tmp") and of the shard writers
# (".<shard>.tmp-<pid>"): what a kill -9 mid-write leaves behind. Never trusted, removed on resume.
_STALE_TEMP = {
    "": re.compile(r"^\.(manifest|build)\.json\..+\.tmp$"),
    PROGRESS_DIR: re.compile(r"^\.shard-\d{5}\.(zarr|h5)\.json\..+\.tmp$"),
    SHARD_DIR: re.compile(r"^\.shard-\d{5}\.(zarr|h5)\.tmp-\d+$"),
}


@dataclass(frozen=True)
class CacheResult:
    path: str
    key: str
    reused: bool
    manifest: dict


def _say(message: str, enabled: bool) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _disk_full_error(what: str, location) -> UserError:
    return UserError(f"disk full while writing {what} in {location}; free space and rerun to resume")


# ----------------------------------------------------------------------------- distributed


# ----------------------------------------------------------------------------- lock


@contextlib.contextmanager
def _directory_lock(location: Location, enabled: bool, verbose: bool):
    """A second build of the same local directory waits for the first (then finds its cache)."""
    if not enabled or location.url:
        yield
        return
    lock_path = location.path / ".lock"
    with pid_lock(lock_path, when_held=lambda pid: _say(f"waiting: another build (pid {pid}) holds {lock_path}", True)):
        yield


# ----------------------------------------------------------------------------- writer thread


class _BackgroundWriter:
    """Owns the open shard; the model thread only enqueues encoded rows (bounded queue).

    After a shard is renamed into place, its progress record is written: only then does the
    shard count as complete (the rule that also makes fsspec URLs, which cannot rename, safe).
    """

    def __init__(self, location: Location, backend: str, key: str):
        self.location, self.backend, self.key = location, backend, key
        self.queue: queue.Queue = queue.Queue(maxsize=_WRITER_QUEUE_BATCHES)
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
                self.error = _disk_full_error(f"shard {name}", self.location) if is_disk_full(e) else e
                if writer is not None:
                    writer.abort()
                    writer = None
        if writer is not None:
            writer.abort()


# ----------------------------------------------------------------------------- state on disk


def _completed_records(location: Location, key: str, names: dict[int, str]) -> dict[int, dict]:
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


def _prepare_directory(location: Location, key: str, fields: dict, backend: str, plan_params: dict,
                       force: bool, verbose: bool) -> dict | None:
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
            _say(f"{location}: replacing what is there (--force)", verbose)
        _clear_build_state(location)
    else:
        found = None  # (key, backend) of what the directory holds
        if MANIFEST in entries:
            try:
                manifest = read_json_at(location, MANIFEST, "cache manifest")
                if manifest.get("key") == key and manifest.get("backend") == backend and manifest.get("complete") is True:
                    return manifest
                found = (manifest.get("key"), manifest.get("backend"))
            except UserError:
                pass  # a torn manifest is rewritten at the end of the resumed build, if build.json agrees
        if found is None and BUILD_RECORD in entries:
            record = read_json_at(location, BUILD_RECORD, "build record")
            found = (record.get("key"), record.get("backend"))
            if found == (key, backend) and record.get("plan") != plan_params:
                _say(f"{location}: the interrupted build used another plan {record.get('plan')}; starting over",
                     verbose)
                _clear_build_state(location)
        elif found is None and entries & {SHARD_DIR, PROGRESS_DIR}:
            found = ("unknown", "unknown")
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
            raise _disk_full_error(BUILD_RECORD, location) from None
        raise
    return None


# ----------------------------------------------------------------------------- build


def _shard_specs(plan: ShardPlan, corpus: EncodedCorpus, layers: tuple[int, ...], n_pooled: int,
                 d: int, dtype: str) -> tuple[dict[str, ArraySpec], dict[str, np.ndarray], dict]:
    sentence_ids = plan.sentence_ids
    lengths = corpus.lengths[sentence_ids]
    offsets = np.zeros(len(sentence_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_tokens = int(offsets[-1])
    specs = {
        "sentence_ids": ArraySpec((len(sentence_ids),), np.dtype(np.int64)),
        "offsets": ArraySpec((len(sentence_ids) + 1,), np.dtype(np.int64)),
        "pooled": ArraySpec((len(sentence_ids), n_pooled, 2, d), token_numpy_dtype(pooled_storage_dtype(dtype))),
    }
    for layer in layers:
        specs[f"layer_{layer:03d}"] = ArraySpec((n_tokens, d), token_numpy_dtype(dtype))
        if dtype == "int8":
            specs[f"scale_{layer:03d}"] = ArraySpec((n_tokens,), np.dtype(np.float32))
    first_rows = {"sentence_ids": sentence_ids.astype(np.int64), "offsets": offsets}
    meta = {"num_sentences": len(sentence_ids), "num_tokens": n_tokens}
    return specs, first_rows, meta


def encode_batch(token_states: torch.Tensor, pooled: torch.Tensor, attention_mask: torch.Tensor,
                 layers: tuple[int, ...], dtype: str) -> dict[str, np.ndarray]:
    """Model output of one batch -> the rows each shard array receives (padding dropped)."""
    real = attention_mask.bool()
    rows: dict[str, np.ndarray] = {}
    for i, layer in enumerate(layers):
        values, scales = encode(token_states[i][real], dtype)  # [n_real_tokens, d], sentence-major
        rows[f"layer_{layer:03d}"] = values
        if scales is not None:
            rows[f"scale_{layer:03d}"] = scales
    rows["pooled"] = encode(pooled, pooled_storage_dtype(dtype))[0]
    return rows


def build_cache(
    checkpoint: str,
    corpus_file,
    out,
    *,
    layers="-2",
    backend: str = "zarr",
    dtype: str = "float16",
    max_tokens: int = 8192,
    force: bool = False,
    autocast: bool | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> CacheResult:
    """Run `checkpoint` once over `corpus_file` and store its hidden states in `out` (dir or fsspec URL).

    layers: '-2' (default, penultimate), '-2,-3', 'all', or a list of hidden_states indices.
    autocast: None = bf16 autocast where the CPU has fast bf16 (AMX / AVX512-BF16), else fp32.
    shard_bytes: target size of one shard's token features (a bound on memory is one batch, not this).
    Under torchrun each rank builds its share of the shards; rank 0 writes the manifest.
    """
    check_dtype(dtype)
    check_backend(backend)
    keep_freed_memory()
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    location = Location(out)
    if backend == "hdf5" and location.url:
        raise UserError(f"the hdf5 backend needs a local directory, got {out}; use --backend zarr for URLs")
    lines = read_lines(corpus_file)
    if not lines:
        raise UserError(f"corpus file {corpus_file} is empty; give a file with at least one line")

    from prlmfuse.prlms import load_prlm, resolve_checkpoint

    info = resolve_checkpoint(checkpoint, trust_remote_code=trust_remote_code)
    selection = parse_layers(layers, info.num_layers)
    if autocast is None:
        autocast = cpu_has_fast_bf16()
    fields = cache_key(info, sha256_file(corpus_file), selection, dtype, autocast=autocast)
    key = key_hash(fields)
    plan_params = {"max_tokens": int(max_tokens), "shard_bytes": int(shard_bytes)}

    created_group = join_group()
    dist = init_distributed()
    try:
        return _locked_build(info, load_prlm, lines, location, out, selection, fields, key, plan_params, backend,
                             dtype, max_tokens, shard_bytes, autocast, force, progress, dist)
    except OSError as e:
        # anything not already named (the lock file, a directory): still one actionable line
        if is_disk_full(e):
            raise _disk_full_error("the cache", location) from None
        raise
    finally:
        if created_group:
            destroy(dist)


def _locked_build(info, load_prlm, lines, location, out, selection, fields, key, plan_params, backend, dtype,
                  max_tokens, shard_bytes, autocast, force, progress, dist: DistContext) -> CacheResult:
    """Reuse, resume or build `location`: rank 0 decides under the lock; the other ranks follow its verdict."""
    with _directory_lock(location, enabled=dist.is_main, verbose=progress):
        verdict, error = 0, None  # 0 build, 1 reuse, 2 failed
        manifest = None
        if dist.is_main:
            try:
                manifest = _prepare_directory(location, key, fields, backend, plan_params, force, progress)
                verdict = 1 if manifest is not None else 0
            except BaseException as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
                verdict, error = 2, e
        verdict = all_reduce_max(dist, verdict)
        if verdict == 2:
            raise error if error is not None else UserError(f"cache build of {out} failed on rank 0")
        if verdict == 1:
            if manifest is None:
                manifest = read_json_at(location, MANIFEST, "cache manifest")
            _say(f"cached: {out} already holds this cache (key {key[:12]}), nothing to do", progress)
            return CacheResult(str(out), key, True, manifest)
        manifest = _build(info, load_prlm, lines, location, selection, fields, key, backend, dtype,
                          max_tokens, shard_bytes, autocast, progress, dist)
        return CacheResult(str(out), key, False, manifest)


def _build(info, load_prlm, lines, location, selection, fields, key, backend, dtype, max_tokens, shard_bytes,
           autocast, progress, dist: DistContext) -> dict:
    model, tokenizer = load_prlm(info)
    corpus = encode_corpus(tokenizer, lines, max_length=info.max_length)
    del lines
    lengths = corpus.lengths
    d = info.hidden_size
    batches = plan_batches(lengths, max_tokens)
    row_bytes = token_bytes_per_row(dtype, d) * len(selection.token_layers)
    shards = plan_shards(batches, lengths, row_bytes, shard_bytes)
    suffix = shard_suffix(backend)
    names = {plan.index: f"{plan.name_stem}{suffix}" for plan in shards}
    for name in names.values():
        check_shard_name(name, "plan")

    done = _completed_records(location, key, names)
    mine = [plan for plan in shards if plan.index % dist.world_size == dist.rank]
    todo = [plan for plan in mine if plan.index not in done]
    if done and dist.is_main:
        _say(f"resuming {location}: {len(done)} of {len(shards)} shards already complete", progress)

    extractor = FeatureExtractor(model, selection, autocast=autocast)
    pad_id = pad_token_id(tokenizer)
    layers = selection.token_layers
    n_pooled = len(selection.pooled_layers)
    total_sentences = sum(len(p.sentence_ids) for p in mine)
    initial = total_sentences - sum(len(p.sentence_ids) for p in todo)

    failed = 0
    error: BaseException | None = None
    writer = _BackgroundWriter(location, backend, key)
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_sentences, initial=initial, unit="sent", disable=not progress,
                   desc=f"cache{'' if not dist.enabled else f' rank {dist.rank}'}", dynamic_ncols=True)
        started, tokens_done = time.perf_counter(), 0
        with bar:
            for plan in todo:
                specs, first_rows, meta = _shard_specs(plan, corpus, layers, n_pooled, d, dtype)
                writer.open(names[plan.index], specs, first_rows, meta)
                for batch in plan.batches:
                    input_ids, attention_mask = collate(corpus, batch, pad_id)
                    token_states, pooled = extractor(input_ids, attention_mask)
                    writer.append(encode_batch(token_states, pooled, attention_mask, layers, dtype))
                    tokens_done += int(attention_mask.sum())
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{tokens_done / max(time.perf_counter() - started, 1e-9):,.0f}",
                                    refresh=False)
                writer.commit()
        writer.close()
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective below
        failed, error = 1, e
        with contextlib.suppress(BaseException):
            writer.close()

    if all_reduce_max(dist, failed):
        raise error if error is not None else UserError(f"cache build of {location} failed on another rank")

    manifest = None
    if dist.is_main:
        try:
            manifest = _write_manifest(location, key, fields, backend, dtype, selection, d, corpus, names, shards)
        except BaseException as e:  # noqa: BLE001
            failed, error = 1, e
    if all_reduce_max(dist, failed):
        raise error if error is not None else UserError(f"writing the manifest of {location} failed on rank 0")
    if manifest is None:
        manifest = read_json_at(location, MANIFEST, "cache manifest")
    return manifest


def _write_manifest(location, key, fields, backend, dtype, selection, d, corpus: EncodedCorpus, names, shards) -> dict:
    records = _completed_records(location, key, names)
    missing = [names[p.index] for p in shards if p.index not in records]
    if missing:
        raise RuntimeError(f"cache {location}: shards {missing[:5]} were not completed by any rank")
    shard_entries = [
        {k: records[p.index][k] for k in ("name", "num_sentences", "num_tokens", "sha256")} for p in shards
    ]
    manifest = {
        "key": key,
        "key_fields": fields,
        "num_sentences": corpus.num_sentences,
        "num_tokens": int(corpus.offsets[-1]),
        "layers": list(selection.token_layers),
        "pooled_layers": list(selection.pooled_layers),
        "hidden_size": int(d),
        "dtype": dtype,
        "pooled_dtype": pooled_storage_dtype(dtype),
        "backend": backend,
        "shards": shard_entries,
        "truncated_sentences": corpus.truncated_sentences,
        "truncated_tokens": corpus.truncated_tokens,
        "max_length": fields["truncation"]["max_length"],
        "complete": True,
    }
    try:
        write_json_at(location, MANIFEST, manifest)
    except OSError as e:
        if is_disk_full(e):
            raise _disk_full_error(MANIFEST, location) from None
        raise
    return manifest
