"""build_cache: run one frozen checkpoint once over a corpus file and store its hidden states.

Life of a build (directory layout in manifest.py):
  1. check inputs, hash corpus and checkpoint -> key; a complete cache with this key is reused as is
  2. lock the directory, record build.json (key + plan parameters)
  3. tokenize, middle-cut, plan batches by token budget, group batches into shards
  4. for every shard not yet recorded complete (this rank's share under torchrun): forward each batch
     and hand its features to the background writer (background_writer.py), whose encoder threads
     encode them and whose writer threads append the rows to the shard under a temp name, rename it on
     completion and then record progress/<shard>.json with its checksum
  5. once every shard has a progress record, write manifest.json (rank 0, after a barrier)
A killed build resumes at step 4 with the shards it had finished, so the result is byte-identical
to an uninterrupted run: shard bounds are a function of the plan only.

Lock policy (build_directory.directory_lock): a second build of the same local directory or file://
URL waits for the first (with a message) and then, seeing the finished cache, reuses it; it gives up
when the first finishes no shard for `lock_timeout` seconds. Other URLs (object stores have no flock)
hold a renewed lock object, and a second build is refused while it is live.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from prlmfuse.distributed import DistContext, all_reduce_max, destroy, init_distributed, join_group
from prlmfuse.errors import UserError
from prlmfuse.precision import Runtime, dtype_of, machine_line, resolve_runtime
from prlmfuse.fileio import disk_full_error, is_disk_full, read_lines, sha256_file

from .extract import (
    EncodedCorpus,
    FeatureExtractor,
    LayerSelection,
    ShardPlan,
    collate,
    encode_corpus,
    pad_token_id,
    parse_layers,
    plan_batches,
    plan_shards,
)
from .background_writer import BackgroundWriter, HostBatch
from .build_directory import LOCK_WAIT_TIMEOUT, completed_records, directory_lock, prepare_directory
from .codecs import check_dtype, pooled_storage_dtype, side_arrays, token_bytes_per_row, token_numpy_dtype
from .location import Location
from .compat import precision_of, stored_fields
from .manifest import MANIFEST, cache_key, check_shard_name, key_hash, read_json_at, write_json_at
from .shards import ArraySpec, check_backend, shard_suffix

if TYPE_CHECKING:
    from prlmfuse.prlms import CheckpointInfo

logger = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 64 << 20
# Token budget per forward when none is given: the CPU's keeps batches cache-friendly; the GPU's
# keeps a 16 GB card busy with a base-size PrLM's activations of every computed layer in memory.
DEFAULT_MAX_TOKENS = {"cpu": 8192, "cuda": 65536}


def default_max_tokens(device: torch.device | str) -> int:
    return DEFAULT_MAX_TOKENS[torch.device(device).type]


@dataclass(frozen=True)
class CacheResult:
    path: str
    key: str
    reused: bool
    manifest: dict


@dataclass(frozen=True)
class BuildSpec:
    """What one cache build stores and how, resolved once by build_cache from its arguments."""

    location: Location  # the cache directory or URL being built
    info: CheckpointInfo  # the resolved checkpoint whose hidden states are stored
    selection: LayerSelection
    fields: dict  # the cache key's fields, recorded in build.json and the manifest
    key: str  # key_hash(fields): names this cache's content
    backend: str  # shard file format: zarr | hdf5
    dtype: str  # storage dtype of the token features
    max_tokens: int  # token budget per forward pass
    shard_bytes: int  # target size of one shard's token features
    runtime: Runtime  # device and autocast precision of the forward passes
    force: bool  # rebuild even when a complete cache with this key is already there
    progress: bool  # show a progress bar
    lock_timeout: float  # seconds without a finished shard before waiting on another build gives up

    @property
    def plan_params(self) -> dict:
        """The settings that fix shard bounds, kept in build.json: a resume under other ones starts over."""
        return {"max_tokens": int(self.max_tokens), "shard_bytes": int(self.shard_bytes)}


class _HostCopies:
    """Each batch's features as a HostBatch for the writer, taken without waiting for the device.

    On the CPU the model's output goes as it is, with the indices of its real tokens (computed from the
    host's mask). On CUDA the real-token rows are packed on the GPU by those indices (no boolean mask, so
    no device sync) and copied into pinned host memory without blocking; the encoder waits on the copy's
    event. torch's caching host allocator reuses the pinned blocks once their copies have completed.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def __call__(self, token_states: torch.Tensor, pooled: torch.Tensor, attention_mask: torch.Tensor) -> HostBatch:
        real_rows = attention_mask.reshape(-1).cpu().nonzero().squeeze(1)
        if not self.cuda:
            return HostBatch(token_states, pooled, real_rows)
        # from page-locked memory, so the copy is queued behind the forward instead of waiting for it
        index = real_rows.pin_memory().to(self.device, non_blocking=True)
        packed = token_states.flatten(1, 2).index_select(1, index)  # [n_layers, n_real_tokens, d], sentence-major
        host_states = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host_pooled = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
        host_states.copy_(packed, non_blocking=True)
        host_pooled.copy_(pooled, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the copies' stream, whichever GPU is current
        return HostBatch(host_states, host_pooled, ready=done.synchronize)


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
        for name, (row, side_dtype) in side_arrays(dtype, d).items():
            specs[f"{name}_{layer:03d}"] = ArraySpec((n_tokens, *row), side_dtype)
    first_rows = {"sentence_ids": sentence_ids.astype(np.int64), "offsets": offsets}
    meta = {"num_sentences": len(sentence_ids), "num_tokens": n_tokens}
    return specs, first_rows, meta


def build_cache(
    checkpoint: str,
    corpus_file,
    out,
    *,
    layers="-2",
    backend: str = "zarr",
    dtype: str = "float16",
    max_tokens: int | None = None,
    force: bool = False,
    device: str = "auto",
    precision: str | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    lock_timeout: float = LOCK_WAIT_TIMEOUT,
) -> CacheResult:
    """Run `checkpoint` once over `corpus_file` and store its hidden states in `out` (dir or fsspec URL).

    layers: '-2' (default, penultimate), '-2,-3', 'all', or a list of hidden_states indices.
    max_tokens: token budget per forward; None is 8192 on the CPU, 65536 on a GPU (DEFAULT_MAX_TOKENS).
    device: auto | cpu | cuda | cuda:N; under torchrun `cuda` is each rank's LOCAL_RANK GPU.
    precision: bf16 | fp16 | fp32 autocast; None (or auto) takes the precision of a cache already in
    `out` that matches in all else, else the device's fast one (prlmfuse.precision.compute_dtype).
    shard_bytes: target size of one shard's token features (a bound on memory is one batch, not this).
    lock_timeout: a build waiting for another build of `out` gives up once that one has finished no
    shard for this many seconds.
    Under torchrun each rank builds its share of the shards; rank 0 writes the manifest.
    """
    check_dtype(dtype)
    check_backend(backend)
    explicit = precision is not None and precision != "auto"
    runtime = resolve_runtime(device, precision if explicit else "auto")
    if max_tokens is None:
        max_tokens = default_max_tokens(runtime.device)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    location = Location(out)
    if not location.url and (location.path.exists() or location.path.is_symlink()) and not location.path.is_dir():
        raise UserError(f"output {out} is a file, not a directory; a cache is a directory: choose a new or empty one")
    if backend == "hdf5" and location.url:
        raise UserError(f"the hdf5 backend needs a local directory, got {out}; use --backend zarr for URLs")
    lines = read_lines(corpus_file)
    if not lines:
        raise UserError(f"corpus file {corpus_file} is empty; give a file with at least one line")

    from prlmfuse.prlms import resolve_checkpoint

    info = resolve_checkpoint(checkpoint, trust_remote_code=trust_remote_code)
    selection = parse_layers(layers, info.num_layers)
    fields = cache_key(info, sha256_file(corpus_file), selection, dtype, precision=runtime.precision)
    if not force:
        stored = stored_fields(location, fields, adopt_precision=not explicit)
        if stored is not None:
            fields = stored
            runtime = Runtime(runtime.device, dtype_of(precision_of(stored)))
    spec = BuildSpec(
        location=location, info=info, selection=selection, fields=fields, key=key_hash(fields), backend=backend,
        dtype=dtype, max_tokens=max_tokens, shard_bytes=shard_bytes, runtime=runtime, force=force,
        progress=progress, lock_timeout=lock_timeout,
    )

    created_group = join_group(runtime.device)
    dist = init_distributed(runtime.device)
    if dist.is_main:
        logger.info("cache: %s -> %s (%s)", checkpoint, out, runtime.describe())
    try:
        return _locked_build(spec, lines, dist)
    except OSError as e:
        # anything not already named (the lock file, a directory): still one actionable line
        if is_disk_full(e):
            raise disk_full_error("the cache", location) from None
        raise
    finally:
        if created_group:
            destroy(dist)


def _locked_build(spec: BuildSpec, lines: list[str], dist: DistContext) -> CacheResult:
    """Reuse, resume or build `spec.location`: rank 0 decides under the lock; the other ranks follow its verdict."""
    location, key = spec.location, spec.key
    with directory_lock(location, enabled=dist.is_main, wait_timeout=spec.lock_timeout):
        verdict, error = 0, None  # 0 build, 1 reuse, 2 failed
        manifest = None
        if dist.is_main:
            try:
                manifest = prepare_directory(location, key, spec.fields, spec.backend, spec.plan_params, spec.force)
                verdict = 1 if manifest is not None else 0
            except BaseException as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
                verdict, error = 2, e
        verdict = all_reduce_max(dist, verdict)
        if verdict == 2:
            raise error if error is not None else UserError(f"cache build of {location} failed on rank 0")
        if verdict == 1:
            if manifest is None:
                manifest = read_json_at(location, MANIFEST, "cache manifest")
            logger.info("cached: %s already holds this cache (key %s), nothing to do", location, key[:12])
            return CacheResult(str(location), key, True, manifest)
        if list(spec.fields["pooled_layers"]) != list(spec.selection.pooled_layers):
            # Fields taken from a cache that keeps more layers' pooled vectors serve its reuse, never a build.
            raise UserError(f"output directory {location} holds a different cache (key {key[:12]}); use --force "
                            "to replace it or choose another --out")
        manifest = _build(spec, lines, dist)
        return CacheResult(str(location), key, False, manifest)


def _build(spec: BuildSpec, lines: list[str], dist: DistContext) -> dict:
    from prlmfuse.prlms import load_prlm

    location, key, info, selection = spec.location, spec.key, spec.info, spec.selection
    dtype, runtime = spec.dtype, spec.runtime
    build_started = time.perf_counter()
    model, tokenizer = load_prlm(info)
    corpus = encode_corpus(tokenizer, lines, max_length=info.max_length)
    del lines
    lengths = corpus.lengths
    d = info.hidden_size
    batches = plan_batches(lengths, spec.max_tokens)
    row_bytes = token_bytes_per_row(dtype, d) * len(selection.token_layers)
    shards = plan_shards(batches, lengths, row_bytes, spec.shard_bytes)
    suffix = shard_suffix(spec.backend)
    names = {plan.index: f"{plan.name_stem}{suffix}" for plan in shards}
    for name in names.values():
        check_shard_name(name, "plan")

    done = completed_records(location, key, names)
    mine = [plan for plan in shards if plan.index % dist.world_size == dist.rank]
    todo = [plan for plan in mine if plan.index not in done]
    if done and dist.is_main:
        logger.info("resuming %s: %d of %d shards already complete", location, len(done), len(shards))

    extractor = FeatureExtractor(model, selection, runtime=runtime)
    on_gpu = runtime.device.type == "cuda"
    pad_id = pad_token_id(tokenizer)
    total_sentences = sum(len(p.sentence_ids) for p in mine)
    initial = total_sentences - sum(len(p.sentence_ids) for p in todo)

    def forward(batch: np.ndarray):
        input_ids, attention_mask = collate(corpus, batch, pad_id)
        if on_gpu:  # page-locked, so the extractor's copy to the GPU does not block
            input_ids, attention_mask = input_ids.pin_memory(), attention_mask.pin_memory()
        token_states, pooled = extractor(input_ids, attention_mask)
        return token_states, pooled, attention_mask

    failed = 0
    error: BaseException | None = None
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_sentences, initial=initial, unit="sent", disable=not spec.progress,
                   desc=f"cache{'' if not dist.enabled else f' rank {dist.rank}'}", dynamic_ncols=True)
        started, tokens_done = time.perf_counter(), 0

        def on_batch(batch: np.ndarray, tokens: int) -> None:
            nonlocal tokens_done
            tokens_done += tokens
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens_done / max(time.perf_counter() - started, 1e-9):,.0f}", refresh=False)

        with bar:
            write_shards(spec, corpus, todo, names, forward, on_batch)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective below
        failed, error = 1, e

    if all_reduce_max(dist, failed):
        raise error if error is not None else UserError(f"cache build of {location} failed on another rank")

    manifest = None
    if dist.is_main:
        try:
            seconds = time.perf_counter() - build_started
            build = {"seconds": round(seconds, 1), "resumed_shards": len(done), "machine": machine_line(runtime.device),
                     "precision": runtime.precision, "max_tokens": spec.max_tokens, "world_size": dist.world_size}
            manifest = write_manifest(spec, corpus, names, shards, build)
            # a resumed build already said how many shards it found done
            logger.info("cache: built %s in %.1f s (%s tokens/s)", location, seconds,
                        f"{manifest['num_tokens'] / max(seconds, 1e-9):,.0f}")
        except BaseException as e:  # noqa: BLE001
            failed, error = 1, e
    if all_reduce_max(dist, failed):
        raise error if error is not None else UserError(f"writing the manifest of {location} failed on rank 0")
    if manifest is None:
        manifest = read_json_at(location, MANIFEST, "cache manifest")
    return manifest


