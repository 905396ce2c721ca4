"""`prlmfuse report`: seeds trained and evaluated apart, merged into one table; mismatched inputs refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import small_runs
from prlmfuse.errors import UserError


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Two seeds of a baseline and a fused run on real Bible verses, each seed's pair evaluated on its own
    (as separate jobs would), and the two evaluations' files copied into one folder as seed-K.json."""
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.train_fused import train_run
    from prlmfuse.train_fused.config import PrLMUse

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("report")
    corpus = small_runs.small_bible(root, train=120, dev=12, test=16)
    checkpoint = small_runs.tiny_prlm(root / "prlm")
    paths = small_runs.build_caches(checkpoint, corpus, root / "caches")
    use = PrLMUse(checkpoint=str(checkpoint), layer=-2)
    merged_in = root / "merged-in"
    merged_in.mkdir()
    evaluations = {}
    for seed in (1, 2):
        dirs = [
            train_run(small_runs.tiny_run(f"baseline.seed-{seed}", seed=seed, max_updates=8), corpus, [],
                      root / "runs" / f"baseline.seed-{seed}", progress=False),
            train_run(small_runs.tiny_run(f"fused.seed-{seed}", seed=seed, max_updates=8, prlms=[use]), corpus,
                      [small_runs.caches_for(use, paths)], root / "runs" / f"fused.seed-{seed}", progress=False),
        ]
        out = root / f"eval-{seed}"
        evaluations[seed] = evaluate_runs(dirs, out=out, beam=2, average_last=2, progress=False)
        shutil.copy(out / "results.json", merged_in / f"seed-{seed}.json")
        for f in list(out.glob("hyp.*.txt")) + list(out.glob("ref.*.txt")):
            shutil.copy(f, merged_in / f.name)
    return {"root": root, "corpus": corpus, "dirs": root / "runs", "in": merged_in, "evaluations": evaluations}


def _copy_inputs(evaluated, to: Path) -> Path:
    shutil.copytree(evaluated["in"], to)
    return to


def test_the_merge_compares_each_fused_seed_with_its_own_baseline(evaluated, tmp_path):
    from prlmfuse.evaluate.report import merge_evaluations

    files = [evaluated["in"] / "seed-1.json", evaluated["in"] / "seed-2.json"]
    report = merge_evaluations(files, tmp_path / "merged")
    rows = {r.run: r for r in report.rows}
    assert list(rows) == ["baseline.seed-1", "baseline.seed-2", "fused.seed-1", "fused.seed-2"]
    for seed in (1, 2):
        fused, evaluation = rows[f"fused.seed-{seed}"], evaluated["evaluations"][seed].row(f"fused.seed-{seed}")
        assert fused.compared_with == f"baseline.seed-{seed}"
        # The same hypotheses, references and bootstrap settings give the evaluation's own Δ and p.
        assert fused.delta["bleu"] == pytest.approx(evaluation.delta["bleu"])
        assert fused.p_value["bleu"] == pytest.approx(evaluation.p_value["bleu"])
        assert report.sources[fused.run].name == f"seed-{seed}.json"
    systems = {m.system: m for m in report.systems}
    bleus = [rows["baseline.seed-1"].bleu, rows["baseline.seed-2"].bleu]
    assert systems["baseline"].runs == ["baseline.seed-1", "baseline.seed-2"]
    assert systems["baseline"].mean == pytest.approx(sum(bleus) / 2)
    assert systems["baseline"].sd == pytest.approx(abs(bleus[0] - bleus[1]) / 2 ** 0.5)
    deltas = [rows["fused.seed-1"].delta["bleu"], rows["fused.seed-2"].delta["bleu"]]
    assert systems["fused"].delta_mean == pytest.approx(sum(deltas) / 2) and systems["fused"].compared == 2
    for name in ("results.md", "results.csv", "results.json", "scores.png"):
        assert (tmp_path / "merged" / name).is_file(), name
    saved = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert [r["file"] for r in saved["rows"]] == ["seed-1.json", "seed-2.json", "seed-1.json", "seed-2.json"]
    assert saved["inputs"][0]["machine"] and all(r["stopped_by"] == "max_updates" for r in saved["rows"])
    md = (tmp_path / "merged" / "results.md").read_text()
    assert "| fused | 2 |" in md and "vs" in md


