"""Evaluation results: one row per run and test set, written as results.md (the paper's tables), .csv and .json."""

from __future__ import annotations

import csv
import io
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

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
    # What the hypotheses show without references (`hypothesis_figures`): a model that has not learned to
    # read its input writes the same few lines for every input, and a summarizer that copies its input
    # writes mostly source words. None in rows written before they were recorded.
    distinct_hypotheses: int | None = None
    distinct_share: float | None = None
    top_hypothesis_count: int | None = None
    copy_share: float | None = None  # summarization only

    def to_dict(self) -> dict:
        # `reused` says how this call got the hypotheses, not what they score: it stays out of the
        # results files so that re-running a finished evaluation rewrites nothing.
        d = asdict(self)
        del d["reused"]
        return d


# Hypothesis words for the copy share: unicode-aware casefolding, then runs of word characters, so that
# Cyrillic or Greek words count and "image." in a synopsis matches "image" in its description.
_WORD = re.compile(r"\w+")


def hypothesis_figures(hyps: Sequence[str], sources: Sequence[str] | None = None, *, task: str) -> dict:
    """What a run's outputs show without references, as the RunResult fields of the same names.

    distinct_hypotheses: how many different lines the run wrote; distinct_share: that over the number of
    hypotheses; top_hypothesis_count: how often it wrote its most frequent line. copy_share: of all hypothesis
    words (casefolded runs of unicode word characters), the share found among the words of the hypothesis's
    own source line. The copy share is computed for summarization runs (the ones ROUGE scores) and only where
    their sources are given (`evaluate` gives them; a results folder that `report` merges holds none); it is
    None otherwise, since a translation's words are of another language, and a Japanese target has no
    spaces that would mark its words (a summary in such a language counts each run of characters between
    spaces and punctuation as one word, so its share is coarse). Shares are None for no hypotheses.
    """
    counts = Counter(hyps)
    copies = task == "summarization" and sources is not None
    return {
        "distinct_hypotheses": len(counts),
        "distinct_share": len(counts) / len(hyps) if hyps else None,
        "top_hypothesis_count": max(counts.values(), default=0),
        "copy_share": _copy_share(hyps, sources) if copies else None,
    }


def _copy_share(hyps: Sequence[str], sources: Sequence[str]) -> float | None:
    if len(hyps) != len(sources):
        raise ValueError(f"{len(hyps)} hypotheses for {len(sources)} sources")
    copied = total = 0
    for hyp, src in zip(hyps, sources):
        words, source_words = _WORD.findall(hyp.casefold()), set(_WORD.findall(src.casefold()))
        copied += sum(w in source_words for w in words)
        total += len(words)
    return copied / total if total else None


def refresh_hypothesis_figures(row: RunResult, hyps: Sequence[str]) -> None:
    """Set a row read back from results.json to what its (checked) hypothesis file gives, so that files
    written before the figures were recorded show them too. The copy share stays as stored: it needs the
    sources, which a results folder does not hold."""
    figures = hypothesis_figures(hyps, task=row.task)
    del figures["copy_share"]
    for name, value in figures.items():
        setattr(row, name, value)


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
            "dev_loss.json": self.out / "dev_loss.json",
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


def format_share(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


def hypothesis_cells(row: RunResult, copies: bool) -> list[str]:
    """A table row's distinct share and most frequent hypothesis's count, and its copy share where the
    table has that column (summarization tables)."""
    top = "-" if row.top_hypothesis_count is None else str(row.top_hypothesis_count)
    return [format_share(row.distinct_share), top] + ([format_share(row.copy_share)] if copies else [])


def hypothesis_headers(copies: bool) -> list[str]:
    return ["distinct share", "top hyp count"] + (["copy share"] if copies else [])


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
    up_to = f"up to update {s['at_update']} " if s.get("at_update") else ""
    lines.append(
        f"beam {s['beam']}, length penalty {s['lenpen']}, average of the last {s['average_last']} "
        f"{'epoch-end ' if s.get('average') == 'epochs' else ''}checkpoints "
        f"{up_to}(0 = best), paired bootstrap {s['bootstrap_samples']} samples (seed {s['seed']}); "
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
            header += ["R-1", "R-2", "R-L (Δ, p)"]
        header += hypothesis_headers(summarization)
        header += ["params", "sentences/s", "tokens/s", "95% CI", "updates", "train tokens", "train min"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            cells = [r.run, r.prlm, r.layer, r.merge, r.position, r.side, _with_delta(r, "bleu", results.baseline), _fmt(r.chrf)]
            if summarization:
                cells += [_fmt(r.rouge1), _fmt(r.rouge2), _with_delta(r, "rougeL", results.baseline)]
            cells += hypothesis_cells(r, summarization)
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
    "distinct_hypotheses", "distinct_share", "top_hypothesis_count", "copy_share",
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
