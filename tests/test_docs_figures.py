"""Every figure README.md and docs/results.md's summary quote, tied to the committed JSON behind it.

Each quote names its document, the section that holds it and a pattern that finds it exactly once,
one regex group per printed figure, and for each group the field of docs/results/*.json it prints.
A printed figure must equal its field at the printed rounding; a number in a checked section that no
quote covers fails too, so a figure cannot be added, changed or left behind without its source.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


@functools.cache
def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def system(file: str, name: str, field: str) -> Callable[[], float]:
    """A system's field in a `report` file's systems table (mean, sd, delta_mean, delta_sd)."""
    def get():
        (entry,) = [s for s in _json(file)["systems"] if s["system"] == name]
        return entry[field]
    return get


def against_system(file: str, name: str, against: str, field: str) -> Callable[[], float]:
    """A system's mean or sd of Δ against another system, over the seeds (`report --against`)."""
    def get():
        (entry,) = [a for a in _json(file)["against_systems"] if a["system"] == name and a["against"] == against]
        return entry[field]
    return get


def row(file: str, run: str, field: str, metric: str | None = None) -> Callable[[], float]:
    """One run's field of a results file (`delta` and `p_value` are keyed by the metric)."""
    def get():
        (entry,) = [r for r in _json(file)["rows"] if r["run"] == run]
        return entry[field] if metric is None else entry[field][metric]
    return get


def against_row(file: str, run: str, against: str, field: str, sign: float = 1.0) -> Callable[[], float]:
    """One run's Δ or p against another run of its file (`report --against`); sign -1 reads it the other way."""
    def get():
        (entry,) = [a for a in _json(file)["against"] if a["run"] == run and a["against"] == against]
        return sign * entry[field]["bleu"]
    return get


def params_millions(file: str, run: str) -> Callable[[], float]:
    return lambda: row(file, run, "trainable_parameters")() / 1e6


def largest_p(file: str, name: str, against: str | None = None) -> Callable[[], float]:
    """The largest paired-bootstrap p over a system's seeds, against the baseline or against a system."""
    def get():
        data = _json(file)
        (entry,) = [s for s in data["systems"] if s["system"] == name]
        runs = set(entry["runs"])
        if against is None:
            return max(r["p_value"]["bleu"] for r in data["rows"] if r["run"] in runs)
        return max(a["p_value"]["bleu"] for a in data["against"] if a["run"] in runs and a["against"] == against)
    return get


def step_cost(key: str) -> Callable[[], float]:
    """A figure of bench/train_throughput.py's run for the default's cost per update; `name.i` indexes a list."""
    def get():
        name, _, index = key.partition(".")
        value = _json("default/cost/train-step-xeon-amx.json")["result"][name]
        return value[int(index)] if index else value
    return get


VS = r"(?:\*\*)?(\S+) \(([\d.]+)\)(?:\*\*)?"  # a Δ (p) cell, in bold where p < 0.05


def delta_and_p(file: str, run: str, against: str) -> tuple[Callable[[], float], Callable[[], float]]:
    """A Δ (p) cell's two figures: `run` against another run or system of its file (`report --against`)."""
    return against_row(file, run, against, "delta"), against_row(file, run, against, "p_value")


def largest(*figures: Callable[[], float]) -> Callable[[], float]:
    """The largest of several figures: one p printed for several comparisons ("p 0.002 each")."""
    return lambda: max(figure() for figure in figures)


def epoch_dev_loss(file: str, run: str, epoch: int) -> Callable[[], float]:
    return lambda: row(file, run, "epoch_dev_losses")()[epoch - 1]


def distinct_share(file: str, run: str) -> Callable[[], float]:
    return lambda: row(file, run, "distinct_hypotheses")() / row(file, run, "num_sentences")()


def train_hours(file: str) -> Callable[[], float]:
    return lambda: sum(r.get("train_seconds") or 0.0 for r in _json(file)["rows"]) / 3600


def train_minutes(file: str, run: str) -> Callable[[], float]:
    return lambda: row(file, run, "train_seconds")() / 60


def run_count(file: str) -> Callable[[], float]:
    return lambda: len(_json(file)["rows"])


