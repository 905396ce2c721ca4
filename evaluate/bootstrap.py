"""Paired bootstrap over evaluated runs: which baseline each run is compared with, intervals and p-values."""

from __future__ import annotations

import numpy as np

from prlmfuse.evaluate.metrics import bootstrap_scores, confidence_interval, paired_p_value
from prlmfuse.evaluate.results import RunResult
from prlmfuse.evaluate.runs import RunView
from prlmfuse.train_fused.config import is_baseline_seed

BOOTSTRAP_SAMPLES = 1000


def matched_baselines(runs: list[RunView], baseline: str | None) -> dict[str, str]:
    """Run name -> the baseline run it is compared with.

    Normally the named baseline. When the baseline was trained with several seeds (a `grid: {seed:
    [...]}` over it), every other run (fused, or a baseline of another recipe such as a parameter-matched
    one) is compared with the baseline run of its own seed, so that seed-to-seed noise is not counted as
    the setting's effect; the baseline's other seeds are compared with the named one, which shows that noise.
    """
    if baseline is None:
        return {}
    by_name = {r.name: r for r in runs}
    base = by_name[baseline]

    base_train = base.record.get("train") or {}
    family = {r.name for r in runs if not r.prlms and is_baseline_seed(r.record.get("train") or {}, base_train)}
    base_by_seed = {(r.record.get("train") or {}).get("seed"): r.name for r in runs if r.name in family}
    base_by_seed[base_train.get("seed")] = baseline
    out = {}
    for r in runs:
        if r.name == baseline:
            continue
        seed = (r.record.get("train") or {}).get("seed")
        out[r.name] = baseline if r.name in family else base_by_seed.get(seed, baseline)
    return out


def add_bootstrap(rows: list[RunResult], sentence_level, refs_sha, baseline_of: dict[str, str], *, n_samples: int, seed: int) -> None:
    """Confidence intervals for every row, and paired p-values against its baseline on the same references.

    Every system is resampled with the same seed over the same number of sentences, so the i-th
    sample of two systems is the same resampled test set (the pairing).
    """
    samples: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for row in rows:
        stats = sentence_level.get((row.run, row.test_set)) or {}
        samples[(row.run, row.test_set)] = {
            m: bootstrap_scores(s, n_samples=n_samples, seed=seed) for m, s in stats.items()
        }
        main = samples[(row.run, row.test_set)].get(row.main_metric)
        if main is not None:
            row.ci_low, row.ci_high = confidence_interval(main)
    by_key = {(r.run, r.test_set): r for r in rows}
    for row in rows:
        baseline = baseline_of.get(row.run)
        base = by_key.get((baseline, row.test_set))
        if base is None:
            continue
        if refs_sha.get((row.run, row.test_set)) != refs_sha.get((baseline, row.test_set)):
            continue  # different corpora: no paired comparison
        base_samples = samples[(baseline, row.test_set)]
        for metric, system_samples in samples[(row.run, row.test_set)].items():
            if metric not in base_samples:
                continue
            row.delta[metric] = getattr(row, metric) - getattr(base, metric)
            row.p_value[metric] = paired_p_value(base_samples[metric], system_samples)
            row.compared_with = baseline
