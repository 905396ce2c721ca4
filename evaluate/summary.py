"""The few lines a person reads after an evaluation: where the results are, each run's score with its
delta and p against the baseline, a warning for each run that writes few distinct outputs, two test
sentences translated by every run beside the reference, and the plots. The library returns the text;
the CLI prints it."""

from __future__ import annotations

from prlmfuse.corpora import load_corpus
from prlmfuse.errors import UserError
from prlmfuse.evaluate.results import SIGNIFICANCE, EvaluationResults, RunResult, is_significant, row_label
from prlmfuse.fileio import read_lines
from prlmfuse.train_fused import run_dir as rundir

# Examples are the first test lines whose source has this many words: typical sentences, chosen
# by position so that no run is favoured by the choice.
_EXAMPLE_WORDS = (6, 25)
_EXAMPLES = 2
_SHOWN_CHARS = 220
# A run that writes fewer distinct outputs than this share of its inputs gets a warning: a model that
# ignores its input writes the same few lines for every input, which a score alone does not show.
COLLAPSE_SHARE = 0.5


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def _example_lines(sources: list[str]) -> list[int]:
    low, high = _EXAMPLE_WORDS
    typical = [i for i, s in enumerate(sources) if low <= len(s.split()) <= high]
    return (typical or list(range(len(sources))))[:_EXAMPLES]


def collapse_warnings(rows: list[RunResult]) -> list[str]:
    """One line for each run and test set with fewer distinct hypotheses than COLLAPSE_SHARE of its inputs."""
    lines = []
    for r in rows:
        if r.distinct_hypotheses is None or r.distinct_hypotheses >= COLLAPSE_SHARE * r.num_sentences:
            continue
        top = "" if r.top_hypothesis_count is None else f", one of them {r.top_hypothesis_count} times"
        lines.append(f"warning: {r.run} wrote {r.distinct_hypotheses}/{r.num_sentences} distinct outputs on "
                     f"{r.test_set}{top}: it may ignore its input")
    return lines


def summary_lines(results: EvaluationResults) -> list[str]:
    """Results file, scores with delta and p, a warning for each run that writes few distinct outputs,
    two examples side by side with the reference, plot paths."""
    files = results.files
    lines = [f"results: {files['results.md']}"]
    if not results.rows:
        return lines
    split = results.rows[0].test_set
    rows = [r for r in results.rows if r.test_set == split]
    metric = rows[0].main_metric
    metric_name = {"bleu": "BLEU", "rougeL": "ROUGE-L"}.get(metric, metric)
    labels = {r.run: row_label(r) for r in rows}
    width = max(len(label) for label in labels.values())
    if results.settings.get("scored") is False:
        lines.append(f"decoded {split} ({rows[0].num_sentences} sentences) without scoring: "
                     f"prlmfuse score {results.out}")
        return lines + collapse_warnings(results.rows)
    lines.append(f"{metric_name} on {split} ({rows[0].num_sentences} sentences):")
    for r in rows:
        score = f"  {labels[r.run]:<{width}}  {getattr(r, metric):6.2f}"
        if metric in r.delta:
            star = "*" if is_significant(r, metric) else ""
            score += f"  Δ {r.delta[metric]:+.2f}  p={r.p_value[metric]:.3f}{star}"
            if r.compared_with not in (None, results.baseline):  # the baseline run of this run's own seed
                score += f"  vs {r.compared_with}"
        elif r.run == results.baseline:
            score += "  (baseline)"
        lines.append(score)
    deltas = [r for r in rows if metric in r.delta]
    if deltas:
        other = any(r.compared_with not in (None, results.baseline) for r in deltas)
        against = "the baseline, or the run named after vs" if other else "the baseline"
        lines.append(f"  * p < {SIGNIFICANCE:g} (paired bootstrap against {against})")
    lines += collapse_warnings(results.rows)

    plots = ", ".join(str(files[name]) for name in ("scores.png", "dev_loss.png") if files[name].is_file())
    try:
        corpus = load_corpus(rundir.read_run_info(rows[0].run_dir)["corpus"]["root"])
    except (OSError, UserError):  # scored away from the runs (`prlmfuse score`): no sources to show
        return lines + ["", f"plots: {plots}"]
    sources, references = read_lines(corpus.src_path(split)), read_lines(corpus.tgt_path(split))
    hyps = {r.run: read_lines(results.out / r.hyp_file, check_text=False) for r in rows}  # our own output, any text
    names = ["source", "reference", *hyps]
    name_width = max(len(n) for n in names)
    for i in _example_lines(sources):
        lines += ["", f"example: {split} line {i + 1}"]
        lines.append(f"  {'source':<{name_width}}  {_clip(sources[i])}")
        lines.append(f"  {'reference':<{name_width}}  {_clip(references[i])}")
        lines += [f"  {run:<{name_width}}  {_clip(h[i]) if i < len(h) else ''}" for run, h in hyps.items()]
    lines += ["", f"plots: {plots}"]
    return lines