def seeds_row(doc: str, section: str, label: str, name: str, against: str | None = None,
              file: str | None = None) -> Quote:
    """A table row of a system over seeds (`file`, default the controls): params, BLEU mean ± sd, Δ ± sd vs the
    baseline with the largest p, then (`against`) Δ ± sd vs another system with its largest p, or "–", then the
    seeds."""
    file = file or CONTROLS
    p_word = "p ≤ " if doc == "README.md" else "≤ "
    delta = rf"(\S+) ± ([\d.]+) \({p_word}([\d.]+)\)"
    cells = [r"([\d.]+)M", r"([\d.]+) ± ([\d.]+)", delta]
    figures = [params_millions(file, name), system(file, name, "mean"), system(file, name, "sd"),
               system(file, name, "delta_mean"), system(file, name, "delta_sd"), largest_p(file, name)]
    if against == "–":
        cells.append("–")
    elif against is not None:
        cells.append(delta)
        figures += [against_system(file, name, against, "delta_mean"),
                    against_system(file, name, against, "delta_sd"), largest_p(file, name, against)]
    cells.append(r"(\d+)")
    figures.append(lambda: len(system(file, name, "runs")()))
    return Quote(doc, section, rf"^\| {re.escape(label)} \| " + " \\| ".join(cells) + r" \|$", tuple(figures))


@dataclass(frozen=True)
class Quote:
    doc: str
    section: str  # the heading whose section holds the quote
    pattern: str  # found exactly once in that section; one group per figure
    figures: tuple[Callable[[], float], ...]


CONTROLS = "controls-3000.json"
DEFAULT = "default-en-ja-3000.json"
DEMO = "demo-xeon-amx.json"  # the demo's figures on a Xeon with AMX, as README's quick start quotes them
EN_JA = "en-ja.json"
SEARCH = "search-en-ja.json"  # the search's confirm runs, merged with the default's seed 1
SEARCH_TRIALS = "search-en-ja/trials.json"
DEFAULT_JA_EN = "default-ja-en-3000.json"  # the shipped default on Japanese->English, seed 1
DEFAULT_EN_FR = "default-en-fr-debian.json"  # the shipped default on English->French Debian descriptions, seed 1
DEFAULT_CAP = "default-en-ja-converged.json"  # the default and its matched baseline to the 13-epoch cap, with the headline's seed 1
SUMMARIZATION = "summarization-compare/test/report/results.json"  # the four runs of the summarization comparison

