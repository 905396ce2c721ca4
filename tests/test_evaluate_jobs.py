"""Batch-evaluation pieces that need no trained model: run checks, cache compatibility, result files."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest

from prlmfuse.cache_features import check_key_fields, choose_layers, layer_rows
from prlmfuse.errors import UserError
from prlmfuse.evaluate.plots import plot_scores
from prlmfuse.evaluate.results import EvaluationResults, RunResult, results_markdown, write_results
from prlmfuse.evaluate.runs import open_run
from prlmfuse.evaluate.settings import DecodeSettings
from prlmfuse.train_fused.run_dir import read_dev_curve

TRAIN_FIELDS = {
    "format": 1,
    "checkpoint": "tiny-bert",
    "checkpoint_identity": "a" * 64,
    "family": "bert",
    "num_layers": 2,
    "hidden_size": 32,
    "layers": [1],
    "pooled_layers": [0, 1],
    "dtype": "float16",
    "precision": "fp32",
    "truncation": {"max_length": 64, "mode": "middle", "head": "1/4"},
    "corpus_sha256": "1" * 64,
    "prlmfuse_version": "0.1.0",
}
PRLM = {"checkpoint": "tiny-bert", "layer": -1, "layers": [1], "pooled_layers": [], "layer_mode": "fixed",
        "key_fields": TRAIN_FIELDS}


def _fields(**changes):
    return dict(TRAIN_FIELDS, corpus_sha256="2" * 64, **changes)


def test_test_cache_of_same_checkpoint_and_settings_is_accepted():
    check_key_fields(_fields(), TRAIN_FIELDS, where="test-cache")
    # Computed at another precision (another machine's default): the same features within rounding.
    check_key_fields(_fields(precision="bf16"), TRAIN_FIELDS, where="test-cache")
    check_key_fields(_fields(precision="fp16"), TRAIN_FIELDS, where="test-cache")
    # More layers than the run trained on is fine: the run's rows are picked out.
    check_key_fields(_fields(layers=[0, 1, 2], pooled_layers=[0, 1, 2]), TRAIN_FIELDS, where="test-cache")
    # A training cache that kept the pooled vectors of layers 0..highest (written before they were
    # limited to the stored layers), and a test cache with the stored layer's only: the same features.
    check_key_fields(_fields(pooled_layers=[1]), TRAIN_FIELDS, where="test-cache")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"checkpoint_identity": "b" * 64}, "checkpoint_identity"),
        ({"dtype": "int8"}, "dtype"),
        ({"truncation": {"max_length": 32, "mode": "middle", "head": "1/4"}}, "truncation"),
        ({"layers": [2]}, "layers"),
    ],
)
def test_test_cache_with_different_key_is_refused(change, field):
    with pytest.raises(UserError, match=field) as info:
        check_key_fields(_fields(**change), TRAIN_FIELDS, where="test-cache")
    assert "test-cache" in str(info.value) and "\n" not in str(info.value)


def test_layer_rows_pick_trained_layers_from_a_superset_cache():
    cache = SimpleNamespace(layers=[0, 1, 2], pooled_layers=[0, 1, 2])
    assert layer_rows(cache, [1], [], where="c") == ((1,), None)
    wide = SimpleNamespace(layers=[0, 1, 2, 3], pooled_layers=[0, 1, 2, 3])
    assert layer_rows(wide, [1, 2], [0, 1, 2], where="c") == ((1, 2), (0, 1, 2))
    with pytest.raises(UserError, match="trained on"):
        layer_rows(SimpleNamespace(layers=[1, 2], pooled_layers=[0, 1, 2]), [3], [], where="c")
    with pytest.raises(UserError, match="pooled layers"):
        layer_rows(SimpleNamespace(layers=[1, 2], pooled_layers=[0, 1]), [1, 2], [0, 1, 2], where="c")


def test_layer_choice_reads_one_layer_or_every_cached_layer():
    fields = dict(TRAIN_FIELDS, layers=[1, 2], pooled_layers=[0, 1, 2])
    assert choose_layers(-1, fields, checkpoint="b", where="c") == ([2], [], "fixed")
    assert choose_layers("dwatt", fields, checkpoint="b", where="c") == ([1, 2], [], "dwatt")
    assert choose_layers("dyn_cls", fields, checkpoint="b", where="c") == ([1, 2], [1, 2], "dyn_cls")
    # Dyn[CLS]/Dyn[Aver] weigh layers 1..L only; DWAtt and Concat keep the embedding layer.
    every = dict(fields, layers=[0, 1, 2])
    assert choose_layers("dyn_aver", every, checkpoint="b", where="c") == ([1, 2], [1, 2], "dyn_aver")
    assert choose_layers("concat", every, checkpoint="b", where="c") == ([0, 1, 2], [], "concat")
    with pytest.raises(UserError, match=r"transformer layers 1\.\.2.*layers: all"):
        choose_layers("dyn_cls", dict(fields, layers=[0]), checkpoint="b", where="c")
    with pytest.raises(UserError, match=r"layer 0 \(hidden_states index 0 of 2 layers\) is not in cache c"):
        choose_layers(0, fields, checkpoint="b", where="c")
    for outside in (3, -4):  # a layer the PrLM does not have: no rebuild of the cache can provide it
        with pytest.raises(UserError, match=rf"layer {outside} is outside its hidden states; valid range is -3\.\.2 "):
            choose_layers(outside, fields, checkpoint="b", where="c")
    with pytest.raises(UserError, match="no pooled vectors"):
        choose_layers("dyn_aver", dict(fields, pooled_layers=[]), checkpoint="b", where="c")


def test_run_dir_without_checkpoints_is_a_one_line_user_error(tmp_path):
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"name": "run-a", "model": {}, "corpus": {}}))
    with pytest.raises(UserError) as info:
        open_run(run_dir)
    message = str(info.value)
    assert str(run_dir) in message and "train it first" in message and "\n" not in message
    with pytest.raises(UserError, match="run directory not found"):
        open_run(tmp_path / "missing")


def test_dev_curve_reads_dev_rows_and_skips_torn_lines(tmp_path):
    rows = [
        {"update": 50, "loss": 9.0, "lr": 1e-4},
        {"update": 100, "dev_loss": 7.5, "epoch": 0},
        {"update": 200, "dev_loss": 6.25, "epoch": 1},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"update": 300, "dev_lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert read_dev_curve(tmp_path) == [(100, 7.5), (200, 6.25)]


def _row(run, bleu, prlm="-", **kw):
    base = dict(
        run=run, test_set="test", run_dir=f"/runs/{run}", task="translation", prlm=prlm, layer="-2" if prlm != "-" else "-",
        merge="sum" if prlm != "-" else "-", position="ffn" if prlm != "-" else "-", side="source" if prlm != "-" else "-",
        num_sentences=10, bleu=bleu, chrf=40.0, rouge1=50.0, rouge2=30.0, rougeL=45.0, sentences_per_s=12.5,
        tokens_per_s=300.0, decode_seconds=0.8, checkpoints=["update-00000010.safetensors"], hyp_file=f"hyp.{run}.test.txt",
        reused=False, signature={"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"},
        ci_low=bleu - 1.5, ci_high=bleu + 1.25,
    )
    base.update(kw)
    return RunResult(**base)


def test_result_files_hold_the_table(tmp_path):
    rows = [
        _row("baseline", 20.0),
        _row("minilm", 21.5, prlm="minilm-l6", delta={"bleu": 1.5}, p_value={"bleu": 0.012}),
    ]
    results = EvaluationResults(
        out=tmp_path, baseline="baseline", rows=rows,
        settings={"beam": 5, "lenpen": 1.0, "average_last": 5, "bootstrap_samples": 1000, "seed": 12345},
    )
    write_results(results)
    plot_scores(results, tmp_path / "scores.png")
    md = (tmp_path / "results.md").read_text()
    assert "| run | PrLM | layer | merge | position | side | BLEU (Δ, p) | chrF |" in md
    assert "| minilm | minilm-l6 | -2 | sum | ffn | source | 21.50 (+1.50, p=0.012*) | 40.00 |" in md
    assert "| baseline | - | - | - | - | - | 20.00 (-) |" in md
    assert "tok:13a" in md
    table = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["run"] for r in table] == ["baseline", "minilm"]
    assert float(table[1]["bleu_delta"]) == 1.5 and float(table[1]["bleu_p"]) == 0.012
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["baseline"] == "baseline" and data["rows"][1]["p_value"] == {"bleu": 0.012}
    assert (tmp_path / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarization_table_has_rouge_columns(tmp_path):
    rows = [_row("base", 10.0, task="summarization", main_metric="rougeL", ci_low=44.0, ci_high=46.0)]
    results = EvaluationResults(
        out=tmp_path, baseline=None, rows=rows,
        settings={"beam": 5, "lenpen": 1.0, "average_last": 5, "bootstrap_samples": 1000, "seed": 12345},
    )
    md = results_markdown(results)
    assert "R-1 | R-2 | R-L (Δ, p)" in md
    assert "rougeL [44.00, 46.00]" in md
    assert not math.isnan(rows[0].rougeL)


def test_fused_runs_are_compared_with_the_baseline_of_their_own_seed(tmp_path):
    from prlmfuse.evaluate.bootstrap import matched_baselines
    from prlmfuse.evaluate.runs import RunView

    recipe = {"preset": "small", "lr": 7e-4, "max_updates": 2000}

    def view(name, seed, prlms=(), **train):
        record = {"train": dict(recipe, name=name, seed=seed, **train), "prlms": list(prlms)}
        return RunView(run_dir=tmp_path / name, name=name, record=record, corpus=None, checkpoints=())

    runs = [
        view("baseline.seed-1", 1), view("baseline.seed-2", 2), view("fused.seed-1", 1, [PRLM]),
        view("fused.seed-2", 2, [PRLM]), view("gate", 1, [PRLM], merge="gate"),
        view("fused.seed-3", 3, [PRLM]),  # no baseline of seed 3: the named one
        view("long-baseline", 2, max_updates=9000),  # another recipe: not a seed sibling, compared with its seed's
        view("long-baseline.seed-3", 3, max_updates=9000),  # no baseline of seed 3: the named one
    ]
    assert matched_baselines(runs, "baseline.seed-1") == {
        "baseline.seed-2": "baseline.seed-1",
        "fused.seed-1": "baseline.seed-1",
        "fused.seed-2": "baseline.seed-2",
        "gate": "baseline.seed-1",
        "fused.seed-3": "baseline.seed-1",
        "long-baseline": "baseline.seed-2",
        "long-baseline.seed-3": "baseline.seed-1",
    }
    assert matched_baselines(runs, None) == {}


@pytest.mark.parametrize("task, asked, blocked", [("summarization", None, 3), ("translation", None, 0),
                                                  ("summarization", 0, 0), ("translation", 4, 4)])
def test_ngram_blocking_defaults_to_trigrams_for_summarization_only(task, asked, blocked):
    settings = DecodeSettings.for_run(SimpleNamespace(task=task), asked, beam=5)
    assert settings.no_repeat_ngram_size == blocked and settings.beam == 5
