"""The evaluation's figures: scores with bootstrap intervals, and the runs' dev-loss curves."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from prlmfuse.evaluate.results import SIGNIFICANCE, EvaluationResults, is_significant, row_label, setting_label
from prlmfuse.evaluate.runs import RunView
from prlmfuse.fileio import atomic_write_bytes


_BASELINE_COLOR = "#7f7f7f"


def _colors(names: list[str], baseline: str | None) -> dict[str, str]:
    """One color per run, the same in both figures; the baseline is grey."""
    import matplotlib

    palette = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]  # 7 is tab10's grey
    others = [n for n in names if n != baseline]
    colors = {n: palette[i % len(palette)] for i, n in enumerate(others)}
    if baseline in names:
        colors[baseline] = _BASELINE_COLOR
    return colors


def plot_scores(results: EvaluationResults, path: Path) -> None:
    """Bar chart of the main metric per run and test set, with 95% bootstrap intervals, Δ and p against
    the baseline above each bar, and a legend naming each run's setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    splits = list(dict.fromkeys(r.test_set for r in results.rows))
    names = list(dict.fromkeys(r.run for r in results.rows))
    colors = _colors(names, results.baseline)
    per_split = max(len(names), 1)
    fig, axes = plt.subplots(1, len(splits), figsize=(max(4.5, 1.3 * per_split + 1.5) * len(splits), 4.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        rows = [r for r in results.rows if r.test_set == split]
        metric = rows[0].main_metric
        metric_name = {"bleu": "BLEU", "rougeL": "ROUGE-L F1"}.get(metric, metric)
        scores = [getattr(r, metric) for r in rows]
        low = [max(0.0, s - r.ci_low) if math.isfinite(r.ci_low) else 0.0 for s, r in zip(scores, rows)]
        high = [max(0.0, r.ci_high - s) if math.isfinite(r.ci_high) else 0.0 for s, r in zip(scores, rows)]
        x = np.arange(len(rows))
        ax.bar(x, scores, yerr=[low, high], capsize=4, color=[colors[r.run] for r in rows])
        for xi, s, h, r in zip(x, scores, high, rows):
            label = f"{s:.2f}"
            if metric in r.delta:
                star = "*" if is_significant(r, metric) else ""
                p = r.p_value[metric]
                label += f"\nΔ {r.delta[metric]:+.2f}\n" + (f"p={p:.3f}" if p >= 0.001 else "p<0.001") + star
            # Above the interval's top, so the label never sits on the error bar.
            ax.annotate(label, (xi, s + h), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=9)
        long_names = len(rows) > 3 or max(len(r.run) for r in rows) > 14
        ax.set_xticks(x, [r.run for r in rows], rotation=25 if long_names else 0, ha="right" if long_names else "center")
        ax.set_ylabel(metric_name)
        ax.set_title(f"{metric_name} on {split} ({rows[0].num_sentences} sentences), 95% bootstrap CI")
        top = max([s + h for s, h in zip(scores, high)] + [1.0])
        ax.set_ylim(0, top * 1.3)
        ax.grid(axis="y", alpha=0.3)
        handles = [Patch(color=colors[r.run], label=row_label(r)) for r in rows]
        # Right of the axes, so that neither bars nor long run names under them are covered.
        ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5),
                  title=f"* p < {SIGNIFICANCE:g} against the baseline", title_fontsize=8, frameon=False)
    _save_figure(fig, path)
    plt.close(fig)


def plot_dev_loss(runs: list[RunView], curves: dict[str, list[tuple[int, float]]], path: Path,
                  baseline: str | None = None) -> None:
    """Dev loss against updates of every run (`curves`: run name -> its metrics.jsonl's (update, dev loss)),
    labelled with each run's setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    colors = _colors([r.name for r in runs], baseline)
    plotted = 0
    for run in runs:
        curve = curves[run.name]
        if curve:
            xs, ys = zip(*curve)
            ax.plot(xs, ys, marker="o", markersize=3, color=colors[run.name],
                    linestyle="--" if run.name == baseline else "-", label=setting_label(run.name, run.describe()))
            plotted += 1
    if plotted:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    else:
        ax.text(0.5, 0.5, "no dev evaluations in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("training updates")
    ax.set_ylabel("dev loss (label-smoothed cross-entropy per token)")
    ax.set_title("dev loss during training (lower is better)")
    ax.grid(alpha=0.3)
    _save_figure(fig, path)
    plt.close(fig)


def _save_figure(fig, path: Path) -> None:
    # Rendered in memory first so that an unchanged figure leaves the file untouched.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})  # legends sit outside the axes
    atomic_write_bytes(path, buf.getvalue())