QUOTES: list[Quote] = [
    # README: results at a glance
    Quote("README.md", "Results at a glance",
          r"^\| baseline: no PrLM \| ([\d.]+)M \| ([\d.]+) ± ([\d.]+) \| – \| – \| (\d+) \|$",
          (params_millions(CONTROLS, "baseline"), system(CONTROLS, "baseline", "mean"),
           system(CONTROLS, "baseline", "sd"), lambda: len(system(CONTROLS, "baseline", "runs")()))),
    seeds_row("README.md", "Results at a glance", "fused: MiniLM-L6's penultimate layer, sum after the FFN, both sides",
                 "fused", against="baseline-matched-fused"),
    seeds_row("README.md", "Results at a glance", "widened baseline: no PrLM, FFN widened to fused's parameters",
                 "baseline-matched-fused", against="–"),
    seeds_row("README.md", "Results at a glance", "fused, each sentence reading another's features",
                 "fused-shuffled", against="baseline-matched-fused"),
    Quote("README.md", "Results at a glance",
          r"still\s+falling;\s+(\d)\s+seeds\),\s+the\s+fused\s+row's\s+setting\s+reaches\s+([\d.]+) ± ([\d.]+)\s+BLEU,"
          r"\s+the\s+baseline\s+([\d.]+) ± ([\d.]+)\s+\((\S+) ± ([\d.]+),\s+p ≤ ([\d.]+)\)",
          (lambda: len(system(EN_JA, "fused", "runs")()), system(EN_JA, "fused", "mean"), system(EN_JA, "fused", "sd"),
           system(EN_JA, "baseline", "mean"), system(EN_JA, "baseline", "sd"), system(EN_JA, "fused", "delta_mean"),
           system(EN_JA, "fused", "delta_sd"), largest_p(EN_JA, "fused"))),
    Quote("README.md", "Results at a glance",
          r"fused leads it by ([\d.]+) \(p ([\d.]+), one\s+seed,\s+AMD\s+EPYC\)",
          (against_row("controls-converged.json", "fused", "baseline-matched-fused", "delta"),
           against_row("controls-converged.json", "fused", "baseline-matched-fused", "p_value"))),
    Quote("README.md", "Results at a glance",
          r"setting trails its\s+baseline\s+\((\S+), p ([\d.]+), one\s+seed\)",
          (row("ja-en.json", "fused", "delta", "bleu"), row("ja-en.json", "fused", "p_value", "bleu"))),
    Quote("README.md", "Results at a glance", r"the default leads\s+its\s+own\s+\((\S+),\s+p\s+([\d.]+),\s+one\s+seed,\s+on\s+an\s+AMD\s+EPYC\)",
          (row(DEFAULT_JA_EN, "default", "delta", "bleu"), row(DEFAULT_JA_EN, "default", "p_value", "bleu"))),
    seeds_row("README.md", "Results at a glance",
              "default†: all MiniLM-L6 layers (Concat), after add&norm1, both sides", "default",
              against="baseline-matched-default", file=DEFAULT),
    seeds_row("README.md", "Results at a glance", "widened baseline of the default†", "baseline-matched-default",
              against="–", file=DEFAULT),
    Quote("README.md", "Results at a glance", r"fused leads a baseline that reads its input by ([\d.]+) ROUGE-L, not\s+"
          r"significantly \(p ([\d.]+), one seed\)",
          (row(SUMMARIZATION, "fused", "delta", "rougeL"), row(SUMMARIZATION, "fused", "p_value", "rougeL"))),
    Quote("README.md", "Results at a glance", r"p 0\.218, one seed\), and the default by ([\d.]+) \(p ([\d.]+)\)",
          (row(SUMMARIZATION, "default", "delta", "rougeL"), row(SUMMARIZATION, "default", "p_value", "rougeL"))),
    Quote("README.md", "Results at a glance",
          r"the\s+default\s+leads\s+the\s+plain\s+baseline\s+by\s+([\d.]+)\s+BLEU\s+and\s+the\s+baseline\s+widened\s+"
          r"to\s+its\s+parameters\s+by\s+([\d.]+)\s+\(([\d.]+)\s+against\s+([\d.]+)\s+and\s+([\d.]+),\s+p\s+([\d.]+)\s+each;"
          r"\s+in\s+a\s+second\s+seed\s+it\s+leads\s+its\s+widened\s+baseline\s+by\s+([\d.]+)\)",
          (row(DEFAULT_EN_FR, "default", "delta", "bleu"),
           against_row(DEFAULT_EN_FR, "default", "baseline-matched-default", "delta"), row(DEFAULT_EN_FR, "default", "bleu"),
           row(DEFAULT_EN_FR, "baseline", "bleu"), row(DEFAULT_EN_FR, "baseline-matched-default", "bleu"),
           lambda: max(row(DEFAULT_EN_FR, "default", "p_value", "bleu")(),
                       against_row(DEFAULT_EN_FR, "default", "baseline-matched-default", "p_value")()),
           against_row(DEFAULT_EN_FR, "default.seed-2", "baseline-matched-default", "delta"))),
    Quote("README.md", "Results at a glance", r"the paper's setting \(encoder side only\) ties the plain baseline there "
          r"\(([\d.]+), p ([\d.]+)\)", (row(DEFAULT_EN_FR, "fused", "bleu"), row(DEFAULT_EN_FR, "fused", "p_value", "bleu"))),
    Quote("README.md", "Results at a glance",
          r"there the default reaches ([\d.]+) in one seed, ([\d.]+) ahead of that seed's baseline \(([\d.]+)\) and "
          r"([\d.]+) ahead of its own widened baseline \(p ([\d.]+) each, a Xeon with AMX\)",
          (row(DEFAULT_CAP, "default", "bleu"), against_row(DEFAULT_CAP, "default", "baseline", "delta"),
           row(DEFAULT_CAP, "baseline.seed-1", "bleu"),
           against_row(DEFAULT_CAP, "default", "baseline-matched-default", "delta"),
           largest(against_row(DEFAULT_CAP, "default", "baseline", "p_value"),
                   against_row(DEFAULT_CAP, "default", "baseline-matched-default", "p_value")))),
    Quote("README.md", "Results at a glance", r"each beside\s+its\s+own\s+baseline\s+\(([\d.]+) ± ([\d.]+) BLEU\)",
          (system(DEFAULT, "baseline", "mean"), system(DEFAULT, "baseline", "sd"))),
    # README: the demo
    Quote("README.md", "Quick start",
          r"its two runs train for (\d+) and (\d+) minutes side by side",
          (train_minutes(DEMO, "baseline"), train_minutes(DEMO, "fused"))),
    Quote("README.md", "Quick start",
          r"^BLEU on test \((\d+) sentences\):\n  baseline: no PrLM +([\d.]+)  \(baseline\)\n"
          r"  fused: minilm-l6 L-2, sum/ffn/both +([\d.]+)  Δ (\S+)  p=([\d.]+)\*\n  \* p < (0\.05) ",
          (row(DEMO, "fused", "num_sentences"), row(DEMO, "baseline", "bleu"), row(DEMO, "fused", "bleu"),
           row(DEMO, "fused", "delta", "bleu"), row(DEMO, "fused", "p_value", "bleu"), lambda: 0.05)),
    Quote("README.md", "Your own data", r"`layers: all` caches every hidden state: ([\d.]+) times the disk of one",
          (lambda: _json("default/cost/bible-en-minilm-l6-all.json")["size_on_disk"]
           / _json("default/cost/bible-en-minilm-l6-penultimate.json")["size_on_disk"],)),
    Quote("README.md", "Your own data", r"a training step of the default takes ([\d.]+) times the baseline's",
          (lambda: _json("default/cost/train-step-xeon-amx.json")["result"]["f_over_a"],)),
] + [
    # README: what each example file took
    Quote("README.md", "Reproducing the results", rf"^\| `{re.escape(example)}` \| [^|]+ \| (\d+) \| ([\d.]+) h \|$",
          (run_count(file), train_hours(file)))
    for example, file in [
        ("pipeline.yaml", "demo.json"),
        ("examples/results-en-ja.yaml", "en-ja.json"),
        ("examples/controls-en-ja.yaml", "controls-3000.json"),
        ("examples/controls-en-ja-converged.yaml", "controls-converged.json"),
        ("examples/default-en-ja.yaml", "default-en-ja-3000.json"),
        ("examples/table3-en-ja.yaml", "table3.json"),
        ("examples/prlm-choice-en-ja.yaml", "prlm-choice.json"),
        ("examples/default-en-ja-converged.yaml", "default/en-ja-converged/seed-1/results.json"),
        ("examples/default-en-fr-debian.yaml", DEFAULT_EN_FR),
        ("examples/default-ja-en.yaml", DEFAULT_JA_EN),
        ("examples/e5-ja-en.yaml", "ja-en.json"),
        ("examples/summarization-compare-debian.yaml", SUMMARIZATION),
    ]
]

