"""The evaluation's figures: scores with bootstrap intervals, and the runs' dev-loss curves."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from prlmfuse.evaluate.results import EvaluationResults
from prlmfuse.evaluate.runs import RunView
from prlmfuse.fileio import atomic_write_bytes
from prlmfuse.train_fused import run_dir as rundir


def plot_scores(results: EvaluationResults, path: Path) -> None:
    """Bar chart of the main metric per run and test set, with 95% bootstrap intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r.test_set for r in results.rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(max(5.0, 1.1 * len(results.rows) / len(splits) + 2.5) * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits):
        rows = [r for r in results.rows if r.test_set == split]
        metric = rows[0].main_metric
        scores = [getattr(r, metric) for r in rows]
        low = [max(0.0, s - r.ci_low) if math.isfinite(r.ci_low) else 0.0 for s, r in zip(scores, rows)]
        high = [max(0.0, r.ci_high - s) if math.isfinite(r.ci_high) else 0.0 for s, r in zip(scores, rows)]
        colors = ["#7f7f7f" if r.run == results.baseline else "#1f77b4" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x, scores, yerr=[low, high], capsize=4, color=colors)
        for xi, s, h, r in zip(x, scores, high, rows):
            p = r.p_value.get(metric)
            label = f"{s:.2f}" + (f"\np={p:.3f}" if p is not None else "")
            # Above the interval's top, so the label never sits on the error bar.
            ax.annotate(label, (xi, s + h), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [r.run for r in rows], rotation=30, ha="right")
        ax.set_ylabel({"bleu": "BLEU", "rougeL": "ROUGE-L F1"}.get(metric, metric))
        ax.set_title(f"{split}: {metric} with 95% bootstrap CI")
        top = max([s + h for s, h in zip(scores, high)] + [1.0])
        ax.set_ylim(0, top * 1.3)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def plot_dev_loss(runs: list[RunView], path: Path) -> None:
    """Dev loss against updates of every run, from their metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    plotted = 0
    for run in runs:
        curve = rundir.read_dev_curve(run.run_dir)
        if curve:
            xs, ys = zip(*curve)
            ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
            plotted += 1
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no dev evaluations in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("updates")
    ax.set_ylabel("dev loss (label-smoothed, per token)")
    ax.set_title("dev loss against updates")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def _save_figure(fig, path: Path) -> None:
    # Rendered in memory first so that an unchanged figure leaves the file untouched.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    atomic_write_bytes(path, buf.getvalue())
