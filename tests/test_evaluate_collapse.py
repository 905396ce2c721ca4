"""Collapse in the outputs: the distinct share, the most frequent hypothesis's count and the copy share, in every
results row and table, with a warning in the summary; `report` shows them, also for a results.json without them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from prlmfuse.evaluate.evaluation import score_hypotheses
from prlmfuse.evaluate.report import merge_evaluations
from prlmfuse.evaluate.results import EvaluationResults, RunResult, hypothesis_figures, write_results
from prlmfuse.evaluate.summary import summary_lines
from prlmfuse.fileio import sha256_file

# 10 inputs, 3 distinct outputs, one of them written 6 times.
COLLAPSED = ["a tool for images"] * 6 + ["a library"] * 3 + ["the manual"]
HEALTHY = [f"a tool for image format {i}" for i in range(10)]
SOURCES = [f"A tool for reading image format {i}, and a library." for i in range(10)]
REFERENCES = [f"tool for image format {i}" for i in range(10)]
SETTINGS = {"beam": 5, "lenpen": 1.0, "average_last": 5, "average": "epochs", "bootstrap_samples": 100,
            "seed": 12345, "test_sets": ["test"], "bleu_tokenize": None, "machine": "a test"}
NEW_FIELDS = ("distinct_hypotheses", "distinct_share", "top_hypothesis_count", "copy_share")


def test_a_collapsed_run_gives_its_share_and_most_frequent_count():
    figures = hypothesis_figures(COLLAPSED, task="translation")
    assert figures == {"distinct_hypotheses": 3, "distinct_share": 0.3, "top_hypothesis_count": 6,
                       "copy_share": None}
    assert hypothesis_figures(HEALTHY, task="translation")["distinct_share"] == 1.0
    assert hypothesis_figures(HEALTHY, task="translation")["top_hypothesis_count"] == 1


def test_copy_share_counts_hypothesis_words_found_in_their_own_source():
    sources = ["Library for reading and writing images", "Библиотека для чтения", "nothing in common"]
    hyps = ["library for writing PNG images.",  # library, for, writing, images of 5 words: casefolded, "." dropped
            "БИБЛИОТЕКА изображений",  # 1 of 2: casefolding is unicode-aware
            "for images"]  # 0 of 2: words of another line's source do not count
    assert hypothesis_figures(hyps, sources, task="summarization")["copy_share"] == 5 / 9
    # Translation copies nothing worth counting, and report has no sources: no copy share.
    assert hypothesis_figures(hyps, sources, task="translation")["copy_share"] is None
    assert hypothesis_figures(hyps, task="summarization")["copy_share"] is None


def _row(run: str, hyps: list[str], *, task: str = "translation", folder: Path | None = None,
         sources: list[str] | None = None) -> RunResult:
    """A row as `evaluate` writes it for these hypotheses; with a folder, its hypotheses, references and scores
    as `report` checks them."""
    scores = {"bleu": 20.0, "chrf": 40.0, "rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "signature": {}}
    files = {}
    if folder is not None:
        (folder / f"hyp.{run}.test.txt").write_text("".join(h + "\n" for h in hyps))
        (folder / "ref.test.txt").write_text("".join(r + "\n" for r in REFERENCES))
        scores, _ = score_hypotheses(hyps, REFERENCES, tgt_lang="en", task=task, bleu_tokenize=None)
        files = {"hyp_sha256": sha256_file(folder / f"hyp.{run}.test.txt"), "ref_file": "ref.test.txt",
                 "ref_sha256": sha256_file(folder / "ref.test.txt"), "corpus_sha256": "c0ffee"}
    return RunResult(
        run=run, test_set="test", run_dir=f"/nowhere/{run}", task=task, prlm="-", layer="-", merge="-", position="-",
        side="-", num_sentences=len(hyps), bleu=scores["bleu"], chrf=scores["chrf"], rouge1=scores["rouge1"],
        rouge2=scores["rouge2"], rougeL=scores["rougeL"], sentences_per_s=1.0, tokens_per_s=1.0, decode_seconds=1.0,
        checkpoints=[], hyp_file=f"hyp.{run}.test.txt", reused=False, signature=scores["signature"],
        main_metric="rougeL" if task == "summarization" else "bleu", tgt_lang="en",
        **files, **hypothesis_figures(hyps, sources, task=task))


def test_the_summary_warns_of_a_collapsed_run_only(tmp_path):
    results = EvaluationResults(tmp_path, "healthy", [_row("healthy", HEALTHY), _row("collapsed", COLLAPSED)],
                                SETTINGS)
    lines = summary_lines(results)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == ["warning: collapsed wrote 3/10 distinct outputs on test, one of them 6 times: "
                        "it may ignore its input"]
    healthy_only = EvaluationResults(tmp_path, "healthy", [_row("healthy", HEALTHY)], SETTINGS)
    assert not any("warning" in line for line in summary_lines(healthy_only))
    # A run with exactly half its inputs distinct is not warned of: fewer than half is.
    half = ["x"] * 6 + [str(i) for i in range(4)]
    assert not any("warning" in line for line in summary_lines(
        EvaluationResults(tmp_path, None, [_row("half", half)], SETTINGS)))
    unscored = EvaluationResults(tmp_path, "healthy", [_row("collapsed", COLLAPSED)], {**SETTINGS, "scored": False})
    assert any(line.startswith("warning: collapsed wrote 3/10") for line in summary_lines(unscored))


def test_the_summary_names_the_baseline_behind_each_delta_where_it_is_not_the_named_one(tmp_path):
    def compared(run: str, seed: int, against: str | None) -> RunResult:
        row = replace(_row(run, HEALTHY), seed=seed)
        return row if against is None else replace(row, delta={"bleu": 1.0}, p_value={"bleu": 0.01},
                                                  compared_with=against)

    one_seed = [compared("baseline", 1, None), compared("fused", 1, "baseline")]
    lines = summary_lines(EvaluationResults(tmp_path, "baseline", one_seed, SETTINGS))
    assert lines[-3] == "  * p < 0.05 (paired bootstrap against the baseline)" and not any(" vs " in x for x in lines)
    # With a baseline per seed, fused.seed-2 was compared with baseline.seed-2, baseline.seed-2 with the named one.
    seeds = one_seed + [compared("baseline.seed-2", 2, "baseline"), compared("fused.seed-2", 2, "baseline.seed-2")]
    lines = summary_lines(EvaluationResults(tmp_path, "baseline", seeds, SETTINGS))
    assert lines[-3] == "  * p < 0.05 (paired bootstrap against the baseline, or the run named after vs)"
    scores = {line.split(":")[0].strip(): line for line in lines if line.startswith("  ") and "Δ" in line}
    assert scores["fused.seed-2"].endswith("p=0.010*  vs baseline.seed-2")
    assert scores["baseline.seed-2"].endswith("p=0.010*") and scores["fused"].endswith("p=0.010*")


@pytest.mark.parametrize("task", ["translation", "summarization"])
def test_every_results_file_holds_the_figures_whatever_the_metric(tmp_path, task):
    sources = SOURCES if task == "summarization" else None
    rows = [_row("healthy", HEALTHY, task=task, sources=sources), _row("collapsed", COLLAPSED, task=task, sources=sources)]
    write_results(EvaluationResults(tmp_path, "healthy", rows, SETTINGS))
    data = {r["run"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert (data["collapsed"]["distinct_share"], data["collapsed"]["top_hypothesis_count"]) == (0.3, 6)
    assert (data["healthy"]["distinct_share"], data["healthy"]["top_hypothesis_count"]) == (1.0, 1)
    md = (tmp_path / "results.md").read_text()
    csv = (tmp_path / "results.csv").read_text()
    assert "distinct_share,top_hypothesis_count,copy_share" in csv.splitlines()[0]
    if task == "summarization":
        # healthy: all 6 of its words in its source on each line; collapsed: "a tool for" 3 of 4 words ("images" is
        # not "image") six times, "a library" 2 of 2 three times, "the manual" 0 of 2: 24 of 32.
        assert (data["healthy"]["copy_share"], data["collapsed"]["copy_share"]) == (1.0, 24 / 32)
        assert "| distinct share | top hyp count | copy share |" in md
        assert "| 0.30 | 6 | 0.75 |" in md
    else:
        assert data["collapsed"]["copy_share"] is None
        assert "| distinct share | top hyp count | params |" in md and "copy share" not in md
        assert "| 0.30 | 6 | -" in md


def _evaluation(folder: Path, task: str) -> Path:
    """A results.json `report` accepts: a healthy and a collapsed run scored on made-up references."""
    folder.mkdir()
    sources = SOURCES if task == "summarization" else None
    rows = [_row("healthy", HEALTHY, task=task, folder=folder, sources=sources),
            _row("collapsed", COLLAPSED, task=task, folder=folder, sources=sources)]
    write_results(EvaluationResults(folder, "healthy", rows, SETTINGS))
    return folder / "results.json"


@pytest.mark.parametrize("task", ["translation", "summarization"])
def test_report_shows_the_figures_and_reads_a_results_json_without_them(tmp_path, task):
    results = _evaluation(tmp_path / "in", task)
    merged = merge_evaluations([results], tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    copy = {"summarization": " | copy share", "translation": ""}[task]
    assert f"| chrF | distinct share | top hyp count{copy} | params |" in md
    collapsed = next(line for line in md.splitlines() if line.startswith("| collapsed |"))
    assert "| 0.30 | 6 |" + (" 0.75 |" if task == "summarization" else " - |") in collapsed
    row = next(r for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
               if r["run"] == "collapsed")
    assert (row["distinct_share"], row["top_hypothesis_count"]) == (0.3, 6)
    assert merged.rows[0].run == "healthy"

    # A results.json written before the figures were recorded: the share and count come from its (checked)
    # hypothesis file; the copy share, which needs the sources, is shown empty.
    data = json.loads(results.read_text())
    for r in data["rows"]:
        for name in NEW_FIELDS:
            del r[name]
    old = results.with_name("old.json")
    old.write_text(json.dumps(data))
    merge_evaluations([old], tmp_path / "old-out")
    md = (tmp_path / "old-out" / "results.md").read_text()
    collapsed = next(line for line in md.splitlines() if line.startswith("| collapsed |"))
    assert "| 0.30 | 6 | - |" in collapsed
    row = next(r for r in json.loads((tmp_path / "old-out" / "results.json").read_text())["rows"]
               if r["run"] == "collapsed")
    assert (row["distinct_share"], row["top_hypothesis_count"], row["copy_share"]) == (0.3, 6, None)