TABLE3 = "table3.json"
PRLMS = "prlm-choice.json"
SUMMARY = "Summary"
RESULTS_MD = "docs/results.md"


QUOTES += [
    # results.md: the English->French table, each row against the plain baseline and the matched one
    Quote(RESULTS_MD, "The shipped default, beyond one corpus",
          rf"^\| {re.escape(run)} \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \| {vs_base} \| {vs_matched} \| 0\.97 \|",
          (params_millions(DEFAULT_EN_FR, run), row(DEFAULT_EN_FR, run, "bleu"), row(DEFAULT_EN_FR, run, "chrf"))
          + ((row(DEFAULT_EN_FR, run, "delta", "bleu"), row(DEFAULT_EN_FR, run, "p_value", "bleu")) if run != "baseline" else ())
          + ((against_row(DEFAULT_EN_FR, run, "baseline-matched-default", "delta"),
              against_row(DEFAULT_EN_FR, run, "baseline-matched-default", "p_value")) if run != "baseline-matched-default"
             else ()))
    for run, vs_base, vs_matched in [
        ("baseline", "–", r"(\S+) \(([\d.]+)\)"),
        ("fused", r"(\S+) \(([\d.]+)\)", r"(\S+) \(([\d.]+)\)"),
        ("default", r"\*\*(\S+) \(([\d.]+)\)\*\*", r"\*\*(\S+) \(([\d.]+)\)\*\*"),
        ("baseline-matched-default", r"(\S+) \(([\d.]+)\)", "–"),
    ]
] + [
    # results.md: the default to the 13-epoch cap, each row against the headline's seed-1 baseline and the matched one
    Quote(RESULTS_MD, "The shipped default, beyond one corpus",
          rf"^\| {re.escape(label)} \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \| {vs_base} \| {vs_matched} \| ([\d.]+) \| "
          r"([\d.]+) / ([\d.]+) / ([\d.]+) \|$",
          # the headline's seed-1 file predates trainable_parameters: its runs' sizes are those of the controls
          (params_millions(DEFAULT_CAP if run in ("default", "baseline-matched-default") else CONTROLS, run.split(".")[0]),
           row(DEFAULT_CAP, run, "bleu"), row(DEFAULT_CAP, run, "chrf"))
          + base_figures + matched_figures + (distinct_share(DEFAULT_CAP, run),)
          + tuple(epoch_dev_loss(DEFAULT_CAP, run, epoch) for epoch in (11, 12, 13)))
    for label, run, vs_base, base_figures, vs_matched, matched_figures in [
        ("baseline", "baseline.seed-1", "–", (), VS, delta_and_p(DEFAULT_CAP, "baseline.seed-1", "baseline-matched-default")),
        ("fused", "fused.seed-1", VS, delta_and_p(DEFAULT_CAP, "fused.seed-1", "baseline"),
         VS, delta_and_p(DEFAULT_CAP, "fused.seed-1", "baseline-matched-default")),
        ("default", "default", VS, delta_and_p(DEFAULT_CAP, "default", "baseline"),
         VS, delta_and_p(DEFAULT_CAP, "default", "baseline-matched-default")),
        ("baseline-matched-default", "baseline-matched-default", VS,
         delta_and_p(DEFAULT_CAP, "baseline-matched-default", "baseline"), "–", ()),
    ]
] + [
    Quote(RESULTS_MD, "The shipped default, beyond one corpus",
          r"the default's step takes ([\d.]+) times the\s+baseline's \(quartiles ([\d.]+)–([\d.]+) over\s+(\d+) "
          r"cycles\),\s+the fused setting's ([\d.]+) times,\s+so the default costs\s+no more per update than the "
          r"fused\s+setting \(([\d.]+), quartiles ([\d.]+)–([\d.]+)\)",
          tuple(step_cost(key) for key in ("f_over_a", "f_over_a_quartiles.0", "f_over_a_quartiles.1",
                                            "f_over_a_cycles_used", "e_over_a", "f_over_e", "f_over_e_quartiles.0",
                                            "f_over_e_quartiles.1"))),
    Quote(RESULTS_MD, SUMMARY, r"^\| baseline: no PrLM \| ([\d.]+)M \| ([\d.]+) ± ([\d.]+) \| – \| (\d+) \|$",
          (params_millions(CONTROLS, "baseline"), system(CONTROLS, "baseline", "mean"),
           system(CONTROLS, "baseline", "sd"), lambda: len(system(CONTROLS, "baseline", "runs")()))),
    seeds_row(RESULTS_MD, SUMMARY, "fused: MiniLM-L6's penultimate layer after the FFN, both sides", "fused"),
    seeds_row(RESULTS_MD, SUMMARY, "baseline widened to fused's parameters", "baseline-matched-fused"),
    seeds_row(RESULTS_MD, SUMMARY, "fused, each sentence reading another sentence's features", "fused-shuffled"),
    seeds_row(RESULTS_MD, SUMMARY, "fused, reading an untrained MiniLM", "fused-untrained"),
    Quote(RESULTS_MD, SUMMARY,
          r"fused reaches ([\d.]+) ± ([\d.]+) BLEU and the baseline ([\d.]+) ± ([\d.]+)\s+\((\S+) ± ([\d.]+), "
          r"p ≤ ([\d.]+), (\d) seeds\)",
          (system(EN_JA, "fused", "mean"), system(EN_JA, "fused", "sd"), system(EN_JA, "baseline", "mean"),
           system(EN_JA, "baseline", "sd"), system(EN_JA, "fused", "delta_mean"), system(EN_JA, "fused", "delta_sd"),
           largest_p(EN_JA, "fused"), lambda: len(system(EN_JA, "fused", "runs")()))),
    Quote(RESULTS_MD, SUMMARY, r"^\| layer \| Concat of every layer \| ([\d.]+) \| penultimate \| ([\d.]+) \| "
          r"(\S+) \(([\d.]+)\) \|$",
          (row(TABLE3, "layer-concat", "bleu"), row(TABLE3, "fused", "bleu"),
           against_row(TABLE3, "layer-concat", "fused", "delta"), against_row(TABLE3, "layer-concat", "fused", "p_value"))),
    Quote(RESULTS_MD, SUMMARY, r"^\| merge \| sum \| ([\d.]+) \| sum \| ([\d.]+) \| average next: (\S+) \(([\d.]+)\) \|$",
          (row(TABLE3, "fused", "bleu"), row(TABLE3, "fused", "bleu"),
           against_row(TABLE3, "merge-average", "fused", "delta"),
           against_row(TABLE3, "merge-average", "fused", "p_value"))),
    Quote(RESULTS_MD, SUMMARY, r"^\| position \| after add&norm1 \| ([\d.]+) \| after the FFN \| ([\d.]+) \| "
          r"(\S+) \(([\d.]+)\) \|$",
          (row(TABLE3, "position-add-norm1", "bleu"), row(TABLE3, "fused", "bleu"),
           against_row(TABLE3, "position-add-norm1", "fused", "delta"),
           against_row(TABLE3, "position-add-norm1", "fused", "p_value"))),
    Quote(RESULTS_MD, SUMMARY, r"^\| side \| both \| ([\d.]+) \| source \| ([\d.]+) \| (\S+) \(([\d.]+)\) \|$",
          (row(TABLE3, "fused", "bleu"), row(TABLE3, "side-source", "bleu"),
           against_row(TABLE3, "side-source", "fused", "delta", sign=-1.0),
           against_row(TABLE3, "side-source", "fused", "p_value"))),
] + [
    seeds_row(RESULTS_MD, SUMMARY, "default", "default", file=DEFAULT),
    seeds_row(RESULTS_MD, SUMMARY, "baseline widened to the default's parameters", "baseline-matched-default",
              file=DEFAULT),
    Quote(RESULTS_MD, SUMMARY, r"^\| its own baseline \| ([\d.]+)M \| ([\d.]+) ± ([\d.]+) \| – \| (\d+) \|$",
          (params_millions(DEFAULT, "baseline"), system(DEFAULT, "baseline", "mean"), system(DEFAULT, "baseline", "sd"),
           lambda: len(system(DEFAULT, "baseline", "runs")()))),
] + [
    Quote(RESULTS_MD, SUMMARY, rf"^\| {re.escape(label)} \| ([\d.]+) \| (\S+) \(([\d.]+)\) \|$",
          (row(PRLMS, run, "bleu"), row(PRLMS, run, "delta", "bleu"), row(PRLMS, run, "p_value", "bleu")))
    for label, run in [("MiniLM-L6 (all-MiniLM-L6-v2)", "fused"), ("multilingual-e5-small, from a 4-bit file", "prlm-e5"),
                       ("SmolLM2-135M-Instruct, from Q4_1, a causal LM", "prlm-smollm2")]
] + [
    Quote(RESULTS_MD, SUMMARY, r"fused trails its baseline,\n  ([\d.]+) against ([\d.]+) BLEU \((\S+), p ([\d.]+);",
          (row("ja-en.json", "fused", "bleu"), row("ja-en.json", "baseline", "bleu"),
           row("ja-en.json", "fused", "delta", "bleu"), row("ja-en.json", "fused", "p_value", "bleu"))),
    Quote(RESULTS_MD, SUMMARY, r"does pay there: ([\d.]+) against its own baseline's ([\d.]+) \((\S+), p ([\d.]+)\)",
          (row(DEFAULT_JA_EN, "default", "bleu"), row(DEFAULT_JA_EN, "baseline", "bleu"),
           row(DEFAULT_JA_EN, "default", "delta", "bleu"), row(DEFAULT_JA_EN, "default", "p_value", "bleu"))),
    Quote(RESULTS_MD, SUMMARY,
          r"default reaches ([\d.]+) BLEU against the plain baseline's ([\d.]+) \((\S+), p ([\d.]+)\) and the widened "
          r"baseline's ([\d.]+) \((\S+), p ([\d.]+)\); the paper's setting ties the plain baseline there \(([\d.]+), (\S+), "
          r"p ([\d.]+)\)",
          (row(DEFAULT_EN_FR, "default", "bleu"), row(DEFAULT_EN_FR, "baseline", "bleu"),
           row(DEFAULT_EN_FR, "default", "delta", "bleu"), row(DEFAULT_EN_FR, "default", "p_value", "bleu"),
           row(DEFAULT_EN_FR, "baseline-matched-default", "bleu"),
           against_row(DEFAULT_EN_FR, "default", "baseline-matched-default", "delta"),
           against_row(DEFAULT_EN_FR, "default", "baseline-matched-default", "p_value"),
           row(DEFAULT_EN_FR, "fused", "bleu"), row(DEFAULT_EN_FR, "fused", "delta", "bleu"),
           row(DEFAULT_EN_FR, "fused", "p_value", "bleu"))),
    Quote(RESULTS_MD, SUMMARY, r"the default reaches ([\d.]+) BLEU: \+([\d.]+) on the plain baseline, \+([\d.]+) on the "
          r"widened one, \+([\d.]+) on fused \(p ([\d.]+) each\)",
          (row(DEFAULT_CAP, "default", "bleu"), against_row(DEFAULT_CAP, "default", "baseline", "delta"),
           against_row(DEFAULT_CAP, "default", "baseline-matched-default", "delta"),
           against_row(DEFAULT_CAP, "fused.seed-1", "default", "delta", sign=-1.0),
           largest(against_row(DEFAULT_CAP, "default", "baseline", "p_value"),
                   against_row(DEFAULT_CAP, "default", "baseline-matched-default", "p_value"),
                   against_row(DEFAULT_CAP, "fused.seed-1", "default", "p_value")))),
    Quote(RESULTS_MD, SUMMARY, r"In a second seed the default leads its widened baseline by ([\d.]+) \(([\d.]+) against "
          r"([\d.]+), p ([\d.]+)\)",
          (against_row(DEFAULT_EN_FR, "default.seed-2", "baseline-matched-default", "delta"),
           row(DEFAULT_EN_FR, "default.seed-2", "bleu"), row(DEFAULT_EN_FR, "baseline-matched-default.seed-2", "bleu"),
           against_row(DEFAULT_EN_FR, "default.seed-2", "baseline-matched-default", "p_value"))),
    # results.md: English->French's seed 2, the default against its own seed's matched baseline
    Quote(RESULTS_MD, "The shipped default, beyond one corpus",
          r"the default reaches ([\d.]+) BLEU \(chrF ([\d.]+)\) against the matched baseline's ([\d.]+) \(([\d.]+)\), a "
          r"lead of ([\d.]+)\n\(p ([\d.]+)\), and its dev loss at the seventh epoch's end is ([\d.]+) against ([\d.]+)\.",
          (row(DEFAULT_EN_FR, "default.seed-2", "bleu"), row(DEFAULT_EN_FR, "default.seed-2", "chrf"),
           row(DEFAULT_EN_FR, "baseline-matched-default.seed-2", "bleu"),
           row(DEFAULT_EN_FR, "baseline-matched-default.seed-2", "chrf"),
           *delta_and_p(DEFAULT_EN_FR, "default.seed-2", "baseline-matched-default"),
           epoch_dev_loss(DEFAULT_EN_FR, "default.seed-2", 7),
           epoch_dev_loss(DEFAULT_EN_FR, "baseline-matched-default.seed-2", 7))),
    Quote(RESULTS_MD, SUMMARY, r"on English→French Debian descriptions its whole setting \(penultimate layer, FFN, encoder "
          r"side\) ties the plain baseline \((\S+), p ([\d.]+)\)",
          (row(DEFAULT_EN_FR, "fused", "delta", "bleu"), row(DEFAULT_EN_FR, "fused", "p_value", "bleu"))),
    Quote(RESULTS_MD, SUMMARY, r"for ([\d.]+)% of the full grid's updates", (lambda: 100 * _json(SEARCH_TRIALS)["share_of_full_grid"],)),
    Quote(RESULTS_MD, SUMMARY, r"both sides: \+([\d.]+) BLEU\non its baseline, \+([\d.]+) on the widened one \(p ([\d.]+) each\)",
          (row(SEARCH, "search-best", "delta", "bleu"), against_row(SEARCH, "search-best", "search-baseline-matched", "delta"),
           lambda: max(row(SEARCH, "search-best", "p_value", "bleu")(),
                       against_row(SEARCH, "search-best", "search-baseline-matched", "p_value")()))),
    Quote(RESULTS_MD, SUMMARY, r"the shipped default, ([\d.]+) ahead of that choice \(p ([\d.]+)\)",
          (against_row(SEARCH, "search-best", "default", "delta", sign=-1.0),
           against_row(SEARCH, "search-best", "default", "p_value"))),
    Quote(RESULTS_MD, SUMMARY, r"encoder-only side trails the baseline here \((\S+), p ([\d.]+)\)",
          (row(TABLE3, "side-source", "delta", "bleu"), row(TABLE3, "side-source", "p_value", "bleu"))),
    Quote(RESULTS_MD, SUMMARY, r"reads its input \(ROUGE-L ([\d.]+), (\d+) distinct synopses of (\d+)\), fused MiniLM-L6 at the "
          r"headline's setting leads by ([\d.]+) ROUGE-L, not significantly \(p ([\d.]+); \+([\d.]+) as the mean over ROUGE-1/2/L",
          (row(SUMMARIZATION, "baseline", "rougeL"), row(SUMMARIZATION, "baseline", "distinct_hypotheses"),
           row(SUMMARIZATION, "baseline", "num_sentences"), row(SUMMARIZATION, "fused", "delta", "rougeL"),
           row(SUMMARIZATION, "fused", "p_value", "rougeL"),
           lambda: sum(row(SUMMARIZATION, "fused", m)() - row(SUMMARIZATION, "baseline", m)()
                       for m in ("rouge1", "rouge2", "rougeL")) / 3)),
    Quote(RESULTS_MD, SUMMARY, r"the shipped default leads it by ([\d.]+) \(p ([\d.]+)\), its dev loss still falling",
          (row(SUMMARIZATION, "default", "delta", "rougeL"), row(SUMMARIZATION, "default", "p_value", "rougeL"))),
]