def test_report_through_the_cli(evaluated, tmp_path):
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "report", str(evaluated["in"] / "seed-1.json"),
                          str(evaluated["in"] / "seed-2.json"), "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"results: {tmp_path / 'm' / 'results.md'}" in out.stdout and "test fused: BLEU" in out.stdout


def test_examples_show_each_sentence_with_its_reference_and_every_runs_output(evaluated, tmp_path):
    folder = _copy_inputs(evaluated, tmp_path / "in")
    source = evaluated["corpus"].root / "test.src"
    command = [sys.executable, "-m", "prlmfuse.cli", "report", str(folder / "seed-1.json"), str(folder / "seed-2.json"),
               "--out", str(tmp_path / "m")]
    out = subprocess.run([*command, "--examples", "3", "--source", str(source)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"examples: {tmp_path / 'm' / 'examples.md'}" in out.stdout
    table = [line for line in (tmp_path / "m" / "examples.md").read_text(encoding="utf-8").splitlines()
             if line.startswith("| ")]
    runs = ["baseline.seed-1", "baseline.seed-2", "fused.seed-1", "fused.seed-2"]
    assert table[0] == "| # | source (start) | reference | " + " | ".join(runs) + " |"
    sources = source.read_text(encoding="utf-8").splitlines()
    columns = [(folder / "ref.test.txt").read_text(encoding="utf-8").splitlines()] + [
        (folder / f"hyp.{run}.test.txt").read_text(encoding="utf-8").splitlines() for run in runs]
    assert len(table) == 1 + 3
    for i, line in enumerate(table[1:]):
        cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
        assert cells[0] == str(i + 1) and cells[2:] == [column[i] or "(empty)" for column in columns]
        shown = cells[1].removesuffix(" …")
        assert sources[i].startswith(shown) and len(shown) <= 100 and (shown == sources[i]) == (not cells[1].endswith("…"))
    assert any(len(s) > 100 for s in sources[:3])  # a verse long enough to be cut, so the cut is tested
    # a report written again without --examples leaves no examples of other results beside it
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    assert not (tmp_path / "m" / "examples.md").exists() and (tmp_path / "m" / "results.md").is_file()


def test_examples_escape_markup_and_refuse_a_source_that_is_not_the_test_sets(evaluated, tmp_path):
    from prlmfuse.evaluate.examples import examples_markdown
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    merged = merge_evaluations([folder / "seed-1.json"], tmp_path / "m", write=False)
    assert not (tmp_path / "m").exists()
    rows = merged.rows[0].num_sentences
    source = tmp_path / "src.txt"
    source.write_text("a | b <dev@debian.org> *x* \\_y_\n" * rows, encoding="utf-8")
    assert "| 1 | a \\| b \\<dev@debian.org\\> \\*x\\* \\\\\\_y\\_ |" in examples_markdown(merged, 1, source)
    # a run named like a column of the table's own gets a column of its own
    first = merged.rows[0]
    renamed = dataclasses.replace(merged, rows=[dataclasses.replace(first, run="reference")] + merged.rows[1:],
                                  sources={"reference": merged.sources[first.run], **merged.sources})
    header, _, row = examples_markdown(renamed, 1).splitlines()[4:7]
    hyp = (folder / first.hyp_file).read_text(encoding="utf-8").splitlines()[0]
    ref = (folder / "ref.test.txt").read_text(encoding="utf-8").splitlines()[0]
    assert header.startswith("| # | reference | reference | ") and row.startswith(f"| 1 | {ref} | {hyp or '(empty)'} | ")
    source.write_text("one line\n", encoding="utf-8")
    with pytest.raises(UserError, match=f"has 1 lines but test set 'test' has {rows} sentences"):
        examples_markdown(merged, 2, source)
    with pytest.raises(UserError, match="holds the references; pass the source side"):
        examples_markdown(merged, 2, folder / "ref.test.txt")
    proc = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "report", str(folder / "seed-1.json"), "--out",
                           str(tmp_path / "o"), "--examples", "2", "--source", str(source)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()  # refused before the merged table is written
    proc = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "report", str(folder / "seed-1.json"), "--out",
                           str(tmp_path / "o"), "--source", str(source)], capture_output=True, text=True)
    assert proc.returncode == 2 and "add --examples N" in proc.stderr


