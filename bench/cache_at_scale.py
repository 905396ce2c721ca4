"""Training from a cache larger than memory: the loader and the writer against the disk's own rates.

    python bench/cache_at_scale.py --dir DIR [--size-gb N] [--backend zarr|hdf5] [--workers 1,2,4]
                                [--compare] [--loader-only] [--read-window K[,K...]]

1. Lengths: the English Bible's verses tokenized by MiniLM's tokenizer (BERT's uncased WordPiece, the
   vocabulary of BERT-base), tiled in a seeded order up to the cache size. Features are random float32
   of BERT-base's width (768), one layer (-2 of 12), as a GPU forward would hand them over.
2. Writer: raw disk write rate (8 MiB writes, fsync) beside the cache's own storage path
   (cache_features.builder.write_shards: encode, checksum, write in the background writer's threads, fsync,
   rename, manifest), for both backends and for float16 and int8, --writer-gb each; then each stage
   of that path alone (encode, sha256, the shard writer) over up to 1 GB; then the same path writes
   the big cache of --size-gb (default twice the machine's memory) in --backend.
3. Raw sequential read rate of the big cache's shard files (8 MiB reads), the physical limit.
4. Loader: the trainer's own loader over the big cache (PairDataset, TokenBudgetBatchSampler with its
   epoch shuffle, make_loader with forkserver workers), --workers 1, 2 and 4, --seconds each after the
   first batch. After every batch the pages it may have brought in are dropped (posix_fadvise
   DONTNEED over each shard file it touched, read-ahead included; a sharded zarr file's index is
   kept), so the page cache serves no later batch. Reported: feature GB/s and PrLM tokens/s delivered, read amplification
   (bytes the loader's processes read from storage, /proc/<pid>/io read_bytes, over feature bytes
   delivered), the CPU seconds each process spent on the clock (the trainer's include the page drops)
   and the RSS of the trainer and each worker over time.
--compare: a lane beside the library's, side by side. hdf5: "h5py", token rows sliced out of h5py
   datasets (a handle per shard, kept open), where the library reads them with os.preadv at the
   dataset's offset. zarr: "chunk_files", a second big cache written in zarr's layout 1 (256 KB chunks,
   a file each; bench/zarr_chunk_files.py), its writer and its loader timed beside the library's
   layout (each array one file through zarr's sharding codec), read windows included.
--read-window K[,K...]: a lane per K beside the library's default order, the loader with train.read_window K
   (batches formed within windows of K batches' worth of neighbouring stored sentences, a worker reading
   each window in a few large reads). Its clock starts after the first group of windows is delivered.
--loader-only skips the writer-only caches and stages of step 2.
The loader's target side is not modelled: each pair's target length is its source length.
The cache and scratch files are deleted at the end (--keep keeps the cache). Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_throughput import bible_sentences  # noqa: E402
from zarr_chunk_files import chunk_file_writes  # noqa: E402

from prlmfuse.cache_features import CacheReader  # noqa: E402
from prlmfuse.cache_features.codecs import token_numpy_dtype  # noqa: E402
from prlmfuse.train_fused import data as train_data  # noqa: E402

GB = 1e9
OWN_NAMES = ("raw", "stages")  # with writer-* and cache-*: what the bench writes under --dir
BLOCK = 8 << 20
WIDTH = 768
NUM_LAYERS = 12


def total_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024


def drop_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree(root: Path) -> None:
    for directory, _dirs, files in os.walk(root):
        for name in files:
            drop_file(Path(directory) / name)


def shard_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "shards").rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------- raw disk rates


def raw_write(directory: Path, nbytes: int) -> float:
    """GB/s of plain 8 MiB writes into 64 MiB files, each fsynced (the cache's shard size)."""
    directory.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, BLOCK, dtype=np.uint8).tobytes()
    start, written, index = time.perf_counter(), 0, 0
    while written < nbytes:
        with open(directory / f"raw-{index:05d}", "wb") as f:
            for _ in range(8):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        written += 8 * BLOCK
        index += 1
    elapsed = time.perf_counter() - start
    shutil.rmtree(directory)
    return written / elapsed / GB


def read_files(files: list[Path], limit: int | None = None) -> int:
    """Bytes read from `files` in 8 MiB sequential reads, stopping after the file that passes `limit`."""
    read = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(BLOCK):
                read += len(chunk)
        if limit is not None and read >= limit:
            break
    return read