# Numbers in a checked section that state the conditions of a result, not a result: no quote needed.
CONDITIONS = {
    "README.md": [r"678 verses", r"256 wide, 3\+3 layers", r"3,000 updates", r"seeds 1–3", r"2-core", r"seed 1 on", r"seeds 2–3",
                  r"13-epoch", r"MiniLM-L6", r"\be5\b", r"ja-mecab", r"beam 5", r"1,200 updates",
                  r"Python ≥ 3\.11", r"2-core Xeon", r"L-2", r"torch 2\.4–2\.15", r"\(2021\)", r"3\+3", r"Table 3", r"add&norm1",
                  r"seed 1 on a 2-core", r"seeds 2–3", r"L6", r"12,500\s+updates"],
}
CONDITIONS[RESULTS_MD] = [r"678 verses", r"3,000 updates", r"seeds 1–3", r"seed 1\b", r"2-core", r"13-epoch",
                          r"MiniLM-L6", r"e5-small", r"SmolLM2-135M", r"add&norm1", r"4-bit", r"Q4_1", r"width 256",
                          r"seed 1 on", r"seeds\n2–3", r"beam 5", r"Table 3",
                          r"\(ja-mecab\)", r"third of four", r"12 settings", r"seeds 2–3",
                          r"width 256, 5,000 updates", r"up to \+1\.8", r"ROUGE-1/2/L", r"12,500 updates"]