def test_rows_compared_against_a_named_run_match_an_evaluation_that_named_it_its_baseline(evaluated, tmp_path):
    """--against fused.seed-1: each other run gets the Δ and p an evaluation with fused.seed-1 as its baseline gives,
    a row of another seed those of that seed's fused run."""
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.evaluate.report import merge_evaluations

    files = [evaluated["in"] / "seed-1.json", evaluated["in"] / "seed-2.json"]
    report = merge_evaluations(files, tmp_path / "merged", against=["fused.seed-1"])
    rows = {r.run: r for r in report.rows}
    assert rows["fused.seed-2"].compared_with == "baseline.seed-2"  # the baseline comparison is kept
    compared = {c["run"]: c for c in report.against}
    assert sorted(compared) == ["baseline.seed-1", "baseline.seed-2", "fused.seed-2"]
    direct = evaluate_runs([evaluated["dirs"] / "fused.seed-1", evaluated["dirs"] / "fused.seed-2"],
                           out=tmp_path / "direct", beam=2, average_last=2, baseline="fused.seed-1", progress=False)
    assert compared["fused.seed-2"]["delta"]["bleu"] == pytest.approx(direct.row("fused.seed-2").delta["bleu"])
    assert compared["fused.seed-2"]["p_value"]["bleu"] == pytest.approx(direct.row("fused.seed-2").p_value["bleu"])
    assert compared["baseline.seed-1"]["delta"]["bleu"] == pytest.approx(rows["baseline.seed-1"].bleu - rows["fused.seed-1"].bleu)
    # Seed 2's baseline is compared with seed 2's fused run, not with seed 1's: seed spread is not a difference.
    assert compared["baseline.seed-2"]["against_run"] == "fused.seed-2"
    gaps = [rows[f"baseline.seed-{seed}"].bleu - rows[f"fused.seed-{seed}"].bleu for seed in (1, 2)]
    assert compared["baseline.seed-2"]["delta"]["bleu"] == pytest.approx(gaps[1])
    # Over seeds, the baseline's Δ against fused is the mean of each seed's; fused against itself is no row there.
    [summary] = report.against_systems
    assert (summary.system, summary.runs) == ("baseline", ["baseline.seed-1", "baseline.seed-2"])
    significant = [compared[f"baseline.seed-{seed}"]["p_value"]["bleu"] < 0.05 for seed in (1, 2)]
    assert summary.ahead == sum(sig and gap > 0 for sig, gap in zip(significant, gaps))
    assert summary.behind == sum(sig and gap < 0 for sig, gap in zip(significant, gaps))
    assert summary.delta_mean == pytest.approx(sum(gaps) / 2)
    assert summary.delta_sd == pytest.approx(abs(gaps[0] - gaps[1]) / 2 ** 0.5)
    md = (tmp_path / "merged" / "results.md").read_text()
    assert "Against fused.seed-1" in md and "| fused.seed-2 |" in md.split("Against fused.seed-1")[1]
    assert f"| baseline | 2 | {summary.delta_mean:+.2f} ± " in md.split("Over seeds against fused of each row")[1]
    saved = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert saved["against"][0]["against"] == "fused.seed-1"
    assert saved["against_systems"][0]["runs"] == ["baseline.seed-1", "baseline.seed-2"]
    assert "--against nosuch: no such run" in _refusal([*files, "--against", "nosuch"], tmp_path / "refused")