def raw_sequential_read(files: list[Path], limit: int) -> float:
    """GB/s of 8 MiB sequential reads of `files` (pages dropped first), up to `limit` bytes."""
    for path in files:
        drop_file(path)
    start = time.perf_counter()
    read = read_files(files, limit)
    elapsed = time.perf_counter() - start
    for path in files:
        drop_file(path)
    return read / elapsed / GB


# ----------------------------------------------------------------------------------- the cache


def real_lengths() -> np.ndarray:
    """PrLM tokens per English verse (special tokens included), as the cache build tokenizes them."""
    from prlmfuse.cache_features.extract import encode_corpus
    from prlmfuse.prlms import load_prlm, resolve_checkpoint

    info = resolve_checkpoint("minilm-l6")
    _model, tokenizer = load_prlm(info)
    return encode_corpus(tokenizer, bible_sentences(31_000), max_length=512).lengths


def corpus_of(size_bytes: int, dtype: str, lengths: np.ndarray, seed: int = 0):
    """An EncodedCorpus of tiled real lengths whose stored features fill about `size_bytes`."""
    from prlmfuse.cache_features.codecs import pooled_storage_dtype, token_bytes_per_row
    from prlmfuse.cache_features.extract import EncodedCorpus

    per_sentence = lengths.mean() * token_bytes_per_row(dtype, WIDTH) + \
        2 * WIDTH * token_numpy_dtype(pooled_storage_dtype(dtype)).itemsize
    n = max(1, int(size_bytes / per_sentence))
    rng = np.random.default_rng(seed)
    tiled = np.concatenate([rng.permutation(lengths) for _ in range(-(-n // len(lengths)))])[:n]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tiled, out=offsets[1:])
    return EncodedCorpus(flat_ids=np.zeros(int(offsets[-1]), dtype=np.int32), offsets=offsets,
                         truncated_sentences=0, truncated_tokens=0)


def write_cache(out: Path, corpus, backend: str, dtype: str) -> dict:
    """The build's storage path over synthetic features; returns seconds, bytes stored and shard count."""
    from prlmfuse.cache_features.builder import DEFAULT_MAX_TOKENS, BuildSpec, write_manifest, write_shards
    from prlmfuse.cache_features.codecs import token_bytes_per_row
    from prlmfuse.cache_features.extract import parse_layers, plan_batches, plan_shards
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.manifest import cache_key, key_hash
    from prlmfuse.cache_features.shards import shard_suffix
    from prlmfuse.precision import Runtime
    from prlmfuse.prlms.info import CheckpointInfo

    info = CheckpointInfo(name="synthetic-bert-base", path="", family="bert", num_layers=NUM_LAYERS,
                          hidden_size=WIDTH, max_length=512, is_causal=False, identity="0" * 64)
    selection = parse_layers("-2", NUM_LAYERS)
    fields = cache_key(info, "0" * 64, selection, dtype, precision="fp32")
    spec = BuildSpec(location=Location(out), info=info, selection=selection, fields=fields, key=key_hash(fields),
                     backend=backend, dtype=dtype, max_tokens=DEFAULT_MAX_TOKENS["cuda"], shard_bytes=64 << 20,
                     runtime=Runtime(torch.device("cpu"), torch.float32), force=False, progress=False,
                     lock_timeout=60.0)
    lengths = corpus.lengths
    shards = plan_shards(plan_batches(lengths, spec.max_tokens), lengths, token_bytes_per_row(dtype, WIDTH), spec.shard_bytes)
    names = {plan.index: f"{plan.name_stem}{shard_suffix(backend)}" for plan in shards}
    # Features are views into one random buffer: producing them costs nothing, as on a GPU whose
    # forward runs beside the writer.
    pool = torch.randn(64 << 20)

    def forward(batch: np.ndarray):
        width = int(lengths[batch].max())
        mask = torch.from_numpy(np.arange(width)[None, :] < lengths[batch][:, None])
        count = len(batch) * width * WIDTH
        start = int(np.random.default_rng(int(batch[0])).integers(0, pool.numel() - count + 1))
        states = pool[start : start + count].view(1, len(batch), width, WIDTH)
        pooled = states[0, :, :2].reshape(len(batch), 1, 2, WIDTH)  # the first two token rows, as pooled vectors
        return states, pooled, mask

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    write_shards(spec, corpus, shards, names, forward)
    write_manifest(spec, corpus, names, shards)
    seconds = time.perf_counter() - started
    stored = sum(p.stat().st_size for p in shard_files(out))
    return {"seconds": seconds, "bytes": stored, "shards": len(shards)}


def writer_stages(directory: Path, backend: str, dtype: str, lengths: np.ndarray, nbytes: int) -> dict:
    """Each stage of the storage path alone over one plan's batches, in GB/s of stored bytes: the
    encoder's work (float32 -> stored dtype, padding dropped), the shard's sha256, and the
    shard writer's appends and commit (fsync, rename) less that sha256."""
    import hashlib

    from prlmfuse.cache_features.background_writer import HostBatch, encode_batch
    from prlmfuse.cache_features.builder import DEFAULT_MAX_TOKENS
    from prlmfuse.cache_features.extract import plan_batches
    from prlmfuse.cache_features.location import Location
    from prlmfuse.cache_features.shards import ArraySpec, create_shard, shard_suffix

    corpus = corpus_of(nbytes, dtype, lengths, seed=1)
    lengths = corpus.lengths
    pool = torch.randn(64 << 20)
    encoded, encode_seconds = [], 0.0
    for batch in plan_batches(lengths, DEFAULT_MAX_TOKENS["cuda"]):
        width = int(lengths[batch].max())
        mask = torch.from_numpy(np.arange(width)[None, :] < lengths[batch][:, None])
        states = pool[: len(batch) * width * WIDTH].view(1, len(batch), width, WIDTH)
        pooled = pool[: 2 * len(batch) * WIDTH].view(len(batch), 1, 2, WIDTH)
        t = time.perf_counter()
        batch_on_host = HostBatch(states, pooled, mask.reshape(-1).nonzero().squeeze(1))
        encoded.append(encode_batch(batch_on_host, (NUM_LAYERS - 1,), dtype))
        encode_seconds += time.perf_counter() - t
    stored = sum(a.nbytes for rows in encoded for a in rows.values())
    t = time.perf_counter()
    for rows in encoded:
        for array in rows.values():
            hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B"))
    hash_seconds = time.perf_counter() - t
    specs = {name: ArraySpec((sum(len(rows[name]) for rows in encoded), *array.shape[1:]), array.dtype)
             for name, array in encoded[0].items()}
    directory.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    writer = create_shard(Location(directory), backend, f"stage{shard_suffix(backend)}", specs)
    for rows in encoded:
        for name, array in rows.items():
            writer.append(name, array)
    writer.commit()
    write_seconds = time.perf_counter() - t - hash_seconds
    shutil.rmtree(directory)
    rate = lambda seconds: round(stored / seconds / GB, 3)  # noqa: E731
    return {"backend": backend, "dtype": dtype, "GB": round(stored / GB, 2), "encode_GBps": rate(encode_seconds),
            "sha256_GBps": rate(hash_seconds), "write_GBps": rate(write_seconds)}


# ----------------------------------------------------------------------------------- the loader


class PageDropper:
    """Drops from the page cache what a batch's reads may have brought in (main process): the whole
    file of every hdf5 shard and every sharded zarr array the batch touched, read-ahead pages included
    (a zarr shard's index at the file's end is kept, as a hot index stays cached), and every chunk
    file of a one-file-per-chunk zarr array that it read."""

    def __init__(self, reader):
        self.reader = reader
        self.root = Path(reader.location.path) / "shards"
        self.array = f"layer_{reader.layers[0]:03d}"
        # shard -> ("file", fd, bytes to drop from the start; 0 = all) or ("chunks", chunk rows, array metadata)
        self.layout: dict[int, tuple] = {}

    def drop(self, sentence_ids) -> None:
        r = self.reader
        files = set()
        for i in sentence_ids.tolist():
            s = int(r._shard_of[i])
            kind, a, b = self._layout(s)
            if kind == "file":
                files.add(s)
                continue
            start = int(r._token_start[i])
            stop = start + int(r.lengths[i])
            for chunk in range(start // a, (stop - 1) // a + 1):
                path = self.root / r._shard_names[s] / self.array / b.encode_chunk_key((chunk, 0))
                if path.exists():
                    drop_file(path)
        for s in files:
            _kind, fd, length = self.layout[s]
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)

    def _layout(self, s: int) -> tuple:
        if s not in self.layout:
            path = self.root / self.reader._shard_names[s]
            if self.reader.backend == "hdf5":
                self.layout[s] = ("file", os.open(path, os.O_RDONLY), 0)
            else:
                import zarr

                array = zarr.open_array(str(path / self.array), mode="r")
                if array.shards is None:
                    self.layout[s] = ("chunks", int(array.chunks[0]), array.metadata)
                else:
                    # one file; its index (offset and length of each inner chunk, then a crc32c) at its end
                    fd = os.open(path / self.array / array.metadata.encode_chunk_key((0, 0)), os.O_RDONLY)
                    index = 16 * (array.shards[0] // array.chunks[0]) + 4
                    self.layout[s] = ("file", fd, os.fstat(fd).st_size - index)
        return self.layout[s]

    def close(self) -> None:
        for kind, fd, _ in self.layout.values():
            if kind == "file":
                os.close(fd)


class _H5pyShard:
    """A shard as h5py reads it: each stretch sliced out of its dataset into a buffer, then copied into the
    targets (where the library's ShardHandle.read_into scatter-reads straight into them)."""

    def __init__(self, datasets: dict):
        self.datasets = datasets

    def read_into(self, name, start, stop, targets):
        rows = self.datasets[name][start:stop]
        for first, target in targets:
            target[...] = rows[first : first + len(target)]


class H5pyReader(CacheReader):
    """The hdf5 lane beside the library's reader (--compare): token rows sliced out of h5py datasets,
    each shard's file kept open with no chunk cache, as a reader through h5py's API does. The index is
    built through the library's handles; every read after it goes through h5py."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._through_h5py = True

    def __getstate__(self):
        state = super().__getstate__()
        state["_h5"] = {}
        return state

    def _datasets(self, s: int) -> dict:
        import h5py

        shards = self.__dict__.setdefault("_h5", {})  # shard -> (file, {array name: dataset})
        if s not in shards:
            f = h5py.File(Path(self.location.path) / "shards" / self._shard_names[s], "r", rdcc_nbytes=0)
            shards[s] = (f, {key: f[key] for key in f.keys()})
        return shards[s][1]

    def _read(self, s, name, start, stop):
        return self._datasets(s)[name][start:stop]

    def _open(self, s):
        return _H5pyShard(self._datasets(s)) if getattr(self, "_through_h5py", False) else super()._open(s)

    def close(self):
        for f, _datasets in self.__dict__.pop("_h5", {}).values():
            f.close()
        super().close()


def proc_read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def proc_cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (/proc/<pid>/stat utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], every: float = 2.0):
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.samples: dict[str, list[float]] = {name: [] for name in pids}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            for name, pid in self.pids.items():
                try:
                    self.samples[name].append(round(proc_rss_mb(pid), 1))
                except (OSError, StopIteration):
                    pass


class PrivateMemoryPairs(train_data.PairDataset):
    """The "private" loader lane (bench/loader_stages.py --workers): the library's dataset, with every tensor of
    a work item made on its own in the worker's own memory, so that the hand-over copies each into shared
    memory and sends each one's descriptor."""

    def __setstate__(self, state: dict) -> None:  # unpickled in a worker: that worker allocates privately
        self.__dict__.update(state)
        train_data.batch_tensors = lambda specs: [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


def time_loader(cache: Path, corpus, workers: int, seconds: float, max_tokens: int, seed: int, *,
                lane: str = "library", read_window: int = 0, drop_pages: bool = True) -> dict:
    """The trainer's loader over `cache` for `seconds` after its first batch, pages dropped before and behind it
    (drop_pages False: the page cache serves what it holds). lane: "library", "h5py" (H5pyReader) or
    "private" (PrivateMemoryPairs)."""
    from prlmfuse.train_fused.batch_samplers import StorageWindowBatchSampler, TokenBudgetBatchSampler
    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.data import PairDataset, make_loader

    reader = H5pyReader(cache) if lane == "h5py" else CacheReader(cache)
    # BPE side: the PrLM's length less its two special tokens (the source's </s> is added back).
    zeros = np.zeros(int(corpus.lengths.max()), dtype=np.int32)
    src = [zeros[: max(int(n) - 2, 1)] for n in corpus.lengths]
    pairs = PrivateMemoryPairs if lane == "private" else PairDataset
    dataset = pairs(src, src, [PrLMBranch(reader, layer_rows=(0,), pooled_rows=None)])
    if read_window:
        sampler = StorageWindowBatchSampler(dataset.src_lens, dataset.tgt_lens, max_tokens, reader.stored_order(),
                                            window=read_window, seed=seed)
    else:
        sampler = TokenBudgetBatchSampler(dataset.src_lens, dataset.tgt_lens, max_tokens, seed=seed)
    loader = make_loader(dataset, sampler, num_workers=workers)
    dropper = PageDropper(reader) if drop_pages else None
    drop = dropper.drop if dropper else lambda ids: None
    if dropper:
        drop_tree(cache)
    iterator = iter(loader)
    # Timing starts once the first work item is delivered: a batch, or under read_window the first group of
    # windows (its batches come from windows read before the clock starts, as the windows read ahead of the
    # last batch timed are read on the clock and not delivered).
    warmup = len(next(sampler.remaining_groups())[1]) if read_window else 1
    for _ in range(warmup):
        drop(next(iterator).ids)
    pids = {"trainer": os.getpid()}
    # The DataLoader's own (persistent) iterator holds the worker processes, also under a WindowedLoader.
    workers_of = getattr(loader, "loader", loader)._iterator
    pids.update({f"worker{k}": w.pid for k, w in enumerate(getattr(workers_of, "_workers", []))})
    before = {name: proc_read_bytes(pid) for name, pid in pids.items()}
    cpu_before = {name: proc_cpu_seconds(pid) for name, pid in pids.items()}
    sampler_thread = RssSampler(pids)
    sampler_thread.start()
    tokens = batches = 0
    drop_seconds = 0.0
    start = time.perf_counter()
    for batch in iterator:
        features = batch.prlm[0]
        tokens += int(features.mask.sum())
        batches += 1
        t = time.perf_counter()
        drop(batch.ids)
        drop_seconds += time.perf_counter() - t
        if t - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    read = sum(proc_read_bytes(pid) - before[name] for name, pid in pids.items())
    cpu = {name: round(proc_cpu_seconds(pid) - cpu_before[name], 1) for name, pid in pids.items()}
    sampler_thread.stopped.set()
    sampler_thread.join()
    del iterator, loader
    if dropper:
        dropper.close()
    reader.close()
    delivered = tokens * WIDTH * 2
    return {
        "reader": lane,
        "read_window": read_window,
        "workers": workers,
        "seconds": round(elapsed, 2),
        "batches": batches,
        "feature_GBps": round(delivered / elapsed / GB, 4),
        "tokens_per_s": round(tokens / elapsed),
        "read_amplification": round(read / max(delivered, 1), 3),
        "page_drop_seconds": round(drop_seconds, 1),
        "cpu_seconds": cpu,
        "rss_mb": {name: {"first": s[0], "max": max(s), "last": s[-1]} for name, s in sampler_thread.samples.items() if s},
    }


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="a new or empty directory on the disk to measure")
    parser.add_argument("--size-gb", type=float, help="size of the big cache (default: twice the machine's memory)")
    parser.add_argument("--backend", default="hdf5", choices=("zarr", "hdf5"))
    parser.add_argument("--writer-gb", type=float, default=4.0, help="size of each writer-only cache")
    parser.add_argument("--writer-only", action="store_true", help="measure the writer and the raw write rate only")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=60.0, help="loader time per worker count")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the training batch's token budget")
    parser.add_argument("--keep", action="store_true", help="keep the big cache")
    parser.add_argument("--compare", action="store_true",
                        help="a lane beside the library's: hdf5, reads through h5py; zarr, a cache of a file per chunk")
    parser.add_argument("--loader-only", action="store_true", help="skip the writer-only caches and stages")
    parser.add_argument("--read-window", default="", metavar="K[,K...]",
                        help="lanes beside the library's default order: train.read_window K (windows of K batches' "
                             "worth of neighbouring stored sentences, each read at once)")
    args = parser.parse_args(argv)

    from prlmfuse.precision import machine_line

    memory = total_memory_bytes()
    size = int((args.size_gb or 2 * memory / GB) * GB)
    existing = next(p for p in (args.dir, *args.dir.resolve().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    caches = 2 if args.compare and args.backend == "zarr" else 1
    if caches * size + args.writer_gb * GB > free * 0.95:
        print(f"cache_at_scale: {caches} x {size / GB:.1f} GB do not fit the {free / GB:.1f} GB free under {args.dir}; "
              "pass a smaller --size-gb or another --dir", file=sys.stderr)
        return 2
    if args.dir.exists() and any(args.dir.iterdir()):
        print(f"cache_at_scale: {args.dir} is not empty; give a new or empty directory (the bench deletes what "
              "it writes there)", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_line()}; memory {memory / GB:.1f} GB; disk {args.dir}", flush=True)
    result: dict = {"machine": machine_line(), "memory_GB": round(memory / GB, 1), "width": WIDTH}
    lengths = real_lengths()
    result["sentence_tokens"] = {"mean": round(float(lengths.mean()), 1), "median": int(np.median(lengths))}
    try:
        result["raw_write_GBps"] = round(raw_write(args.dir / "raw", int(args.writer_gb * GB)), 3)
        print(f"raw write: {result['raw_write_GBps']} GB/s", flush=True)
        writers = []
        for backend in () if args.loader_only else ("hdf5", "zarr"):
            for dtype in ("float16", "int8"):
                out = args.dir / f"writer-{backend}-{dtype}"
                timing = write_cache(out, corpus_of(int(args.writer_gb * GB), dtype, lengths), backend, dtype)
                shutil.rmtree(out)
                row = {"backend": backend, "dtype": dtype, "GB": round(timing["bytes"] / GB, 2),
                       "GBps": round(timing["bytes"] / timing["seconds"] / GB, 3)}
                row["of_raw"] = round(row["GBps"] / result["raw_write_GBps"], 2)
                writers.append(row)
                print(f"writer {backend} {dtype}: {row['GBps']} GB/s ({row['of_raw']}x raw)", flush=True)
        result["writer"] = writers
        result["writer_stages"] = []
        for backend in () if args.loader_only else ("hdf5", "zarr"):
            for dtype in ("float16", "int8"):
                row = writer_stages(args.dir / "stages", backend, dtype, lengths, int(min(args.writer_gb, 1.0) * GB))
                result["writer_stages"].append(row)
                print(f"writer stages: {row}", flush=True)
        if not args.writer_only:
            corpus = corpus_of(size, "float16", lengths)
            # lane -> how its own big cache is written (None: it reads the library's); a zarr cache of
            # layout 1 is read by the library's reader
            lanes = {"library": contextlib.nullcontext}
            if args.compare:
                lanes.update({"h5py": None} if args.backend == "hdf5" else {"chunk_files": chunk_file_writes})
            caches, result["cache"] = {}, []
            for lane, writes in lanes.items():
                if writes is None:
                    continue
                cache = args.dir / f"cache-{args.backend}-{lane}"
                with writes():
                    timing = write_cache(cache, corpus, args.backend, "float16")
                caches[lane] = cache
                row = {"lane": lane, "backend": args.backend, "GB": round(timing["bytes"] / GB, 1),
                       "sentences": corpus.num_sentences, "shards": timing["shards"],
                       "files": len(shard_files(cache)), "write_GBps": round(timing["bytes"] / timing["seconds"] / GB, 3)}
                result["cache"].append(row)
                print(f"cache: {row}", flush=True)
            cache = caches["library"]
            result["raw_sequential_read_GBps"] = round(raw_sequential_read(shard_files(cache), min(size, 16 << 30)), 3)
            print(f"raw sequential read: {result['raw_sequential_read_GBps']} GB/s", flush=True)
            result["loader"] = []
            orders = [0] + [int(k) for k in args.read_window.split(",") if k]
            for workers in [int(w) for w in args.workers.split(",")]:
                for lane in lanes:
                    for read_window in [0] if lane == "h5py" else orders:
                        row = time_loader(caches.get(lane, cache), corpus, workers, args.seconds, args.max_tokens,
                                          seed=1, lane=lane, read_window=read_window)
                        result["loader"].append(row)
                        print(f"loader, {workers} worker(s): {row}", flush=True)
    finally:
        for path in args.dir.iterdir():  # only what this bench made (the directory started empty)
            if path.name in OWN_NAMES or path.name.startswith(("writer-", "cache-")):
                if not (args.keep and path.name.startswith("cache-")):
                    shutil.rmtree(path, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
