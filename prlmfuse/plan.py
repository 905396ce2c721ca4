"""What `prlmfuse run --dry-run` prints: the data, the caches present or to build, each run's state,
its model with every default resolved and its trainable parameters, and the time left where runs
have logged their speed. Nothing here writes."""

from __future__ import annotations

from prlmfuse.cache_features.compat import BUILT, cache_status
from prlmfuse.config import PipelineConfig
from prlmfuse.pipeline import _is_stale, _left_to_train, features_in_memory
from prlmfuse.pipeline_inputs import (_edited_input, _selected_runs, cache_jobs, corpus_dir, planned_parameters,
                                      planned_specs, resolve_run, run_path)
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig
from prlmfuse.train_fused.matching import trainable_parameters


def _measured_speeds(cfg: PipelineConfig) -> dict[str, float]:
    """Each run's batches per second seen so far in this workdir (the mean of its last logged records): a
    run's update is update_freq batches, so runs of different update_freq are timed in the same unit."""
    speeds = {}
    for run in cfg.train.runs:
        rates = [float(r["updates_per_s"]) * run.update_freq
                 for r in rundir.read_metrics(run_path(cfg, run.name))[-20:] if r.get("updates_per_s")]
        if rates:
            speeds[run.name] = sum(rates) / len(rates)
    return speeds


def _speed_for(run: RunConfig, speeds: dict[str, float], runs: dict[str, RunConfig]) -> float | None:
    """A run's own speed, else the mean of the timed runs of its kind (with a PrLM or without: the branch
    changes the step's cost), else of every timed run."""
    if run.name in speeds:
        return speeds[run.name]
    alike = [v for name, v in speeds.items() if bool(runs[name].prlms) == bool(run.prlms)] or list(speeds.values())
    return sum(alike) / len(alike) if alike else None


def plan_lines(cfg: PipelineConfig, names: list[str] | None, parallel: int = 1) -> list[str]:
    """What `prlmfuse run` would do: data, caches present or to build, runs to train or resume, estimates
    (`parallel` runs training at once)."""
    from prlmfuse.precision import resolve_runtime

    runtime = resolve_runtime(cfg.device, cfg.precision)  # the plan refuses a device the run would refuse
    lines = []
    root = corpus_dir(cfg)
    edited = _edited_input(cfg)
    has_data = (root / "corpus.json").is_file() and not edited
    lines.append(f"pipeline {cfg.path} (workdir {cfg.workdir})")
    lines.append(f"runtime: {runtime.describe()} (cache and train; evaluate decodes in fp32)")
    state = f"to rebuild: {edited} changed" if edited else "present" if has_data else "to build: " + cfg.data.kind
    lines.append(f"data:  {root} [{state}]")
    jobs = corpus = None
    if has_data:
        from prlmfuse import corpora

        corpus = corpora.load_corpus(root)
        jobs = cache_jobs(cfg, corpus, prepare=False)
        for j in jobs:
            lines.append(f"cache: {j.entry.name} ({j.layers_arg}, {j.dtype}) {j.split:<5} "
                         f"[{'present' if cache_status(j.out)[0] == BUILT else 'to build'}] {j.out}")
    else:
        for e in cfg.cache.checkpoints:
            layers = "all" if e.layers == "all" else ",".join(str(i) for i in e.layers)
            lines.append(f"cache: {e.name} ({layers}, {e.dtype or cfg.cache.dtype}) train/dev/test "
                         f"[to build once the corpus exists]")
    speeds, runs_by_name = _measured_speeds(cfg), {r.name: r for r in cfg.train.runs}
    total_updates = total_batches = total_tokens = runs_left = untimed = 0
    seconds = 0.0
    for run in _selected_runs(cfg, names):
        out = run_path(cfg, run.name)
        state, done = rundir.training_progress(run, rundir.state_to_resume(out))
        if (edited or corpus is not None and _is_stale(out, corpus)) and state != "new":
            state, done = "to train again: its corpus changed", 0
        budget = f"{run.max_updates} updates" if run.max_updates is not None else f"{run.max_epochs} epochs"
        prlms = ", ".join(f"{u.checkpoint}[{u.layer}]" for u in run.prlms) or "none (baseline)"
        per_update = f"{run.update_freq} x {run.max_tokens}-token batches per update" if run.update_freq > 1 \
            else f"{run.max_tokens}-token batches"
        if run.max_source_tokens is not None:
            per_update += f", sources cut to {run.max_source_tokens} tokens"
        lines.append(f"train: {run.name:<28} [{state}] PrLM: {prlms}; budget {budget} of {per_update}")
        lines.append(f"       {_effective_settings(cfg, run)}")
        if run.max_updates is not None and not state.startswith("done"):
            left = max(0, run.max_updates - done)
            total_updates += left
            total_batches += left * run.update_freq
            total_tokens += left * run.update_freq * run.max_tokens
            runs_left += 1
            speed = _speed_for(run, speeds, runs_by_name)
            seconds += left * run.update_freq / speed if speed else 0.0
            untimed += run.name not in speeds
    if jobs is not None:
        memory = features_in_memory(cfg, [r for r in _selected_runs(cfg, names) if _left_to_train(cfg, r, corpus)],
                                    jobs, parallel)
        if memory is not None:
            lines.append(memory)
    if total_updates:
        batches = f" ({total_batches} batches)" if total_batches != total_updates else ""
        lines.append(f"estimate: {total_updates} updates left{batches}, at most {total_tokens / 1e6:.1f}M tokens")
        if speeds:
            # Each run's logged rate is its own, whether or not others trained beside it.
            at_once = max(1, min(parallel, runs_left))
            guessed = f" ({untimed} not yet timed: at the mean rate of timed runs of their kind, with or without a PrLM)" if untimed else ""
            lines.append(f"estimate: about {seconds / at_once / 60:.0f} min at each run's measured batches/s{guessed}"
                         f"{f', {at_once} runs at once' if at_once > 1 else ''}")
        else:
            lines.append("estimate: time unknown until a run has logged its speed (metrics.jsonl)")
    lines.append(f"evaluate: -> {cfg.workdir / cfg.evaluate.out} (beam {cfg.evaluate.beam}, average of last {cfg.evaluate.average_last}"
                 f"{' epoch-end' if cfg.evaluate.average == 'epochs' else ''})")
    return lines


def _effective_settings(cfg: PipelineConfig, run: RunConfig) -> str:
    """The model a run builds, defaults included, and its trainable parameters (at the configured bpe_vocab)."""
    resolved = resolve_run(cfg, run)
    model = resolved.model_config(resolved.bpe_vocab, planned_specs(cfg, resolved))
    sizes = (f"{run.preset}: d_model {model.d_model}, {model.enc_layers}+{model.dec_layers} layers, "
             f"{model.heads} heads, ffn {model.ffn}")
    fusion = ""
    if run.prlms:
        branches = ", ".join(f"{u.checkpoint} layer {u.layer}" + (f" ({u.control})" if u.control else "")
                             for u in run.prlms)
        fusion = f"; {branches}; merge {model.merge}, position {model.position}, side {model.side}"
    count = trainable_parameters(model)
    matched = ""
    if run.match_params is not None:
        matched = f", matched to {run.match_params}'s {planned_parameters(cfg, cfg.run(run.match_params)):,}"
        matched += " by depth" if run.match_by == "depth" else ""
    return f"model {sizes}{fusion}; {count:,} trainable parameters at bpe_vocab {run.bpe_vocab}{matched}"