def write_shards(spec: BuildSpec, corpus: EncodedCorpus, todo: list[ShardPlan], names: dict[int, str],
                 forward: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 on_batch: Callable[[np.ndarray, int], None] | None = None) -> None:
    """The storage path of a build: every shard of `todo` from its batches' features, committed in turn.

    forward(sentence_ids) -> (token_states [n_layers, B, T, d], pooled, attention_mask [B, T]) of one
    batch of the plan. Encoding, checksums and writes run on the background writer's threads while
    `forward` computes the next batch; on_batch(sentence_ids, real_tokens) follows each batch.
    """
    layers = spec.selection.token_layers
    n_pooled = len(spec.selection.pooled_layers)
    writer = BackgroundWriter(spec.location, spec.backend, spec.key, layers, spec.dtype)
    to_host = _HostCopies(spec.runtime.device)
    try:
        for plan in todo:
            specs, first_rows, meta = _shard_specs(plan, corpus, layers, n_pooled, spec.info.hidden_size, spec.dtype)
            writer.open(names[plan.index], specs, first_rows, meta)
            for batch in plan.batches:
                token_states, pooled, attention_mask = forward(batch)
                writer.append(lambda: to_host(token_states, pooled, attention_mask))  # noqa: B023 - called at once
                del token_states, pooled  # the next forward need not keep this batch's device memory
                if on_batch is not None:
                    on_batch(batch, int(attention_mask.sum()))
            writer.commit()
    except BaseException as e:
        from_writer = writer.raised(e)  # else the model thread's own error, the one to report
        with contextlib.suppress(BaseException):
            writer.close()
        if from_writer and writer.error is not e:
            raise writer.error  # every writer has stopped: an earlier shard's error than the one first seen
        raise
    writer.close()