def _refusal(files: list[Path], out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "report", *map(str, files), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()  # nothing written that a later run could take for a merged table
    return proc.stderr


def test_a_changed_or_missing_hypothesis_file_is_refused(evaluated, tmp_path):
    folder = _copy_inputs(evaluated, tmp_path / "in")
    files = [folder / "seed-1.json", folder / "seed-2.json"]
    hyp = folder / "hyp.fused.seed-2.test.txt"
    hyp.write_text(hyp.read_text(encoding="utf-8").replace("\n", " 。\n", 1), encoding="utf-8")
    assert "hyp.fused.seed-2.test.txt of run fused.seed-2 is not the one that was scored" in _refusal(files, tmp_path / "o1")
    hyp.unlink()
    assert "the hypothesis file hyp.fused.seed-2.test.txt of run fused.seed-2 is missing from" in _refusal(files, tmp_path / "o2")


def test_other_decoding_settings_or_another_test_set_are_refused(evaluated, tmp_path):
    folder = _copy_inputs(evaluated, tmp_path / "in")
    files = [folder / "seed-1.json", folder / "seed-2.json"]
    data = json.loads(files[1].read_text())
    data["settings"]["beam"] = 5
    files[1].write_text(json.dumps(data))
    assert "not scored alike: beam 5 in" in _refusal(files, tmp_path / "o1")

    data["settings"]["beam"] = 2
    # Another test set: other references (a copy of them beside the file, as an evaluation would write).
    ref = folder / data["rows"][0]["ref_file"]
    other = folder / "ref.test.other.txt"
    other.write_text(ref.read_text(encoding="utf-8").replace("\n", "。\n", 1), encoding="utf-8")
    from prlmfuse.fileio import sha256_file

    for row in data["rows"]:
        row["ref_file"], row["ref_sha256"] = other.name, sha256_file(other)
    files[1].write_text(json.dumps(data))
    assert "differ in their references on test set 'test'" in _refusal(files, tmp_path / "o2")


def test_the_same_test_sets_named_in_another_order_merge_and_other_sets_are_refused(evaluated, tmp_path):
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    files = [folder / "seed-1.json", folder / "seed-2.json"]
    for file, sets in zip(files, (["test", "dev"], ["dev", "test"])):
        data = json.loads(file.read_text())
        data["settings"]["test_sets"] = sets
        file.write_text(json.dumps(data))
    report = merge_evaluations(files, tmp_path / "merged")
    assert {r.run for r in report.rows} == {"baseline.seed-1", "fused.seed-1", "baseline.seed-2", "fused.seed-2"}

    data["settings"]["test_sets"] = ["test"]
    files[1].write_text(json.dumps(data))
    assert "not scored alike: test_sets ['test'] in" in _refusal(files, tmp_path / "o1")


def test_an_older_results_file_and_a_lost_baseline_are_refused(evaluated, tmp_path):
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    data = json.loads((folder / "seed-1.json").read_text())
    for row in data["rows"]:
        del row["hyp_sha256"]
    (folder / "old.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="records no hyp_sha256: it was written by an older prlmfuse"):
        merge_evaluations([folder / "old.json"], tmp_path / "o1")
    data = json.loads((folder / "seed-1.json").read_text())
    del data["settings"]["bootstrap_samples"]
    (folder / "old.json").write_text(json.dumps(data))
    assert "its settings record no bootstrap_samples" in _refusal([folder / "old.json"], tmp_path / "o3")

    data = json.loads((folder / "seed-2.json").read_text())
    data["rows"] = [r for r in data["rows"] if r["run"] != "baseline.seed-2"]
    (folder / "fused-only.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="the baseline run baseline.seed-2 that .*fused-only.json compares with is in none"):
        merge_evaluations([folder / "seed-1.json", folder / "fused-only.json"], tmp_path / "o2")


def test_batches_with_runs_of_one_name_are_told_apart_by_their_file(evaluated, tmp_path):
    """Table batches each have their own `baseline`: a run name with other hypotheses in another file is another
    run, named with its file, and each fused row stays compared with the baseline of its own file."""
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    data = json.loads((folder / "seed-2.json").read_text())
    for row in data["rows"]:
        row["run"] = row["run"].replace("seed-2", "seed-1")
        row["compared_with"] = row["compared_with"] and row["compared_with"].replace("seed-2", "seed-1")
        row["seed"] = 1
    (folder / "batch-2.json").write_text(json.dumps(data))
    report = merge_evaluations([folder / "seed-1.json", folder / "batch-2.json"], tmp_path / "merged",
                               against=["fused.seed-1"])
    rows = {r.run: r for r in report.rows}
    assert set(rows) == {"baseline.seed-1 [seed-1]", "baseline.seed-1 [batch-2]", "fused.seed-1 [seed-1]",
                         "fused.seed-1 [batch-2]"}
    second = rows["fused.seed-1 [batch-2]"]
    assert second.compared_with == "baseline.seed-1 [batch-2]"
    assert second.delta["bleu"] == pytest.approx(evaluated["evaluations"][2].row("fused.seed-2").delta["bleu"])
    # both batches trained seed 1: over seeds, seed 1 counts once, from the first file
    systems = {m.system: m for m in report.systems}
    assert systems["baseline"].runs == ["baseline.seed-1 [seed-1]"] and systems["fused"].runs == ["fused.seed-1 [seed-1]"]
    assert systems["fused"].left_out == {"fused.seed-1 [batch-2]": "fused.seed-1 [seed-1]"}
    # --against a name each file holds its own run of: every row against the one of its own file
    compared = {c["run"]: c for c in report.against}
    assert {run: c["against_run"] for run, c in compared.items()} == {
        "baseline.seed-1 [seed-1]": "fused.seed-1 [seed-1]", "baseline.seed-1 [batch-2]": "fused.seed-1 [batch-2]"}
    assert compared["baseline.seed-1 [batch-2]"]["delta"]["bleu"] == pytest.approx(-second.delta["bleu"])
    md = (tmp_path / "merged" / "results.md").read_text()
    assert "fused.seed-1 [batch-2] (its seed counts as fused.seed-1 [seed-1])" in md
    chrf = rows["baseline.seed-1 [batch-2]"].chrf - second.chrf
    assert "Against fused.seed-1 (the one of each row’s own file or seed)" in md
    # the Δ the row prints is that comparison's own (negating a Δ of 0.0 would print -0.00 where it prints +0.00)
    against_delta = compared["baseline.seed-1 [batch-2]"]["delta"]["bleu"]
    assert f"| baseline.seed-1 [batch-2] | {against_delta:+.2f} |" in md and f"| {chrf:.2f} |" in md
    # examples show each batch's run from its own file's hypotheses
    from prlmfuse.evaluate.examples import examples_markdown

    header, _, first = [line.removeprefix("| ").removesuffix(" |").split(" | ")
                        for line in examples_markdown(report, 1).splitlines() if line.startswith("|")]
    shown = dict(zip(header[1:], first[1:]))
    hyp = {run: (folder / f"hyp.{run}.test.txt").read_text(encoding="utf-8").splitlines()[0]
           for run in ("baseline.seed-1", "baseline.seed-2", "fused.seed-1", "fused.seed-2")}
    assert shown == {"reference": (folder / "ref.test.txt").read_text(encoding="utf-8").splitlines()[0],
                     "baseline.seed-1 [seed-1]": hyp["baseline.seed-1"], "baseline.seed-1 [batch-2]": hyp["baseline.seed-2"],
                     "fused.seed-1 [seed-1]": hyp["fused.seed-1"], "fused.seed-1 [batch-2]": hyp["fused.seed-2"]}


def test_against_a_run_each_batch_holds_its_own_of_pairs_a_seed_file_with_its_seed(evaluated, tmp_path):
    """Two batches of seed 1, each with its own `baseline` and `fused` (told apart by file), and a seed-2 file
    of `baseline.seed-2` and `fused.seed-2`: --against fused compares seed 2's baseline with seed 2's fused."""
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    for source, batch in (("seed-1.json", "batch-1.json"), ("seed-2.json", "batch-2.json")):
        data = json.loads((folder / source).read_text())
        for row in data["rows"]:
            row["run"], row["seed"] = row["run"].split(".")[0], 1
            row["compared_with"] = row["compared_with"] and row["compared_with"].split(".")[0]
        data["baseline"] = "baseline"
        (folder / batch).write_text(json.dumps(data))
    report = merge_evaluations([folder / "batch-1.json", folder / "batch-2.json", folder / "seed-2.json"],
                               tmp_path / "merged", against=["fused"])
    compared = {c["run"]: c["against_run"] for c in report.against}
    assert compared == {"baseline [batch-1]": "fused [batch-1]", "baseline [batch-2]": "fused [batch-2]",
                        "baseline.seed-2": "fused.seed-2"}
    [summary] = report.against_systems
    assert summary.runs == ["baseline [batch-1]", "baseline.seed-2"]  # seed 1 counts once, from the first file


def test_against_a_system_compares_each_row_with_its_run_of_the_rows_seed(evaluated, tmp_path):
    """--against fused where the files hold fused.seed-1 and fused.seed-2 but no run named fused: each baseline
    seed is compared with fused of its seed, with the Δ of --against fused.seed-N for that seed."""
    from prlmfuse.evaluate.report import merge_evaluations

    files = [evaluated["in"] / "seed-1.json", evaluated["in"] / "seed-2.json"]
    report = merge_evaluations(files, tmp_path / "merged", against=["fused"])
    compared = {c["run"]: c for c in report.against}
    assert {run: c["against_run"] for run, c in compared.items()} == {
        "baseline.seed-1": "fused.seed-1", "baseline.seed-2": "fused.seed-2"}
    by_seed = merge_evaluations(files, tmp_path / "by-seed", against=["fused.seed-2"])
    [seed_2] = [c for c in by_seed.against if c["run"] == "baseline.seed-2"]
    assert compared["baseline.seed-2"]["delta"]["bleu"] == pytest.approx(seed_2["delta"]["bleu"])
    [summary] = report.against_systems
    assert summary.runs == ["baseline.seed-1", "baseline.seed-2"]
    assert "Over seeds against fused of each row" in (tmp_path / "merged" / "results.md").read_text()
    with pytest.raises(UserError, match="--against fused.seed-3: no such run or system"):
        merge_evaluations(files, tmp_path / "refused", against=["fused.seed-3"])
    # seed 1's fused beside seed 2's baseline alone: no row has a fused run of its seed to be compared with
    folder = _copy_inputs(evaluated, tmp_path / "in")
    for source, keep in (("seed-1.json", "fused.seed-1"), ("seed-2.json", "baseline.seed-2")):
        data = json.loads((folder / source).read_text())
        data["rows"] = [dict(row, compared_with=None) for row in data["rows"] if row["run"] == keep]
        (folder / source).write_text(json.dumps(data))
    with pytest.raises(UserError, match="--against fused: no row's file or seed has a run of fused"):
        merge_evaluations([folder / "seed-1.json", folder / "seed-2.json"], tmp_path / "none", against=["fused"])


def test_over_seeds_against_a_run_counts_only_rows_of_its_seed(evaluated, tmp_path):
    """--against fused.seed-1 where no file holds a fused run of seed 2: seed 2's baseline is compared with seed 1's
    fused in the table, but over seeds only seed 1's comparison counts."""
    from prlmfuse.evaluate.report import merge_evaluations

    folder = _copy_inputs(evaluated, tmp_path / "in")
    data = json.loads((folder / "seed-2.json").read_text())
    data["rows"] = [row for row in data["rows"] if row["run"] != "fused.seed-2"]
    (folder / "seed-2.json").write_text(json.dumps(data))
    report = merge_evaluations([folder / "seed-1.json", folder / "seed-2.json"], tmp_path / "merged",
                               against=["fused.seed-1"])
    assert {c["run"]: c["against_run"] for c in report.against} == {
        "baseline.seed-1": "fused.seed-1", "baseline.seed-2": "fused.seed-1"}
    [summary] = report.against_systems
    assert summary.runs == ["baseline.seed-1"]
    assert "Over seeds against" not in (tmp_path / "merged" / "results.md").read_text()


def test_a_baseline_seed_compared_with_another_seed_of_the_baseline_counts_as_no_gain(evaluated, tmp_path):
    # `prlmfuse run --runs baseline.seed-2,fused.seed-2` with `evaluate.baseline: baseline.seed-1` evaluates
    # baseline.seed-1 beside the pair and compares baseline.seed-2 with it: that row keeps its Δ, but the
    # over-seeds summary counts only each system's comparisons with another system.
    from prlmfuse.evaluate.report import merge_evaluations

    results = _evaluate(evaluated, ["baseline.seed-1", "baseline.seed-2", "fused.seed-2"], tmp_path / "eval-2",
                        baseline="baseline.seed-1")
    merged_in = _copy_inputs(evaluated, tmp_path / "in")
    shutil.copy(results, merged_in / "seed-2.json")
    report = merge_evaluations([merged_in / "seed-1.json", merged_in / "seed-2.json"], tmp_path / "merged")
    rows = {r.run: r for r in report.rows}
    assert rows["baseline.seed-2"].compared_with == "baseline.seed-1" and "bleu" in rows["baseline.seed-2"].delta
    assert rows["fused.seed-2"].compared_with == "baseline.seed-2"
    systems = {m.system: m for m in report.systems}
    assert systems["baseline"].compared == 0 and systems["baseline"].delta_mean is None
    assert systems["fused"].compared == 2
    assert "| baseline | 2 |" in (md := (tmp_path / "merged" / "results.md").read_text())
    assert next(line for line in md.splitlines() if line.startswith("| baseline | 2 |")).endswith("| - | - |")


def _evaluate(evaluated, runs: list[str], out: Path, baseline: str) -> Path:
    from prlmfuse.evaluate import evaluate_runs

    evaluate_runs([evaluated["dirs"] / run for run in runs], out=out, baseline=baseline, beam=2, average_last=2,
                  progress=False)
    return out / "results.json"


def _rewrite_hypotheses(results: Path, run: str, lines: list[str]) -> None:
    """Give `run` other hypotheses in an evaluation's folder, with the digest and scores an evaluation would record."""
    from prlmfuse.evaluate.metrics import sentence_stats
    from prlmfuse.fileio import sha256_file

    data = json.loads(results.read_text())
    row = next(r for r in data["rows"] if r["run"] == run)
    hyp = results.parent / row["hyp_file"]
    hyp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    refs = (results.parent / row["ref_file"]).read_text(encoding="utf-8").splitlines()
    row["hyp_sha256"] = sha256_file(hyp)
    row["bleu"] = sentence_stats(lines, refs, metric="bleu", tgt_lang=row["tgt_lang"]).score
    results.write_text(json.dumps(data))


def test_a_baseline_decoded_again_with_other_hypotheses_counts_its_seed_once(evaluated, tmp_path):
    # seed 3's evaluation decodes the named baseline, baseline.seed-1, again; on another CPU its hypotheses may
    # differ: it is then another row, but over seeds the baseline's seed 1 counts once, as seed 1's file has it.
    from prlmfuse.evaluate.report import merge_evaluations

    merged_in = _copy_inputs(evaluated, tmp_path / "in")
    results = _evaluate(evaluated, ["baseline.seed-1", "baseline.seed-2", "fused.seed-2"], tmp_path / "eval-2",
                        baseline="baseline.seed-1")
    seed_1 = (merged_in / "hyp.baseline.seed-1.test.txt").read_text(encoding="utf-8").splitlines()
    _rewrite_hypotheses(results, "baseline.seed-1", [seed_1[1], *seed_1[1:]])
    for f in results.parent.glob("*.txt"):
        shutil.copy(f, merged_in / f.name.replace("hyp.baseline.seed-1", "hyp.baseline.seed-1.again"))
    data = json.loads(results.read_text())
    for row in data["rows"]:
        row["hyp_file"] = row["hyp_file"].replace("hyp.baseline.seed-1", "hyp.baseline.seed-1.again")
    (merged_in / "seed-2.json").write_text(json.dumps(data))
    report = merge_evaluations([merged_in / "seed-1.json", merged_in / "seed-2.json"], tmp_path / "merged")
    rows = {r.run: r for r in report.rows}
    assert {"baseline.seed-1 [seed-1]", "baseline.seed-1 [seed-2]"} <= set(rows)
    systems = {m.system: m for m in report.systems}
    assert systems["baseline"].runs == ["baseline.seed-1 [seed-1]", "baseline.seed-2"]
    assert systems["baseline"].left_out == {"baseline.seed-1 [seed-2]": "baseline.seed-1 [seed-1]"}
    assert systems["baseline"].mean == pytest.approx((rows["baseline.seed-1 [seed-1]"].bleu + rows["baseline.seed-2"].bleu) / 2)
    assert rows["fused.seed-2"].compared_with == "baseline.seed-2" and systems["fused"].compared == 2


def test_a_fused_run_its_evaluation_compared_with_another_seed_is_compared_with_its_own(evaluated, tmp_path):
    # fused.seed-2 evaluated beside baseline.seed-1 only (its own seed's baseline was evaluated in another job)
    from prlmfuse.evaluate.report import merge_evaluations

    merged_in = _copy_inputs(evaluated, tmp_path / "in")
    results = _evaluate(evaluated, ["baseline.seed-1", "fused.seed-2"], tmp_path / "eval-fused-2", baseline="baseline.seed-1")
    assert json.loads(results.read_text())["rows"][1]["compared_with"] == "baseline.seed-1"
    shutil.copy(results, merged_in / "fused-2.json")
    report = merge_evaluations([merged_in / "seed-1.json", merged_in / "fused-2.json", merged_in / "seed-2.json"],
                               tmp_path / "merged")
    fused = next(r for r in report.rows if r.run == "fused.seed-2")
    assert report.sources["fused.seed-2"].name == "fused-2.json" and fused.compared_with == "baseline.seed-2"
    own = evaluated["evaluations"][2].row("fused.seed-2")
    assert fused.delta["bleu"] == pytest.approx(own.delta["bleu"]) and fused.p_value["bleu"] == pytest.approx(own.p_value["bleu"])


def test_a_seed_significantly_behind_its_baseline_is_not_counted_ahead(evaluated, tmp_path):
    from prlmfuse.evaluate.report import merge_evaluations

    merged_in = _copy_inputs(evaluated, tmp_path / "in")
    refs = (merged_in / "ref.test.txt").read_text(encoding="utf-8").splitlines()
    _rewrite_hypotheses(merged_in / "seed-2.json", "baseline.seed-2", refs)  # a baseline that scores 100
    report = merge_evaluations([merged_in / "seed-1.json", merged_in / "seed-2.json"], tmp_path / "merged")
    fused = next(r for r in report.rows if r.run == "fused.seed-2")
    assert fused.delta["bleu"] < -50 and fused.p_value["bleu"] < 0.05
    systems = {m.system: m for m in report.systems}
    seed_1 = next(r for r in report.rows if r.run == "fused.seed-1")
    ahead = int(seed_1.delta["bleu"] > 0 and seed_1.p_value["bleu"] < 0.05)
    assert systems["fused"].compared == 2 and systems["fused"].significant == ahead


def test_a_stored_score_its_hypotheses_do_not_give_is_refused(evaluated, tmp_path):
    folder = _copy_inputs(evaluated, tmp_path / "in")
    data = json.loads((folder / "seed-2.json").read_text())
    row = next(r for r in data["rows"] if r["run"] == "fused.seed-2")
    row["bleu"] += 1.0
    (folder / "seed-2.json").write_text(json.dumps(data))
    assert "run fused.seed-2 records bleu" in _refusal([folder / "seed-1.json", folder / "seed-2.json"], tmp_path / "o")


def test_runs_decoded_without_scores_are_scored_elsewhere_as_evaluate_scores_them(evaluated, tmp_path):
    """A GPU node without MeCab decodes with `evaluate --no-score` and sends back the folder; `prlmfuse score`
    scores it away from the run directories into what `evaluate` writes, and `report` merges it."""
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.evaluate.report import merge_evaluations

    dirs = [evaluated["dirs"] / "baseline.seed-1", evaluated["dirs"] / "fused.seed-1"]
    decoded = evaluate_runs(dirs, out=tmp_path / "node", beam=2, average_last=2, progress=False, score=False)
    assert decoded.settings["scored"] is False and not (tmp_path / "node" / "scores.png").exists()
    assert all(r.bleu != r.bleu and not r.p_value for r in decoded.rows)  # NaN: nothing scored
    assert decoded.row("fused.seed-1").compared_with == "baseline.seed-1"
    with pytest.raises(UserError, match=r"decoded without scores .*score them first: prlmfuse score"):
        merge_evaluations([tmp_path / "node" / "results.json"], tmp_path / "refused")

    back = shutil.copytree(tmp_path / "node", tmp_path / "returned")  # the folder as it comes back, runs absent
    data = json.loads((back / "results.json").read_text())
    for row in data["rows"]:
        row["run_dir"] = "/on/the/gpu/node/" + row["run"]
    (back / "results.json").write_text(json.dumps(data))
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "score", str(back)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "fused.seed-1" in out.stdout and "Δ" in out.stdout

    scored = json.loads((back / "results.json").read_text())
    reference = evaluated["evaluations"][1]
    assert scored["settings"]["scored"] is True and (back / "scores.png").is_file()
    for row in scored["rows"]:
        expected = reference.row(row["run"])
        assert row["hyp_sha256"] == expected.hyp_sha256
        assert (row["bleu"], row["chrf"], row["signature"]) == (expected.bleu, expected.chrf, expected.signature)
        assert row["distinct_hypotheses"] == len(set((back / row["hyp_file"]).read_text().splitlines()))
    fused = next(r for r in scored["rows"] if r["run"] == "fused.seed-1")
    assert fused["compared_with"] == "baseline.seed-1"
    assert fused["p_value"]["bleu"] == pytest.approx(reference.row("fused.seed-1").p_value["bleu"])
    again = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "score", str(back)], capture_output=True, text=True)
    assert again.returncode == 2 and "already scored" in again.stderr and "Traceback" not in again.stderr

    shutil.copy(evaluated["in"] / "seed-2.json", back / "seed-2.json")
    for f in evaluated["in"].glob("hyp.*seed-2*.txt"):
        shutil.copy(f, back / f.name)
    merged = merge_evaluations([back / "results.json", back / "seed-2.json"], tmp_path / "merged")
    assert {r.run for r in merged.rows} == {"baseline.seed-1", "fused.seed-1", "baseline.seed-2", "fused.seed-2"}


def test_tables_name_a_results_json_by_its_folder():
    from prlmfuse.evaluate.report import file_name

    assert file_name(Path("docs/results/controls/batch-2/results.json")) == "batch-2/results.json"
    assert file_name(Path("merged-in/seed-1.json")) == "seed-1.json"
