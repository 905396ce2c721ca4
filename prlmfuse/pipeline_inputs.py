"""What training reads, found or built under the pipeline's workdir: the corpus, a feature cache per checkpoint
entry and split, and the selected runs with their sizes planned from those entries."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from prlmfuse import __version__
from prlmfuse.cache_features.manifest import FORMAT_VERSION, format_version
from prlmfuse.config import CheckpointEntry, PipelineConfig
from prlmfuse.distributed import barrier, is_main_process, rank_world
from prlmfuse.errors import UserError
from prlmfuse.train_fused.config import PrLMUse, RunConfig

logger = logging.getLogger(__name__)

SPLITS = ("train", "dev", "test")


def _say(msg: str) -> None:
    """A progress line, once under torchrun (the CLI shows INFO records to the user)."""
    if is_main_process():
        logger.info(msg)


# ---------------------------------------------------------------------------- data


def ensure_workdir(cfg: PipelineConfig) -> None:
    """The pipeline's workdir exists, or one line says why it cannot, before any stage starts."""
    try:
        cfg.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or str(e)
        raise UserError(f"{cfg.path}: workdir {cfg.workdir} cannot be created ({reason}); "
                        "set workdir to a writable location") from None


def corpus_dir(cfg: PipelineConfig) -> Path:
    d = cfg.data
    if d.kind == "hf":
        # Named by what selects the rows, so that pointing the file at other data builds a new corpus.
        fields = {k: getattr(d, k) for k in ("dataset", "subset", "revision", "src_field", "tgt_field",
                                               "translation_field", "splits", "src", "tgt", "task")}
        return cfg.workdir / "data" / f"hf-{hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]}"
    name = {"bible": f"bible-{d.src}-{d.tgt}", "debian-descriptions": "debian-descriptions",
            "debian-translations": f"debian-translations-{d.src}-{d.tgt}"}.get(d.kind, "text")
    return cfg.workdir / "data" / name


def _edited_input(cfg: PipelineConfig) -> str | None:
    """For `data.kind: text`, the first of `data.files` whose content differs from what the built corpus
    was registered from (None when none does, or for the other kinds, whose sources do not change;
    "" when the corpus records no inputs to compare with)."""
    from prlmfuse import corpora

    root = corpus_dir(cfg)
    if cfg.data.kind != "text" or not (root / "corpus.json").is_file():
        return None
    return corpora.text_inputs_changed(root, dataclasses.asdict(cfg.data.files))


def ensure_data(cfg: PipelineConfig, *, build: bool = True):
    """The pipeline's corpus: loaded if built before, else built (rank 0 only under torchrun).

    A text corpus whose `data.files` changed since it was registered is registered again (replacing the
    old one), so the caches and runs that depend on it see a new corpus and are rebuilt too.
    """
    from prlmfuse import corpora

    root = corpus_dir(cfg)
    edited = _edited_input(cfg)
    if not build or (root / "corpus.json").is_file() and edited is None and rank_world()[1] == 1:
        if not (root / "corpus.json").is_file():
            raise UserError(f"no corpus in {root}; run `prlmfuse run {cfg.path} --only data` first")
        if edited:
            raise UserError(f"{edited} changed since the corpus {root} was built from it; run `prlmfuse run "
                            f"{cfg.path}` (or `--only data` first) to rebuild the corpus and what depends on it")
        return corpora.load_corpus(root)
    # Rank 0 builds (or finds) the corpus and every rank passes the same barrier, whatever it saw:
    # a rank that skipped it would meet rank 0 inside the cache build's collectives instead.
    if is_main_process() and (edited is not None or not (root / "corpus.json").is_file()):
        # edited == "": a corpus of an earlier version, registered again to record its inputs (same
        # files, so its caches and runs stay valid)
        d = cfg.data
        if edited:
            _say(f"data: {edited} changed since the corpus was built; registering the files again in {root}")
        elif edited is None:
            _say(f"data: building {d.kind} corpus in {root}")
        if d.kind == "bible":
            corpora.build_bible(root, src=d.src, tgt=d.tgt)
        elif d.kind == "debian-descriptions":
            corpora.build_debian_descriptions(root, lists_dir=d.lists_dir)
        elif d.kind == "debian-translations":
            corpora.build_debian_translations(root, src=d.src, tgt=d.tgt, lists_dir=d.lists_dir)
        elif d.kind == "hf":
            corpora.build_hf(
                root, dataset=d.dataset, src_lang=d.src, tgt_lang=d.tgt, src_field=d.src_field, tgt_field=d.tgt_field,
                translation_field=d.translation_field, splits=d.splits, subset=d.subset, revision=d.revision,
                task=d.task, name=f"hf-{Path(d.dataset).name}",
            )
        else:
            f = d.files
            corpora.register_text(
                root, train_src=f.train_src, train_tgt=f.train_tgt, dev_src=f.dev_src, dev_tgt=f.dev_tgt,
                test_src=f.test_src, test_tgt=f.test_tgt, src_lang=d.src, tgt_lang=d.tgt, task=d.task,
                force=edited is not None,
            )
    barrier()
    return corpora.load_corpus(root)