CHECKED_SECTIONS = {"README.md": ["Results at a glance", "Quick start", "Reproducing the results"],
                    RESULTS_MD: [SUMMARY]}


def section(doc: str, heading: str) -> tuple[str, int]:
    """The text under `## heading` up to the next heading of that level or higher, and its offset."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match, f"{doc} has no section {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end(): end.start() if end else len(text)], match.end()


def printed_value(text: str) -> tuple[float, int]:
    """A printed figure as a number and its decimal places (Unicode minus and thousands commas read)."""
    clean = text.replace("−", "-").replace(",", "")
    decimals = len(clean.split(".")[1]) if "." in clean else 0
    return float(clean), decimals


def check_figure(printed: str, value: float) -> str | None:
    number, decimals = printed_value(printed)
    if abs(number - value) > 0.5 * 10 ** -decimals + 1e-9:
        return f"printed {printed}, the JSON gives {value!r}"
    return None


def quote_spans(doc: str, heading: str) -> list[tuple[int, int]]:
    text, _ = section(doc, heading)
    spans = []
    for quote in (q for q in QUOTES if q.doc == doc and q.section == heading):
        matches = list(re.finditer(quote.pattern, text, re.M))
        assert len(matches) == 1, f"{doc}, {heading!r}: {quote.pattern!r} matched {len(matches)} times, not once"
        spans += [matches[0].span(i) for i in range(1, len(quote.figures) + 1)]
    return spans


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: f"{q.doc}:{q.section}:{q.pattern[:40]}")
def test_each_quoted_figure_equals_its_json_field_at_the_printed_rounding(quote):
    text, _ = section(quote.doc, quote.section)
    matches = list(re.finditer(quote.pattern, text, re.M))
    assert len(matches) == 1, f"{quote.pattern!r} matched {len(matches)} times in {quote.doc}, {quote.section!r}"
    assert len(matches[0].groups()) == len(quote.figures)
    wrong = [f"figure {i + 1}: {problem}" for i, (printed, get) in enumerate(zip(matches[0].groups(), quote.figures))
             if (problem := check_figure(printed, get())) is not None]
    assert not wrong, f"{quote.doc}, {quote.section!r}: " + "; ".join(wrong)


@pytest.mark.parametrize("doc,heading", [(d, h) for d, hs in CHECKED_SECTIONS.items() for h in hs])
def test_every_number_of_a_checked_section_is_a_quote_or_a_condition(doc, heading):
    text, _ = section(doc, heading)
    covered = quote_spans(doc, heading)
    for pattern in CONDITIONS[doc]:
        covered += [m.span() for m in re.finditer(pattern, text)]
    # Link targets, code spans and shell blocks name files and commands, not figures.
    for skip in (r"\]\([^)]*\)", r"`[^`\n]*`", r"```bash\n.*?```"):
        covered += [m.span() for m in re.finditer(skip, text, re.S)]
    loose = []
    for number in re.finditer(r"(?<![\w.])\d(?:[\d,.]*\d)?(?!\w)", text):
        if not any(start <= number.start() and number.end() <= end for start, end in covered):
            line = text.count("\n", 0, number.start())
            loose.append(f"{number.group()!r} in line {line + 1} of the section: {text.splitlines()[line][:80]!r}")
    assert not loose, f"{doc}, {heading!r}: numbers no quote checks:\n" + "\n".join(loose)


def test_a_changed_figure_fails_its_check():
    """The check itself: a figure off by more than its rounding is named, one within it is not."""
    assert check_figure("9.24", 9.2449) is None
    assert check_figure("9.25", 9.2449) is not None
    assert check_figure("−0.91", -0.906) is None
    assert check_figure("+0.91", -0.906) is not None
    assert check_figure("17.9", 17.94) is None


@pytest.mark.parametrize("example,probe", [
    ("examples/default-en-fr-debian.yaml", "default/en-fr-debian/baseline-probe-dev-loss.json"),
    ("examples/default-en-de-debian.yaml", "default/en-de-debian/baseline-probe-dev-loss.json"),
])
def test_each_corpus_budget_is_where_its_probe_first_gained_under_the_threshold(example, probe):
    """The budget an example file trains to is the first dev evaluation of its probe's committed curve whose gain
    fell under the threshold (`prlmfuse train curve`'s rule), as the file's header says."""
    curve = _json(probe)
    first_flat = next(update for update, _, gain in curve["points"] if gain is not None and gain < curve["below"])
    assert curve["flat_at"] == curve["budget"] == first_flat
    config = yaml.safe_load((ROOT / example).read_text(encoding="utf-8"))
    assert config["train"]["defaults"]["max_updates"] == first_flat
    assert config["train"]["defaults"]["max_epochs"] is None
