"""`prlmfuse run`: data -> cache for each checkpoint -> every training run -> evaluation.

Each step is skipped when its result is already there (the corpus by its corpus.json, a cache
by its key, a run by its trainer state, an evaluation by its hypothesis keys), so a second
run of a finished pipeline takes seconds and changes nothing.

Layout under `workdir`:
    data/<corpus>/                 corpus files + corpus.json
    cache/<checkpoint>/<split>-<h> one cache per checkpoint, split and key (h: short key hash)
    runs/<run name>/               one run directory per training run
    results/                       results.md, .csv, .json, plots
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from prlmfuse import __version__, signals
from prlmfuse.cache_features.compat import BUILT, DAMAGED, cache_status
from prlmfuse.cache_features.manifest import FORMAT_VERSION, format_version
from prlmfuse.config import CheckpointEntry, PipelineConfig
from prlmfuse.distributed import barrier, is_main_process, rank_world
from prlmfuse.errors import UserError
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import PrLMUse, RunConfig, is_baseline_seed

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


# ---------------------------------------------------------------------------- training


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


def train_task(cfg: PipelineConfig, run: RunConfig, *, resume: bool = True, argv: list[str] | None = None):
    """The child command that trains `run` (prlmfuse.launch.Task): `prlmfuse train --pipeline P --runs NAME`, or
    `argv` (a search's runs: `prlmfuse search P --train-run NAME`), always with the local launcher (a child never
    launches again), its output appended to runs/NAME/train.log."""
    from prlmfuse.launch import Task

    out = run_path(cfg, run.name)
    argv = list(argv or ["train", "--pipeline", os.path.abspath(cfg.path), "--runs", run.name])
    argv += ["--device", cfg.device, "--precision", cfg.precision, "--launcher", "local"]
    if not resume:
        argv.append("--fresh")
    return Task(run.name, tuple(argv), out / rundir.TRAIN_LOG, out)


def train_runs(
    cfg: PipelineConfig, names: list[str] | None = None, *, resume: bool = True, jobs=None, parallel: int = 1,
    wait: bool = True, task_argv=None,
) -> list[Path]:
    """Train (or resume) the selected runs. With the local launcher, `parallel` > 1 trains that many at once, each
    in a child process; `launcher.kind: slurm` (--launcher slurm) submits them as one SLURM job array and waits
    for it (`wait` False: returns once it is submitted). task_argv(run): the child command of a run that
    `prlmfuse train` cannot name (a search's)."""
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import train_run

    if not isinstance(parallel, int) or parallel < 1:
        raise UserError(f"--jobs must be a positive integer, got {parallel!r}")
    on_cluster = cfg.launcher.kind != "local"
    if (parallel > 1 or on_cluster) and rank_world()[1] > 1:
        raise UserError("--jobs > 1 and --launcher slurm cannot be combined with torchrun; use one or the other")
    # A device this machine lacks fails before any work (a cluster's tasks resolve theirs where they run).
    runtime = None if on_cluster else resolve_runtime(cfg.device, cfg.precision)
    ensure_workdir(cfg)
    corpus = ensure_data(cfg, build=False)
    if jobs is None:
        jobs = cache_jobs(cfg, corpus, names)
        needed = {c[split] for r in _selected_runs(cfg, names) for c in caches_for_run(r, jobs, cfg) for split in ("train", "dev")}
        for out in [j.out for j in jobs if j.out in needed]:
            state, why = cache_status(out)
            if state == DAMAGED:
                raise UserError(
                    f"cache {out} is damaged: its manifest {out}/manifest.json is truncated or unreadable ({why}); "
                    f"rerun `prlmfuse run {cfg.path} --only cache` to rebuild it (if that refuses, delete {out} first)"
                )
            if state != BUILT:
                raise UserError(f"cache {out} is not built; run `prlmfuse run {cfg.path} --only cache` first")
    runs = _selected_runs(cfg, names)
    # Each process holds its own copy: the runs trained at once, or under torchrun every rank of this node.
    # (An array task is a machine of its own.)
    features_in_memory(cfg, [r for r in runs if not resume or _left_to_train(cfg, r, corpus)], jobs,
                       1 if on_cluster else parallel if parallel > 1 else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if is_main_process():
        for run in runs:
            _set_aside_if_stale(run_path(cfg, run.name), corpus)
    barrier()
    if on_cluster or (parallel > 1 and len(runs) > 1):
        from prlmfuse.launch import launch

        tasks = [train_task(cfg, run, resume=resume, argv=task_argv(run) if task_argv else None) for run in runs]
        launch(tasks, cfg.launcher, workdir=cfg.workdir, parallel=parallel, wait=wait, label="train")
        return [run_path(cfg, r.name) for r in runs]
    dirs = []
    for run in runs:
        _stop_if_signalled(f"not started: {run.name}")
        out = run_path(cfg, run.name)
        # train_run's first line names the run, its directory, device and precision
        train_run(resolve_run(cfg, run), corpus, caches_for_run(run, jobs, cfg), out, resume=resume, runtime=runtime)
        dirs.append(out)
    return dirs


def _available_memory() -> int | None:
    """Bytes this machine can still give (MemAvailable), None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _left_to_train(cfg: PipelineConfig, run: RunConfig, corpus) -> bool:
    """Whether training `run` has work left: not done, or done on a corpus that has changed since. A run
    directory too damaged to tell counts as left (`--fresh` starts it over)."""
    if not run.in_memory_features or not run.prlms:
        return False  # holds no features in memory: nothing to count, and its directory is not read
    out = run_path(cfg, run.name)
    try:
        state = rundir.training_progress(run, rundir.state_to_resume(out))[0]
    except UserError:
        return True
    return not state.startswith("done") or (corpus is not None and _is_stale(out, corpus))


def features_in_memory(cfg: PipelineConfig, runs: list[RunConfig], jobs: list[CacheJob], parallel: int) -> str | None:
    """What the runs that hold their features in memory (in_memory_features) take, `parallel` of them at once, each
    process its own copy of its train and dev caches: a line for the plan, or None where no run holds any. Refuses,
    naming the runs, what this machine's available memory cannot hold."""
    from prlmfuse.cache_features import in_memory_bytes

    held = {}
    for run in runs:
        if not run.in_memory_features or not run.prlms:
            continue
        caches = [c[split] for c in caches_for_run(run, jobs, cfg) for split in ("train", "dev") if split in c]
        if any(cache_status(out)[0] != BUILT for out in caches):
            held[run.name] = None  # known once its caches are built
            continue
        held[run.name] = sum(in_memory_bytes(out) for out in caches)
    if not held:
        return None
    known = sorted(((n, b) for n, b in held.items() if b is not None), key=lambda x: -x[1])
    at_once = known[: max(1, min(parallel, len(held)))]
    need = sum(b for _, b in at_once)
    gib = lambda b: f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    available = _available_memory()
    each = ", ".join(f"{n} {gib(b)}" if b is not None else f"{n} (caches not built yet)" for n, b in held.items())
    line = f"memory: features held in memory: {each}"
    if at_once:
        line += (f"; {len(at_once)} at once hold up to {gib(need)}"
                 + (f" of the {gib(available)} available" if available is not None else ""))
    if available is not None and need > available:
        raise UserError(
            f"{', '.join(n for n, _ in at_once)} at once hold {gib(need)} of cached features in memory "
            f"(in_memory_features: true, one copy per run), more than the {gib(available)} this machine has "
            f"available; train fewer at once (--jobs / train.jobs) or set in_memory_features: false"
        )
    return line


def _stop_if_signalled(what: str) -> None:
    """A stop signal that came while a stage was finishing its last step: start nothing more. Under torchrun
    the ranks decide together (the largest signal number any rank got), so none goes on alone."""
    from prlmfuse.distributed import all_reduce_max, init_distributed

    signum = all_reduce_max(init_distributed(), signals.received() or 0)
    if signum:
        raise signals.Stopped(signum, f"{what}; rerun the same command to go on")


def _corpus_hashes(corpus) -> dict:
    return {split: {side: corpus.splits[split][side]["sha256"] for side in ("src", "tgt")} for split in corpus.splits}


def _is_stale(out: Path, corpus) -> bool:
    """Whether the run directory `out` was trained on other corpus files than `corpus` holds now."""
    if not (out / rundir.RUN_JSON).is_file():
        return False
    try:
        recorded = rundir.read_run_info(out)["corpus"].get("sha256")
    except UserError:
        return False  # train_run names what is wrong with it
    return recorded != _corpus_hashes(corpus)


def _set_aside_if_stale(out: Path, corpus) -> None:
    """A run directory trained on other corpus files than the corpus now holds (its data was edited) is
    renamed to `<name>.stale-<time>` beside itself, so the run trains again from scratch; its old
    checkpoints stay there until the user deletes them."""
    import time

    if not _is_stale(out, corpus):
        return
    aside = out.with_name(f"{out.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    with rundir.training_lock(out):  # never move a run directory from under its trainer
        os.rename(out, aside)
    _say(f"train: {out} was trained on an earlier version of the corpus; moved it to {aside} to train it again")


# ---------------------------------------------------------------------------- evaluation


def _finished(cfg: PipelineConfig, run: RunConfig) -> bool:
    """Whether a run's training is over (its budget reached, or stopped for good), by its last saved state."""
    out = run_path(cfg, run.name)
    if not rundir.list_checkpoints(out):
        return False
    state = rundir.state_to_resume(out)
    return state is not None and rundir.stop_reason(run, state) is not None


def evaluate_pipeline(cfg: PipelineConfig, names: list[str] | None = None, *, score: bool = True):
    """Stage three for the selected runs; each run directory names the caches it reads.

    score False: decode only (`evaluate_runs`), for a machine without the metric's tokenizer."""
    from prlmfuse.evaluate import evaluate_runs

    ensure_data(cfg, build=False)
    e = cfg.evaluate
    selected = _selected_runs(cfg, names)
    requested = list(selected)
    baseline = e.baseline
    if names is not None and baseline is not None:
        # `--runs fused` still compares with the baseline (and its other seeds) once they are trained;
        # their hypotheses are reused, so this costs no decoding.
        base = cfg.run(baseline)

        base_train = base.to_dict()
        family = [r for r in cfg.train.runs if r is base or is_baseline_seed(r.to_dict(), base_train)]
        # Only the baseline's seeds that finished training: one still training (another batch, beside this
        # one) would be decoded from whatever checkpoints it has so far.
        selected += [r for r in family if r not in selected and _finished(cfg, r)]
        if base not in selected:
            # A batch of another seed (`--runs baseline.seed-2,fused.seed-2`) is compared with its own baseline.
            seeds = {r.seed for r in requested}
            own = [r for r in family if r in requested] or [r for r in family if r in selected and r.seed in seeds]
            baseline = own[0].name if own else None
    untrained = [r.name for r in selected if not rundir.list_checkpoints(run_path(cfg, r.name))]
    if untrained:
        raise UserError(f"not trained yet: {', '.join(untrained)} (no checkpoint under {cfg.workdir / 'runs'}); "
                        f"run `prlmfuse run {cfg.path} --only train` first")
    dirs = [run_path(cfg, r.name) for r in selected]
    if not is_main_process():
        return None
    out = cfg.workdir / e.out
    return evaluate_runs(
        dirs, out=out, baseline=baseline, beam=e.beam, lenpen=e.lenpen, average_last=e.average_last, average=e.average,
        no_repeat_ngram_size=e.no_repeat_ngram_size, max_len_a=e.max_len_a, max_len_b=e.max_len_b,
        min_len=e.min_len, device=cfg.device, score=score,
    )


# ---------------------------------------------------------------------------- all of it


def run_pipeline(cfg: PipelineConfig, *, only: str | None = None, names: list[str] | None = None,
                 parallel: int = 1, score: bool = True, wait: bool = True):
    """Every stage of the pipeline file (or `only` one), skipping what is already done. With `launcher.kind:
    slurm` the training runs go to SLURM as one job array (data, caches and the evaluation stay here);
    `wait` False returns once it is submitted, before the evaluation.

    Returns the EvaluationResults when the evaluate stage ran here (rank 0), else None.
    """
    from prlmfuse.precision import resolve_runtime

    if cfg.launcher.kind == "local" or only != "train":
        resolve_runtime(cfg.device, cfg.precision)  # a device this machine lacks fails before any work
    ensure_workdir(cfg)
    if only in (None, "data"):
        corpus = ensure_data(cfg)
    else:
        corpus = ensure_data(cfg, build=False)
    if only == "data":
        return
    # `--only train` finds (and checks) its caches itself; evaluation reads them from the run directories.
    jobs = build_caches(cfg, corpus, names) if only in (None, "cache") else None
    if only in (None, "train"):
        train_runs(cfg, names, jobs=jobs, parallel=parallel, wait=wait)
        if not wait:
            _say(f"evaluate: not started (--no-wait); run `prlmfuse run {cfg.path}` again once the array has ended")
            return None
        _stop_if_signalled("training finished; evaluation not started")
    if only in (None, "evaluate"):
        return evaluate_pipeline(cfg, names, score=score)
    return None