# ---------------------------------------------------------------------------- caches


@dataclass(frozen=True)
class CacheJob:
    entry: CheckpointEntry
    dtype: str
    split: str
    corpus_file: Path
    out: str  # directory or fsspec URL
    checkpoint: str  # what build_cache resolves: entry.source, or the directory of an untrained copy

    @property
    def layers_arg(self) -> str:
        layers = self.entry.layers
        return "all" if layers == "all" else ",".join(str(i) for i in layers)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "checkpoint"


def entry_checkpoint(cfg: PipelineConfig, entry: CheckpointEntry, *, prepare: bool = True) -> str:
    """The checkpoint a cache.checkpoints entry reads: its source, or for init: random the untrained copy
    under the workdir (made here once; with prepare=False, the source until it exists)."""
    if entry.init != "random":
        return entry.source
    from prlmfuse.prlms.random_init import prepare_random_init

    directory = cfg.workdir / "checkpoints" / f"{_safe(entry.name)}"
    if prepare:
        if is_main_process():  # one rank writes it; the others read it once it is there
            prepare_random_init(entry.source, directory, int(entry.seed), trust_remote_code=entry.trust_remote_code)
        barrier()
        return str(directory)
    return str(directory) if directory.is_dir() else entry.source


def cache_jobs(cfg: PipelineConfig, corpus, names: list[str] | None = None, *, prepare: bool = True) -> list[CacheJob]:
    """One job per (checkpoint entry, split), for every entry or with `names` only those the selected
    runs read (so an alias no selected run needs is never converted). The directory name carries a
    hash of everything that goes into the cache key, so a changed corpus or checkpoint gets a new
    cache beside the old one. prepare=False (the plan) writes nothing: an untrained copy not yet made
    is keyed by its source for now."""
    from prlmfuse.prlms import resolve_checkpoint

    root = cfg.cache.root
    is_url = "://" in root
    base = root.rstrip("/") if is_url else str((cfg.workdir / root))
    entries = cfg.cache.checkpoints
    if names is not None:
        read = [_find_entry(use, cfg) for run in _selected_runs(cfg, names) for use in run.prlms]
        entries = [e for e in entries if any(e is r for r in read)]
    jobs = []
    for entry in entries:
        checkpoint = entry_checkpoint(cfg, entry, prepare=prepare)
        info = resolve_checkpoint(checkpoint, trust_remote_code=entry.trust_remote_code)
        entry_layers(cfg, entry, info.num_layers)
        dtype = entry.dtype or cfg.cache.dtype
        for split in SPLITS:
            fields = {
                "checkpoint": info.identity, "layers": str(entry.layers), "dtype": dtype,
                "backend": cfg.cache.backend, "corpus": corpus.src_sha256(split), "version": __version__,
            }
            if format_version(dtype) != FORMAT_VERSION:
                # a dtype whose layout changed gets a directory of its own; the others keep theirs
                fields["format"] = format_version(dtype)
            h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
            out = f"{base}/{_safe(entry.name)}/{dtype}-{_safe(str(entry.layers))}/{split}-{h}"
            jobs.append(CacheJob(entry, dtype, split, corpus.src_path(split), out, checkpoint))
    return jobs


def build_caches(cfg: PipelineConfig, corpus, names: list[str] | None = None,
                 splits: tuple[str, ...] = SPLITS) -> list[CacheJob]:
    """Build every cache of the file, or with `names` only those the selected runs read (of `splits` only: a
    search builds no test cache, since it never reads test). Returns the jobs of every split."""
    from prlmfuse.cache_features import build_cache

    jobs = cache_jobs(cfg, corpus, names)
    for job in [j for j in jobs if j.split in splits]:
        # build_cache's own first line names the job's output, device and precision
        build_cache(
            job.checkpoint, job.corpus_file, job.out, layers=job.layers_arg, backend=cfg.cache.backend,
            dtype=job.dtype, max_tokens=cfg.cache.max_tokens, trust_remote_code=job.entry.trust_remote_code,
            device=cfg.device, precision=cfg.precision,
        )
    return jobs


def caches_for_run(run: RunConfig, jobs: list[CacheJob], cfg: PipelineConfig) -> list[dict[str, str]]:
    """{split: cache} of the train/dev/test caches each PrLM branch of `run` reads, in the order of run.prlms."""
    out = []
    for use in run.prlms:
        match = _find_entry(use, cfg)
        dtype = use.dtype or match.dtype or cfg.cache.dtype
        out.append({j.split: j.out for j in jobs if j.entry is match and j.dtype == dtype})
    return out


