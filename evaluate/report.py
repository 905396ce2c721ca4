"""One table from evaluations made apart: seeds trained as separate jobs, on other days or other machines.

Each input is a results.json that `evaluate` wrote, read together with the files it names beside it:
each run's hypotheses (`hyp_file`) and the test set's references (`ref_file`), both checked by sha256.
The inputs must have been scored alike: the same test sets and references, the same training corpus,
the same metrics (sacrebleu and ROUGE signatures) and the same decoding and bootstrap settings; a
difference is refused in one line that names it, and so is a stored score its hypotheses do not give here.
Each fused run keeps the baseline its evaluation compared it with (the baseline of its own seed where the
grid has one, or of its own batch: runs of one name with other hypotheses in several files, such as each
batch's `baseline`, are told apart by their file's name); a run compared with another seed's baseline is
compared with its own seed's where another file holds it. Its paired-bootstrap p is computed again here from
the hypothesis files, and each system (a run name without its `.seed-N`) gets the mean and sample standard
deviation of its scores over seeds, one row per seed.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.evaluate.bootstrap import add_bootstrap
from prlmfuse.evaluate.metrics import comparison_stats
from prlmfuse.evaluate.results import (SIGNIFICANCE, EvaluationResults, RunResult, format_parameters,
                                       hypothesis_cells, hypothesis_headers, json_safe, refresh_hypothesis_figures,
                                       results_csv)
from prlmfuse.evaluate.seeds import (AgainstSummary, SystemSummary, against_over_seeds, system_of,
                                     systems_over_seeds)
from prlmfuse.fileio import atomic_write_json, atomic_write_text, read_json, read_lines, sha256_file

logger = logging.getLogger(__name__)

# Settings two evaluations must share for their rows to stand in one table (the machine may differ).
SHARED_SETTINGS = ("beam", "lenpen", "average_last", "average", "at_update", "max_len_a", "max_len_b", "min_len",
                   "no_repeat_ngram_size", "bf16", "bleu_tokenize", "bootstrap_samples", "seed", "test_sets")
# What every row of one test set must share, with how a refusal names it.
SHARED_PER_TEST_SET = {"ref_sha256": "references", "num_sentences": "number of sentences",
                       "corpus_sha256": "training corpus", "main_metric": "main metric", "signature": "metric signatures",
                       "tgt_lang": "target language", "task": "task"}
# Settings the merge itself reads (the bootstrap is run again; the table names the decoding).
REQUIRED_SETTINGS = ("beam", "lenpen", "average_last", "bootstrap_samples", "seed", "test_sets")
_WRITTEN_BY_AN_OLDER_PRLMFUSE = ("it was written by an older prlmfuse; evaluate the runs again (their hypotheses "
                                 "are reused) to record what a merge checks")
SCORE_TOLERANCE = 1e-3  # a stored score and the same hypotheses scored again agree to rounding


@dataclass
class Evaluation:
    """One input: a results.json and the folder its hypothesis and reference files are read from."""

    path: Path
    baseline: str | None
    settings: dict
    rows: list[RunResult]

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def machine(self) -> str:
        return str(self.settings.get("machine") or "machine not recorded")


@dataclass
class Report:
    out: Path
    inputs: list[Evaluation]
    rows: list[RunResult]  # with the file each came from in `sources`
    sources: dict[str, Path]  # run -> results.json it came from
    systems: list[SystemSummary] = field(default_factory=list)
    # each row against a run named with --against: {run, test_set, against, against_run, delta, p_value}
    # (metric -> value); against_run is the run of that name in the row's own file where several files hold one,
    # and that system's run of the row's own seed where another seed's was named
    against: list[dict] = field(default_factory=list)
    against_systems: list[AgainstSummary] = field(default_factory=list)

    @property
    def files(self) -> dict[str, Path]:
        return {name: self.out / name for name in ("results.md", "results.csv", "results.json", "scores.png")}


def read_evaluation(path: str | Path, *, unscored: bool = False) -> Evaluation:
    """A results.json written by `evaluate`, with every row's hypothesis and reference files checked.

    unscored: also accept one decoded by `evaluate --no-score` (what `prlmfuse score` reads)."""
    path = Path(path)
    data = read_json(path, what="evaluation results")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not isinstance(data.get("settings"), dict):
        raise UserError(f"{path} is not a results.json written by `prlmfuse evaluate` (no rows and settings)")
    if data["settings"].get("scored") is False and not unscored:
        raise UserError(f"{path} holds hypotheses decoded without scores (`evaluate --no-score`); score them first: "
                        f"prlmfuse score {path}")
    known = {f.name for f in fields(RunResult)}
    rows = []
    for d in data["rows"]:
        missing = [k for k in ("hyp_file", "hyp_sha256", "ref_file", "ref_sha256", "corpus_sha256") if not d.get(k)]
        if missing:
            raise UserError(f"{path}: run {d.get('run', '?')} records no {missing[0]}: {_WRITTEN_BY_AN_OLDER_PRLMFUSE}")
        values = {k: (float("nan") if v is None and k in _FLOAT_FIELDS else v) for k, v in d.items() if k in known}
        rows.append(RunResult(**{"reused": False, **values}))
    lacking = [k for k in REQUIRED_SETTINGS if data["settings"].get(k) is None]
    if lacking:
        raise UserError(f"{path}: its settings record no {lacking[0]}: {_WRITTEN_BY_AN_OLDER_PRLMFUSE}")
    evaluation = Evaluation(path, data.get("baseline"), data["settings"], rows)
    for row in rows:
        for name, digest, what in ((row.hyp_file, row.hyp_sha256, "hypothesis"), (row.ref_file, row.ref_sha256, "reference")):
            file = evaluation.folder / name
            if not file.is_file():
                raise UserError(f"{path}: the {what} file {name} of run {row.run} is missing from {evaluation.folder}; "
                                "copy it beside the results.json it belongs to")
            if sha256_file(file) != digest:
                raise UserError(f"{path}: the {what} file {file} of run {row.run} is not the one that was scored "
                                "(its sha256 differs); restore the file the evaluation wrote")
    return evaluation


_FLOAT_FIELDS = {f.name for f in fields(RunResult) if f.type in ("float", float)}


def _first_difference(a: Evaluation, b: Evaluation) -> str | None:
    for key in SHARED_SETTINGS:
        mine, theirs = a.settings.get(key), b.settings.get(key)
        if key == "test_sets" and isinstance(mine, list) and isinstance(theirs, list):
            mine, theirs = sorted(mine), sorted(theirs)  # the same sets named in another order score alike
        if mine != theirs:
            return f"{key} {b.settings.get(key)!r} in {b.path}, {a.settings.get(key)!r} in {a.path}"
    return None


def merge_evaluations(paths: list[str | Path], out: str | Path, against: list[str] | tuple[str, ...] = (),
                      *, write: bool = True) -> Report:
    """Read, check and merge the results.json files at `paths`; write the merged report into `out` (with
    `write`; else the caller writes it with `write_report` once whatever else it writes has been checked).

    against: runs every other row is also compared with (Δ and paired-bootstrap p on the same resampled
    test sets), e.g. a table's default setting, so that rows differing from it in one factor are compared directly.
    Where several files each hold their own run of that name (each batch's `fused`), a row is compared with the
    one of its own file; a row of another seed is compared with that system's run of its own seed (`fused.seed-2`)
    where one is in the files, as with baselines. A system's name (`fused` for runs `fused.seed-N`) names its run of
    each row's seed; rows of a seed it has no run of are not compared.
    """
    if not paths:
        raise UserError("no results.json given; pass the results of at least one evaluation")
    inputs = [read_evaluation(p) for p in paths]
    first = inputs[0]
    for other in inputs[1:]:
        difference = _first_difference(first, other)
        if difference is not None:
            raise UserError(f"the evaluations were not scored alike: {difference}; merge results decoded and "
                            "scored with the same settings")

    _name_apart(inputs)
    rows: list[RunResult] = []
    sources: dict[str, Path] = {}
    by_key: dict[tuple[str, str], tuple[RunResult, Evaluation]] = {}
    for evaluation in inputs:
        for row in evaluation.rows:
            key = (row.run, row.test_set)
            if key in by_key:  # the same run evaluated into two files: the same hypotheses, once in the table
                continue
            by_key[key] = (row, evaluation)
            rows.append(row)
            sources.setdefault(row.run, evaluation.path)
    for split in dict.fromkeys(r.test_set for r in rows):
        split_rows = [r for r in rows if r.test_set == split]
        for attr, what in SHARED_PER_TEST_SET.items():
            values = {json.dumps(getattr(r, attr), sort_keys=True): r for r in split_rows}
            if len(values) > 1:
                a, b = list(values.values())[:2]
                raise UserError(f"{sources[a.run]} and {sources[b.run]} differ in their {what} on test set {split!r} "
                                f"(runs {a.run} and {b.run}); merge evaluations of one test set and corpus")

    # Each row keeps the baseline its own evaluation chose; the comparison is computed again from the files.
    baseline_of = {r.run: r.compared_with for r in rows if r.compared_with}
    missing = sorted({b for b in baseline_of.values() if b not in sources})
    if missing:
        raise UserError(f"the baseline run {missing[0]} that {sources[_first(baseline_of, missing[0])]} compares with "
                        "is in none of the files; add the results.json that holds it")
    _pair_with_own_seed(baseline_of, list(by_key.values()))
    sentence_level, refs_sha = {}, {}
    settings = first.settings
    for row, evaluation in by_key.values():
        hyps = read_lines(evaluation.folder / row.hyp_file, check_text=False) if row.num_sentences else []
        refs = read_lines(evaluation.folder / row.ref_file)
        stats = comparison_stats(hyps, refs, task=row.task, tgt_lang=row.tgt_lang,
                                 bleu_tokenize=settings.get("bleu_tokenize"))
        for metric, computed in stats.items():  # Δ is taken from the stored scores: they must be the files' scores
            stored = getattr(row, metric)
            if math.isfinite(stored) and abs(computed.score - stored) > SCORE_TOLERANCE:
                raise UserError(f"{evaluation.path}: run {row.run} records {metric} {stored:.4f}, but its hypotheses score "
                                f"{computed.score:.4f} here (another sacrebleu or tokenizer version, or an edited file); "
                                "merge results scored with this installation's metrics")
        refresh_hypothesis_figures(row, hyps)
        sentence_level[(row.run, row.test_set)] = stats
        refs_sha[(row.run, row.test_set)] = row.ref_sha256
        row.delta, row.p_value, row.compared_with = {}, {}, None
    targets = {name: _against_targets(name, by_key.values(), sources) for name in against}
    add_bootstrap(rows, sentence_level, refs_sha, baseline_of, n_samples=int(settings["bootstrap_samples"]),
                  seed=int(settings["seed"]))
    compared = []
    for name, target_of in targets.items():
        # copies: the rows keep the comparison with their baseline
        copies = [replace(r, delta={}, p_value={}, compared_with=None) for r in rows]
        add_bootstrap(copies, sentence_level, refs_sha, target_of,
                      n_samples=int(settings["bootstrap_samples"]), seed=int(settings["seed"]))
        compared += [{"run": c.run, "test_set": c.test_set, "against": name, "against_run": c.compared_with,
                      "delta": c.delta, "p_value": c.p_value} for c in copies if c.compared_with]

    baselines = {b for b in baseline_of.values()} | {e.baseline for e in inputs if e.baseline}
    order = {name: i for i, name in enumerate(_report_order([r.run for r in rows], baselines))}
    rows.sort(key=lambda r: (settings["test_sets"].index(r.test_set) if r.test_set in settings["test_sets"] else 0,
                             order[r.run]))
    order_of = {(r.run, r.test_set): k for k, r in enumerate(rows)}
    compared.sort(key=lambda c: (order_of[(c["run"], c["test_set"])], c["against"]))
    position = {e.path: i for i, e in enumerate(inputs)}
    file_order = {run: position[path] for run, path in sources.items()}
    systems = systems_over_seeds(rows, file_order)
    report = Report(out=Path(out), inputs=inputs, rows=rows, sources=sources, systems=systems, against=compared,
                    against_systems=against_over_seeds(systems, compared, {r.run: r.seed for r in rows}))
    if write:
        write_report(report)
    return report


def _name_apart(inputs: list[Evaluation]) -> None:
    """Runs of one name with other hypotheses in several files (each batch's `baseline`) are different runs:
    each gets the name of the first file that holds its hypotheses in brackets, in its rows and in the
    comparisons made within its file; files holding the same hypotheses (a run decoded again alike) share it."""
    labels = [_file_label(e) for e in inputs]
    held_by = [_hypotheses_of(e) for e in inputs]
    copies: dict[str, dict[tuple, str]] = {}  # run -> its hypotheses in a file -> the first file's label
    for held, label in zip(held_by, labels):
        for name, digests in held.items():
            copies.setdefault(name, {}).setdefault(digests, label)
    clashing = {name: seen for name, seen in copies.items() if len(seen) > 1}
    if clashing and len(set(labels)) < len(labels):
        raise UserError(f"run {sorted(clashing)[0]} has other hypotheses in each of several files whose names do not tell "
                        "them apart; give each evaluation's results.json a name of its own (e.g. batch-1.json)")
    for evaluation, held in zip(inputs, held_by):
        renamed = {name: _in_file(name, seen[held[name]]) for name, seen in clashing.items() if name in held}
        for row in evaluation.rows:
            row.run = renamed.get(row.run, row.run)
            row.compared_with = renamed.get(row.compared_with, row.compared_with)
        evaluation.baseline = renamed.get(evaluation.baseline, evaluation.baseline)


def _hypotheses_of(evaluation: Evaluation) -> dict[str, tuple]:
    """run -> the digests of its hypothesis files in this evaluation, one per test set."""
    out: dict[str, list] = {}
    for row in evaluation.rows:
        out.setdefault(row.run, []).append((row.test_set, row.hyp_sha256))
    return {run: tuple(sorted(digests)) for run, digests in out.items()}


def _pair_with_own_seed(baseline_of: dict[str, str], pairs: list[tuple[RunResult, Evaluation]]) -> None:
    """A run compared with another seed's run of a system (the baseline its evaluation named where that evaluation
    held none of the run's seed, or a run named with --against) is compared with that system's run of its own seed
    where a file holds one: seed-to-seed spread is not a gain."""
    first = {}
    for row, evaluation in pairs:
        first.setdefault(row.run, (row, evaluation))
    for run, base in list(baseline_of.items()):
        row, evaluation = first[run]
        if row.seed is None or first[base][0].seed == row.seed or system_of(base) == system_of(run):
            continue
        own = _run_of_seed(system_of(base), row, evaluation, first.values())
        if own:
            baseline_of[run] = own
            logger.info("%s: compared with %s, of its own seed, where %s was named", run, own, base)


def _run_of_seed(system: str, row: RunResult, evaluation: Evaluation,
                 pairs: Iterable[tuple[RunResult, Evaluation]]) -> str | None:
    """`system`'s run of the row's seed: the one of the row's own file, else the first file's; None if none."""
    own = [(other_evaluation is not evaluation, other.run) for other, other_evaluation in pairs
           if system_of(other.run) == system and other.seed == row.seed]
    return min(own, key=lambda t: t[0])[1] if own else None


def file_name(path: Path) -> str:
    """How a table names an input: its file name, with its folder where that name says nothing (results.json)."""
    return f"{path.parent.name}/{path.name}" if path.stem == "results" else path.name


def _file_label(evaluation: Evaluation) -> str:
    return evaluation.path.parent.name if evaluation.path.stem == "results" else evaluation.path.stem


def _in_file(run: str, label: str) -> str:
    return f"{run} [{label}]"


def _against_targets(name: str, rows: Iterable[tuple[RunResult, Evaluation]],
                     sources: dict[str, Path]) -> dict[str, str]:
    """run -> the run `name` it is compared with: the one run of that name, or the one of the row's own file where
    several files hold their own; a row of another seed, or of a file without one, is compared with the named
    system's run of its own seed where a file holds one (a row with neither is not compared). A system's name
    (`fused` where the files hold `fused.seed-1`, `fused.seed-2`) names its run of each row's seed."""
    rows = list(rows)
    system = system_of(name)
    if name in sources:
        target_of = {run: name for run in sources if run != name}
    else:
        in_file = {evaluation.path: _in_file(name, _file_label(evaluation)) for _, evaluation in rows}
        if not any(target in sources for target in in_file.values()) and not any(
                system_of(run) == name for run in sources):
            raise UserError(f"--against {name}: no such run or system in the files (runs: {', '.join(sources)})")
        target_of = {row.run: in_file[evaluation.path] for row, evaluation in rows
                     if in_file[evaluation.path] in sources and row.run != in_file[evaluation.path]}
        for row, evaluation in rows:
            if row.run not in target_of and system_of(row.run) != system and row.seed is not None:
                own = _run_of_seed(system, row, evaluation, rows)
                if own:
                    target_of[row.run] = own
        left = sorted({row.run for row, _ in rows if row.run not in target_of and system_of(row.run) != system})
        if not target_of:
            raise UserError(f"--against {name}: no row's file or seed has a run of {name} "
                            f"(runs: {', '.join(sources)}); add the results.json that holds one of their seed")
        if left:
            logger.warning("--against %s: not compared, since their files hold no %s and none holds one of their "
                           "seed: %s", name, name, ", ".join(left))
    _pair_with_own_seed(target_of, rows)
    return target_of


def _first(mapping: dict[str, str], value: str) -> str:
    return next(k for k, v in mapping.items() if v == value)


def _report_order(names: list[str], baselines: set[str]) -> list[str]:
    """Baselines first, then the others, each by system and seed."""
    return sorted(dict.fromkeys(names), key=lambda n: (n not in baselines, system_of(n), n))


# ---------------------------------------------------------------------------------------- files


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def report_markdown(report: Report) -> str:
    s = report.inputs[0].settings
    lines = ["# prlmfuse report", "",
             f"Merged from {len(report.inputs)} evaluation(s), all decoded with beam {s['beam']}, length penalty "
             f"{s['lenpen']}, the average of the last {s['average_last']} {'epoch-end ' if s.get('average') == 'epochs' else ''}"
             f"checkpoints, and compared by paired bootstrap ({s['bootstrap_samples']} samples, seed {s['seed']}). "
             f"Each run's Δ and p are against the baseline its evaluation named (the baseline of its own seed where "
             f"there is one); * marks p < {SIGNIFICANCE:g}.", "", "| file | machine | runs |", "|---|---|---|"]
    for e in report.inputs:
        runs = ", ".join(dict.fromkeys(r.run for r in e.rows))
        lines.append(f"| {file_name(e.path)} | {e.machine} | {runs} |")
    for split in dict.fromkeys(r.test_set for r in report.rows):
        rows = [r for r in report.rows if r.test_set == split]
        metric = rows[0].main_metric
        name = {"bleu": "BLEU", "rougeL": "ROUGE-L"}.get(metric, metric)
        copies = metric == "rougeL"  # a copy share is measured for summaries only
        header = ["run", "file", name, "Δ", "p", "vs", "chrF", *hypothesis_headers(copies), "params", "updates",
                  "epochs", "stopped by", "dev loss, last 3 epoch ends"]
        lines += ["", f"## {split} ({rows[0].num_sentences} sentences)", "",
                  "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for r in rows:
            delta, p = r.delta.get(metric), r.p_value.get(metric)
            mark = "*" if p is not None and p < SIGNIFICANCE else ""
            last3 = ", ".join(f"{x:.3f}" for x in r.epoch_dev_losses[-3:]) or "-"
            cells = [r.run, file_name(report.sources[r.run]), _fmt(getattr(r, metric)),
                     "-" if delta is None else f"{delta:+.2f}", "-" if p is None else f"{p:.3f}{mark}",
                     r.compared_with or "-", _fmt(r.chrf), *hypothesis_cells(r, copies),
                     format_parameters(r.trainable_parameters), str(r.updates), str(len(r.epoch_dev_losses)),
                     r.stopped_by or "unfinished", last3]
            lines.append("| " + " | ".join(cells) + " |")
        systems = [m for m in report.systems if m.test_set == split]
        lines += ["", f"Over seeds ({name}: mean ± sample sd, n − 1; sd needs two seeds or more; one row per seed):", "",
                  f"| system | seeds | {name} | chrF | Δ vs own seed's baseline | seeds ahead with p < {SIGNIFICANCE:g} |",
                  "|---|---|---|---|---|---|"]
        for m in systems:
            delta = "-" if m.delta_mean is None else f"{m.delta_mean:+.2f} ± {_fmt(m.delta_sd)}"
            ahead = f"{m.significant} of {m.compared}" if m.compared else "-"
            lines.append(f"| {m.system} | {len(m.runs)} | {_fmt(m.mean)} ± {_fmt(m.sd)} | "
                         f"{_fmt(m.chrf_mean)} ± {_fmt(m.chrf_sd)} | {delta} | {ahead} |")
        left_out = [f"{run} (its seed counts as {kept})" for m in systems for run, kept in m.left_out.items()]
        if left_out:
            lines += ["", "Not counted over seeds, since another row of the same seed counts: " + "; ".join(left_out) + "."]
        for other in dict.fromkeys(c["against"] for c in report.against if c["test_set"] == split):
            own = any(c["against_run"] != other for c in report.against if c["against"] == other)
            lines += ["", f"Against {other}{' (the one of each row’s own file or seed)' if own else ''} (paired "
                          f"bootstrap on the same resampled test sets; * p < {SIGNIFICANCE:g}):",
                      "", f"| run | Δ {name} vs {other} | p | Δ chrF vs {other} |", "|---|---|---|---|"]
            for c in report.against:
                if c["test_set"] == split and c["against"] == other and metric in c["delta"]:
                    p_value = c["p_value"][metric]
                    chrf = next(r.chrf for r in rows if r.run == c["run"]) - next(r.chrf for r in rows if r.run == c["against_run"])
                    lines.append(f"| {c['run']} | {c['delta'][metric]:+.2f} | {p_value:.3f}"
                                 f"{'*' if p_value < SIGNIFICANCE else ''} | {_fmt(chrf, 2) if math.isfinite(chrf) else '-'} |")
            lines += _against_over_seeds_lines(
                [a for a in report.against_systems if a.test_set == split and a.against == other], other, name)
        signatures = dict.fromkeys(f"{k}: {v}" for r in rows for k, v in sorted(r.signature.items()))
        lines += ["", "Signatures:", ""] + [f"- `{sig}`" for sig in signatures]
    return "\n".join(lines) + "\n"


def _against_over_seeds_lines(over: list[AgainstSummary], other: str, metric_name: str) -> list[str]:
    """The over-seeds table of one --against run, where some system has more than one seed compared with it."""
    if not any(len(a.runs) > 1 for a in over):
        return []
    significant = f"with p < {SIGNIFICANCE:g}"
    return ["", f"Over seeds against {system_of(other)} of each row’s seed (mean ± sample sd):", "",
            f"| system | seeds | Δ {metric_name} | ahead {significant} | behind {significant} |", "|---|---|---|---|---|",
            *(f"| {a.system} | {len(a.runs)} | {a.delta_mean:+.2f} ± {_fmt(a.delta_sd)} | {a.ahead} | {a.behind} |"
              for a in over)]


def write_report(report: Report) -> None:
    from prlmfuse.evaluate.plots import plot_scores  # matplotlib: imported when a report is written

    out = report.out
    out.mkdir(parents=True, exist_ok=True)
    as_results = EvaluationResults(out=out, baseline=None, rows=report.rows, settings=report.inputs[0].settings)
    atomic_write_text(out / "results.md", report_markdown(report))
    csv_text = results_csv(as_results)
    buf = io.StringIO()
    reader = csv.reader(io.StringIO(csv_text))
    writer = csv.writer(buf, lineterminator="\n")
    for i, line in enumerate(reader):
        run = line[1]
        writer.writerow(line + (["file", "machine"] if i == 0 else [file_name(report.sources[run]), _machine_of(report, run)]))
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_json(out / "results.json", json_safe({
        "inputs": [{"file": str(e.path), "machine": e.machine, "baseline": e.baseline,
                    "runs": list(dict.fromkeys(r.run for r in e.rows))} for e in report.inputs],
        "settings": {k: report.inputs[0].settings.get(k) for k in SHARED_SETTINGS},
        "rows": [{**r.to_dict(), "file": file_name(report.sources[r.run]), "machine": _machine_of(report, r.run)}
                 for r in report.rows],
        "systems": [asdict(m) for m in report.systems],
        "against": report.against,
        "against_systems": [asdict(a) for a in report.against_systems],
    }))
    plot_scores(as_results, out / "scores.png")


def _machine_of(report: Report, run: str) -> str:
    path = report.sources[run]
    return next(e.machine for e in report.inputs if e.path == path)
