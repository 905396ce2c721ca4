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

import os
from pathlib import Path

from prlmfuse import signals
from prlmfuse.cache_features.compat import BUILT, DAMAGED, cache_status
from prlmfuse.config import PipelineConfig
from prlmfuse.distributed import barrier, is_main_process, rank_world
from prlmfuse.errors import UserError
from prlmfuse.pipeline_inputs import (CacheJob, _say, _selected_runs, build_caches, cache_jobs, caches_for_run,
                                      ensure_data, ensure_workdir, resolve_run, run_path)
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig, is_baseline_seed
from prlmfuse.train_fused.run_dir_upkeep import training_lock


# ---------------------------------------------------------------------------- training


def train_task(cfg: PipelineConfig, run: RunConfig, *, resume: bool = True, argv: list[str] | None = None):
    """The child command that trains `run` (prlmfuse.launch.Task): `prlmfuse train --pipeline P --runs NAME`, or
    `argv` (a search's runs: `prlmfuse search P --train-run NAME`), always with the local launcher (a child never
    launches again), its output appended to runs/NAME/train.log."""
    from prlmfuse.launch import Task

    out = run_path(cfg, run.name)
    if argv is None:
        argv = ["train", "--pipeline", os.path.abspath(cfg.path), "--runs", run.name]
        if cfg.train.max_updates_override is not None:
            argv += ["--max-updates", str(cfg.train.max_updates_override)]
    argv = list(argv)
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
    if resume and cfg.train.max_updates_override is not None:
        _check_not_past_override(cfg, runs)
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


def _check_not_past_override(cfg: PipelineConfig, runs: list[RunConfig]) -> None:
    """--max-updates below where a run already is would leave its newest checkpoint past the budget its run.json
    then records (and evaluate averaging saves from beyond it): refused before any run starts."""
    limit = cfg.train.max_updates_override
    for run in runs:
        state = rundir.state_to_resume(run_path(cfg, run.name))
        if state is not None and state.update > limit:
            raise UserError(f"--max-updates {limit}: run {run.name} is already at update {state.update} "
                            f"({run_path(cfg, run.name)}); give a budget of at least {state.update}, or leave "
                            f"{run.name} out of --runs")


def _rerun_command(cfg: PipelineConfig, *options: str) -> str:
    """The `prlmfuse run` command line a message tells the user to run, with this command's --max-updates."""
    if cfg.train.max_updates_override is not None:
        options = (*options, f"--max-updates {cfg.train.max_updates_override}")
    return " ".join(("prlmfuse run", str(cfg.path), *options))


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
    process its own copy of the layers it reads of its train and dev caches: a line for the plan, or None where no
    run holds any. Refuses, naming the runs, what this machine's available memory cannot hold."""
    from prlmfuse.cache_features import in_memory_bytes
    from prlmfuse.cache_features.compat import choose_layers
    from prlmfuse.cache_features.manifest import load_manifest

    held = {}
    for run in runs:
        if not run.in_memory_features or not run.prlms:
            continue
        caches = [(use, c[split]) for use, c in zip(run.prlms, caches_for_run(run, jobs, cfg))
                  for split in ("train", "dev") if split in c]
        if any(cache_status(out)[0] != BUILT for _, out in caches):
            held[run.name] = None  # known once its caches are built
            continue
        held[run.name] = 0
        for use, out in caches:
            manifest = load_manifest(out)[1]
            layers, pooled, _ = choose_layers(use.layer, manifest["key_fields"], checkpoint=use.checkpoint, where=out)
            held[run.name] += in_memory_bytes(out, layers, pooled=bool(pooled), manifest=manifest)
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
    with training_lock(out):  # never move a run directory from under its trainer
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
                        f"run `{_rerun_command(cfg, '--only train')}` first")
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
    if only is None and score:
        # The evaluate stage scores with the target's BLEU tokenizer: one that cannot run here stops the
        # command now, not once the caches are built and the runs trained.
        from prlmfuse.evaluate.metrics import check_bleu_tokenizer

        try:
            check_bleu_tokenizer(corpus.tgt_lang)
        except UserError as e:
            raise UserError(f"{e}; or train and decode here with `{_rerun_command(cfg, '--no-score')}` and score "
                            "the results folder with `prlmfuse score` where the tokenizer runs") from None
    # `--only train` finds (and checks) its caches itself; evaluation reads them from the run directories.
    jobs = build_caches(cfg, corpus, names) if only in (None, "cache") else None
    if only in (None, "train"):
        train_runs(cfg, names, jobs=jobs, parallel=parallel, wait=wait)
        if not wait:
            _say(f"evaluate: not started (--no-wait); run `{_rerun_command(cfg)}` again once the array has ended")
            return None
        _stop_if_signalled("training finished; evaluation not started")
    if only in (None, "evaluate"):
        return evaluate_pipeline(cfg, names, score=score)
    return None