def _find_entry(use: PrLMUse, cfg: PipelineConfig) -> CheckpointEntry:
    candidates = [
        e for e in cfg.cache.checkpoints
        if e.name == use.checkpoint and (use.dtype is None or (e.dtype or cfg.cache.dtype) == use.dtype)
    ]
    if isinstance(use.layer, str):
        candidates = [e for e in candidates if e.layers == "all" or len(e.layers) > 1] or candidates
    else:
        exact = [e for e in candidates if e.layers == "all" or use.layer in e.layers]
        candidates = exact or candidates
    if not candidates:
        raise UserError(
            f"{cfg.path}: no cache.checkpoints entry for {use.checkpoint!r}"
            + (f" with dtype {use.dtype}" if use.dtype else "") + "; add one"
        )
    return candidates[0]


# ---------------------------------------------------------------------------- model sizes


def entry_layers(cfg: PipelineConfig, entry, num_layers: int):
    """The layers a cache.checkpoints entry stores (a LayerSelection), checked against its model's depth before
    any cache is built; the error names the entry, since a pipeline may list several PrLMs."""
    from prlmfuse.cache_features import parse_layers

    try:
        return parse_layers(entry.layers, num_layers)
    except UserError as e:
        index = next(i for i, e2 in enumerate(cfg.cache.checkpoints) if e2 is entry)
        raise UserError(f"{cfg.path}: cache.checkpoints.{index}.layers ({entry.name}): {e}") from None


def planned_specs(cfg: PipelineConfig, run: RunConfig) -> list:
    """Each PrLM branch of `run` shaped from its checkpoint's config and cache entry, as its caches will
    shape it: the model's size is known before any cache exists."""
    from prlmfuse.cache_features import choose_layers
    from prlmfuse.prlms import resolve_checkpoint
    from prlmfuse.train_fused.branches import branch_spec

    specs = []
    for i, use in enumerate(run.prlms):
        entry = _find_entry(use, cfg)
        info = resolve_checkpoint(entry_checkpoint(cfg, entry, prepare=False), trust_remote_code=entry.trust_remote_code)
        selection = entry_layers(cfg, entry, info.num_layers)
        fields = {"layers": list(selection.token_layers), "pooled_layers": list(selection.pooled_layers),
                  "num_layers": info.num_layers}
        try:
            layers, pooled, mode = choose_layers(use.layer, fields, checkpoint=use.checkpoint,
                                                 where=f"cache of {entry.name}")
        except UserError as e:
            key = cfg.train.written_as.get(run.name, run.name)
            raise UserError(f"{cfg.path}: train.runs.{key}.prlms.{i}.layer: {e}") from None
        specs.append(branch_spec(use, info.hidden_size, layers, pooled, mode))
    return specs


def planned_parameters(cfg: PipelineConfig, run: RunConfig) -> int:
    """Trainable parameters of `run` (match_params resolved) at its configured bpe_vocab."""
    from prlmfuse.train_fused.matching import run_parameters

    run = resolve_run(cfg, run)
    return run_parameters(run, run.bpe_vocab, planned_specs(cfg, run))


def resolve_run(cfg: PipelineConfig, run: RunConfig) -> RunConfig:
    """The run as it trains: with match_params, the sizes (its match_by's) that bring it within 1% of the
    named run's trainable parameters, both counted at their configured bpe_vocab (so the sizes never
    depend on what the BPE learns). run.json records the sizes and the trained model's own count."""
    if run.match_params is None:
        return run
    from prlmfuse.train_fused.matching import matched_sizes

    target = cfg.run(run.match_params)
    return dataclasses.replace(run, **matched_sizes(run, planned_parameters(cfg, target), run.bpe_vocab))


# ---------------------------------------------------------------------------- runs


def run_path(cfg: PipelineConfig, name: str) -> Path:
    """The run directory of the run `name` under the pipeline's workdir."""
    return cfg.workdir / "runs" / _safe(name)


def _selected_runs(cfg: PipelineConfig, names: list[str] | None) -> list[RunConfig]:
    if not names:
        return list(cfg.train.runs)
    runs = []
    for n in names:
        # A name selects that run, or where no run has it, every run a grid made of it (`fused` -> fused.seed-1, ...).
        matched = ([r for r in cfg.train.runs if r.name == n]
                   or [r for r in cfg.train.runs if cfg.train.written_as.get(r.name) == n])
        if not matched:
            cfg.run(n)  # raises the UserError listing the runs
        runs.extend(r for r in matched if r not in runs)
    return runs