def write_manifest(spec: BuildSpec, corpus: EncodedCorpus, names: dict[int, str], shards: list[ShardPlan],
                   build: dict | None = None) -> dict:
    """manifest.json once every shard of the plan has its progress record: the cache becomes complete.

    build: how this cache was built (wall seconds from model load to the last shard, machine, precision):
    kept for the reader, never part of the key.
    """
    location, dtype, selection = spec.location, spec.dtype, spec.selection
    records = completed_records(location, spec.key, names)
    missing = [names[p.index] for p in shards if p.index not in records]
    if missing:
        raise RuntimeError(f"cache {location}: shards {missing[:5]} were not completed by any rank")
    shard_entries = [  # a record written before layouts were recorded has none: layout 1
        {k: records[p.index][k] for k in ("name", "num_sentences", "num_tokens", "sha256", "layout") if k in records[p.index]}
        for p in shards
    ]
    manifest = {
        "key": spec.key,
        "key_fields": spec.fields,
        "num_sentences": corpus.num_sentences,
        "num_tokens": int(corpus.offsets[-1]),
        "layers": list(selection.token_layers),
        "pooled_layers": list(selection.pooled_layers),
        "hidden_size": int(spec.info.hidden_size),
        "dtype": dtype,
        "pooled_dtype": pooled_storage_dtype(dtype),
        "backend": spec.backend,
        "shards": shard_entries,
        "truncated_sentences": corpus.truncated_sentences,
        "truncated_tokens": corpus.truncated_tokens,
        "max_length": spec.fields["truncation"]["max_length"],
        "complete": True,
    }
    if build is not None:
        manifest["build"] = build
    try:
        write_json_at(location, MANIFEST, manifest)
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(MANIFEST, location) from None
        raise
    return manifest
