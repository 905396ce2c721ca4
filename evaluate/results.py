"""Evaluation results: one row per run and test set, written as results.md (the paper's tables), .csv and .json."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prlmfuse.fileio import atomic_write_json, atomic_write_text


@dataclass
class RunResult:
    """One run on one test set: the row of results.md / results.csv."""

    run: str
    test_set: str
    run_dir: str
    task: str
    prlm: str
    layer: str
    merge: str
    position: str
    side: str
    num_sentences: int
    bleu: float
    chrf: float
    rouge1: float
    rouge2: float
    rougeL: float
    sentences_per_s: float
    tokens_per_s: float
    decode_seconds: float
    checkpoints: list[str]
    hyp_file: str
    reused: bool  # hypotheses came from the previous evaluation (unchanged key)
    signature: dict
    # Bootstrap: 95% interval of the main metric, and the comparison with the baseline.
    main_metric: str = "bleu"
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    delta: dict = field(default_factory=dict)  # metric -> score minus baseline
    p_value: dict = field(default_factory=dict)  # metric -> paired bootstrap p
    compared_with: str | None = None  # the baseline run behind delta and p_value
    # Training budget of the decoded run (trainer_state.json).
    updates: int = 0
    train_tokens: int = 0
    train_seconds: float = float("nan")
    # How training ended: max_updates | max_epochs | patience ("" unfinished); dev loss at each epoch end.
    stopped_by: str = ""
    epoch_dev_losses: list[float] = field(default_factory=list)
    seed: int | None = None
    # The run's trainable parameters (run.json; None for runs trained before it recorded them).
    trainable_parameters: int | None = None
    # What `prlmfuse report` checks when it merges evaluations made apart: the hypothesis file and the
    # copy of the references beside results.json (ref_file), each by sha256, the target language
    # (BLEU's tokenizer) and one digest of the training corpus's files.
    tgt_lang: str = ""
    hyp_sha256: str = ""
    ref_file: str = ""
    ref_sha256: str = ""
    corpus_sha256: str = ""
    # How many different hypotheses the run wrote: a summarizer that has not learned to read its input
    # writes the same few synopses for every document.
    distinct_hypotheses: int | None = None

    def to_dict(self) -> dict:
        # `reused` says how this call got the hypotheses, not what they score: it stays out of the
        # results files so that re-running a finished evaluation rewrites nothing.
        d = asdict(self)
        del d["reused"]
        return d


@dataclass
class EvaluationResults:
    out: Path
    baseline: str | None
    rows: list[RunResult]
    settings: dict

    def row(self, run: str, test_set: str = "test") -> RunResult:
        for r in self.rows:
            if r.run == run and r.test_set == test_set:
                return r
        raise KeyError((run, test_set))

    @property
    def files(self) -> dict[str, Path]:
        return {
            "results.md": self.out / "results.md",
            "results.csv": self.out / "results.csv",
            "results.json": self.out / "results.json",
            "scores.png": self.out / "scores.png",
            "dev_loss.png": self.out / "dev_loss.png",
        }


# A delta whose paired-bootstrap p is below this is marked significant (`*`) in results.md and the summary.
SIGNIFICANCE = 0.05


def setting_label(run: str, desc: dict) -> str:
    """A run's name with what it is: `fused: minilm-l6 L-2, sum/ffn/source`, `baseline: no PrLM`.

    desc holds the table columns prlm, layer, merge, position, side (RunView.describe, RunResult).
    """
    if desc.get("prlm", "-") == "-":
        return f"{run}: no PrLM"
    names, layers = desc["prlm"].split(" + "), str(desc["layer"]).split(" + ")
    branches = " + ".join(f"{n} L{layer}" if layer.lstrip("-").isdigit() else f"{n} {layer}"
                          for n, layer in zip(names, layers))
    return f"{run}: {branches}, {desc['merge']}/{desc['position']}/{desc['side']}"


def row_label(row: RunResult) -> str:
    return setting_label(row.run, {k: getattr(row, k) for k in ("prlm", "layer", "merge", "position", "side")})


def stable_order(names: list[str], baseline: str | None) -> list[str]:
    """Runs as every report lists them: the baseline first, then the others by name."""
    return sorted(dict.fromkeys(names), key=lambda n: (n != baseline, n))


def is_significant(row: RunResult, metric: str) -> bool:
    p = row.p_value.get(metric)
    return p is not None and p < SIGNIFICANCE


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_parameters(count: int | None) -> str:
    """Trainable parameters in millions, two decimals ("-" where a run did not record them)."""
    return "-" if count is None else f"{count / 1e6:.2f}M"


def _with_delta(row: RunResult, metric: str, baseline: str | None) -> str:
    score = _fmt(getattr(row, metric))
    if row.run == baseline:
        return f"{score} (-)"
    if metric in row.delta:
        versus = f" vs {row.compared_with}" if row.compared_with not in (None, baseline) else ""
        mark = "*" if is_significant(row, metric) else ""
        return f"{score} ({row.delta[metric]:+.2f}, p={row.p_value[metric]:.3f}{mark}{versus})"
    return score


def results_markdown(results: EvaluationResults) -> str:
    """Tables in the style of the paper's Tables 1-5, one per test set, plus metric signatures."""
    lines = ["# prlmfuse evaluation", ""]
    s = results.settings
    lines.append(
        f"beam {s['beam']}, length penalty {s['lenpen']}, average of the last {s['average_last']} "
        f"{'epoch-end ' if s.get('average') == 'epochs' else ''}checkpoints "
        f"(0 = best), paired bootstrap {s['bootstrap_samples']} samples (seed {s['seed']}); "
        f"baseline: {results.baseline or 'none'}. Δ and p are against the baseline (two-sided paired bootstrap), "
        f"or against the baseline run of the same seed where it names one; * marks p < {SIGNIFICANCE:g}. "
        f"The baseline comes first, then the other runs by name."
    )
    for split in dict.fromkeys(r.test_set for r in results.rows):
        rows = [r for r in results.rows if r.test_set == split]
        summarization = any(r.task == "summarization" for r in rows)
        lines += ["", f"## {split} ({rows[0].num_sentences} sentences)", ""]
        header = ["run", "PrLM", "layer", "merge", "position", "side", "BLEU (Δ, p)", "chrF"]
        if summarization:
            header += ["R-1", "R-2", "R-L (Δ, p)", "distinct hyps"]
        header += ["params", "sentences/s", "tokens/s", "95% CI", "updates", "train tokens", "train min"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            cells = [r.run, r.prlm, r.layer, r.merge, r.position, r.side, _with_delta(r, "bleu", results.baseline), _fmt(r.chrf)]
            if summarization:
                cells += [_fmt(r.rouge1), _fmt(r.rouge2), _with_delta(r, "rougeL", results.baseline),
                          "-" if r.distinct_hypotheses is None else str(r.distinct_hypotheses)]
            ci = f"{r.main_metric} [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
            cells += [format_parameters(r.trainable_parameters), _fmt(r.sentences_per_s, 1), _fmt(r.tokens_per_s, 0), ci, str(r.updates),
                      f"{r.train_tokens / 1e6:.2f}M", _fmt(r.train_seconds / 60, 1)]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        signatures = dict.fromkeys(f"{k}: {v}" for r in rows for k, v in sorted(r.signature.items()))
        lines += ["", "Signatures:", ""] + [f"- `{sig}`" for sig in signatures]
    return "\n".join(lines) + "\n"


_CSV_COLUMNS = [
    "test_set", "run", "prlm", "layer", "merge", "position", "side", "num_sentences", "bleu", "bleu_delta",
    "bleu_p", "chrf", "rouge1", "rouge2", "rougeL", "rougeL_delta", "rougeL_p", "compared_with", "main_metric", "ci_low",
    "ci_high", "trainable_parameters", "sentences_per_s", "tokens_per_s", "decode_seconds", "updates", "train_tokens", "train_seconds", "checkpoints", "hyp_file", "run_dir",
    "distinct_hypotheses",
]


def results_csv(results: EvaluationResults) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in results.rows:
        d = r.to_dict()
        row = {k: d.get(k) for k in _CSV_COLUMNS}
        for metric in ("bleu", "rougeL"):
            row[f"{metric}_delta"] = r.delta.get(metric, "")
            row[f"{metric}_p"] = r.p_value.get(metric, "")
        row["checkpoints"] = " ".join(r.checkpoints)
        writer.writerow(row)
    return buf.getvalue()


def json_safe(obj):
    """obj with every NaN or infinity as null, which JSON can hold."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def write_results(results: EvaluationResults) -> None:
    out = results.out
    atomic_write_text(out / "results.md", results_markdown(results))
    atomic_write_text(out / "results.csv", results_csv(results))
    atomic_write_json(
        out / "results.json",
        json_safe({"baseline": results.baseline, "settings": results.settings, "rows": [r.to_dict() for r in results.rows]}),
    )
