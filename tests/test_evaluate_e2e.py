"""End to end on tiny real pieces: random-weight BERT -> caches -> two trained runs -> evaluate_runs / translate."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from prlmfuse.errors import UserError

WORDS = "light dark water earth sky seed grass star day night god land sea fish bird tree".split()


def _tiny_bert(out: Path) -> Path:
    """A 2-layer, 32-wide random BERT with a WordPiece tokenizer, saved like a real checkpoint."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=64,
    )
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    out.mkdir(parents=True)
    BertModel(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _write_split(folder: Path, name: str, n: int, rng: random.Random) -> tuple[Path, Path]:
    # Toy "translation": reverse the words and capitalise them.
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        src.append(" ".join(words))
        tgt.append(" ".join(w.capitalize() for w in reversed(words)))
    s, t = folder / f"{name}.src", folder / f"{name}.tgt"
    s.write_text("\n".join(src) + "\n")
    t.write_text("\n".join(tgt) + "\n")
    return s, t


def _run_config(name, prlms=()):
    from prlmfuse.train_fused.config import RunConfig

    return RunConfig(
        name=name, preset="tiny", prlms=list(prlms), bpe_vocab=400, max_tokens=256, max_updates=12, max_epochs=None,
        warmup=4, lr=2e-3, save_every=4, keep_last=5, log_every=4, num_workers=0, seed=1,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A corpus, its caches and two trained runs (baseline, fused); built once for the module."""
    from prlmfuse.cache_features import build_cache
    from prlmfuse.corpora import register_text
    from prlmfuse.train_fused import train_run
    from prlmfuse.train_fused.config import PrLMUse

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("e2e")
    rng = random.Random(0)
    raw = root / "raw"
    raw.mkdir()
    files = {split: _write_split(raw, split, n, rng) for split, n in (("train", 64), ("dev", 8), ("test", 10))}
    corpus = register_text(
        root / "corpus", train_src=files["train"][0], train_tgt=files["train"][1], dev_src=files["dev"][0],
        dev_tgt=files["dev"][1], test_src=files["test"][0], test_tgt=files["test"][1], src_lang="en", tgt_lang="en",
    )
    checkpoint = str(_tiny_bert(root / "tiny-bert"))
    caches = {}
    for split in ("train", "dev", "test"):
        caches[split] = build_cache(
            checkpoint, corpus.src_path(split), root / "caches" / split, layers="-2", dtype="float16",
            precision="fp32", progress=False,
        ).path
    use = PrLMUse(checkpoint=checkpoint, layer=-2)
    baseline = train_run(_run_config("baseline"), corpus, [], root / "runs" / "baseline", progress=False)
    fused = train_run(
        _run_config("fused", [use]), corpus,
        [{"train": caches["train"], "dev": caches["dev"], "test": caches["test"]}],
        root / "runs" / "fused", progress=False,
    )
    return {"root": root, "corpus": corpus, "checkpoint": checkpoint, "caches": caches,
            "baseline": Path(baseline), "fused": Path(fused)}


def test_evaluate_runs_writes_every_file_and_skips_unchanged_runs(world):
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.fileio import read_lines

    out = world["root"] / "eval"
    results = evaluate_runs([world["baseline"], world["fused"]], out=out, beam=2, average_last=3, progress=False)
    assert results.baseline == "baseline"  # the one run without PrLM branches
    for name in ("results.md", "results.csv", "results.json", "scores.png", "dev_loss.png", "dev_loss.json",
                 "hyp.baseline.test.txt", "hyp.fused.test.txt"):
        assert (out / name).is_file(), name
    assert (out / "scores.png").read_bytes()[:4] == b"\x89PNG"
    curves = json.loads((out / "dev_loss.json").read_text())
    for name in ("baseline", "fused"):  # the dev evaluations metrics.jsonl records, in order
        logged = [json.loads(line) for line in (world[name] / "metrics.jsonl").read_text().splitlines()]
        assert curves["runs"][name] == [[r["update"], r["dev_loss"]] for r in logged if "dev_loss" in r] != []
        assert curves["nll"][name] == [[r["update"], r["dev_nll_loss"]] for r in logged if "dev_loss" in r] != []
    assert len(read_lines(out / "hyp.fused.test.txt")) == 10
    fused = results.row("fused")
    assert fused.prlm == "tiny-bert" and fused.layer == "-2" and fused.merge == "sum"
    assert len(fused.checkpoints) == 3  # average of the last 3 of the kept checkpoints
    assert "bleu" in fused.delta and 0.0 < fused.p_value["bleu"] <= 1.0
    assert fused.sentences_per_s > 0 and fused.tokens_per_s >= 0
    assert fused.ci_low <= fused.bleu <= fused.ci_high
    md = (out / "results.md").read_text()
    assert "| fused |" in md and "| baseline |" in md and "tok:13a" in md
    assert not any(r.reused for r in results.rows)
    for row in results.rows:  # what the hypotheses show, recorded for translation too (no copy share)
        hyps = read_lines(out / row.hyp_file, check_text=False)
        assert row.distinct_share == len(set(hyps)) / 10 and row.distinct_hypotheses == len(set(hyps))
        assert row.top_hypothesis_count == max(hyps.count(h) for h in hyps) and row.copy_share is None

    hyp_before = (out / "hyp.fused.test.txt").read_bytes()
    again = evaluate_runs([world["baseline"], world["fused"]], out=out, beam=2, average_last=3, progress=False)
    assert all(r.reused for r in again.rows)
    assert (out / "hyp.fused.test.txt").read_bytes() == hyp_before
    assert again.row("fused").bleu == fused.bleu

    # A decode setting that changes hypotheses is a new key: decoded again.
    third = evaluate_runs([world["fused"]], out=out, beam=1, average_last=3, progress=False)
    assert not third.row("fused").reused


def test_a_summarization_run_records_the_share_of_its_words_found_in_its_source(world, monkeypatch):
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.evaluate.results import hypothesis_figures
    from prlmfuse.evaluate.runs import RunView
    from prlmfuse.fileio import read_lines

    monkeypatch.setattr(RunView, "task", property(lambda self: "summarization"))
    out = world["root"] / "eval-summarization"
    row = evaluate_runs([world["baseline"]], out=out, beam=1, average_last=3, progress=False).row("baseline")
    hyps, sources = read_lines(out / row.hyp_file, check_text=False), read_lines(world["corpus"].src_path("test"))
    assert row.main_metric == "rougeL" and row.copy_share is not None
    assert row.copy_share == hypothesis_figures(hyps, sources, task="summarization")["copy_share"]
    assert json.loads((out / "results.json").read_text())["rows"][0]["copy_share"] == row.copy_share


def test_live_features_give_the_same_hypotheses_as_the_cache(world):
    from prlmfuse.evaluate import evaluate_runs, translate
    from prlmfuse.fileio import read_lines

    out = world["root"] / "eval-live"
    results = evaluate_runs([world["fused"]], out=out, beam=2, average_last=2, progress=False)
    cached = read_lines(out / results.row("fused").hyp_file)
    lines = read_lines(world["corpus"].src_path("test"))
    live = translate(world["fused"], lines, beam=2, average_last=2)
    assert live == cached
    # Order and batching do not matter: a subset gives the same lines.
    assert translate(world["fused"], lines[3:6], beam=2, average_last=2) == cached[3:6]


def test_test_cache_built_differently_is_refused(world):
    from prlmfuse.cache_features import build_cache
    from prlmfuse.evaluate import evaluate_runs

    other = world["root"] / "runs" / "fused-f32"
    shutil.copytree(world["fused"], other)
    f32 = build_cache(world["checkpoint"], world["corpus"].src_path("test"), world["root"] / "caches" / "test-f32",
                      layers="-2", dtype="float32", precision="fp32", progress=False)
    record = json.loads((other / "run.json").read_text())
    record["name"] = "fused-f32"
    record["prlms"][0]["caches"]["test"] = {"path": f32.path, "key": f32.key}
    (other / "run.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match="dtype") as info:
        evaluate_runs([other], out=world["root"] / "eval-f32", beam=1, progress=False)
    assert f32.path in str(info.value)


def test_test_cache_of_another_source_is_refused_and_run_json_suffices_without_the_train_cache(world):
    from prlmfuse.cache_features import build_cache
    from prlmfuse.evaluate import evaluate_runs

    def copy_with(name: str, **caches) -> Path:
        run = world["root"] / "runs" / name
        shutil.copytree(world["fused"], run)
        record = json.loads((run / "run.json").read_text())
        record["name"] = name
        record["prlms"][0]["caches"].update(caches)
        (run / "run.json").write_text(json.dumps(record))
        return run

    dev = build_cache(world["checkpoint"], world["corpus"].src_path("dev"), world["root"] / "caches" / "dev-as-test",
                      layers="-2", dtype="float16", precision="fp32", progress=False)
    stale = copy_with("fused-stale", test={"path": dev.path, "key": dev.key})
    with pytest.raises(UserError, match="different test source") as info:
        evaluate_runs([stale], out=world["root"] / "eval-stale", beam=1, progress=False)
    assert dev.path in str(info.value)

    # The training cache is gone: run.json's record of its key fields is what the test cache must match.
    orphan = copy_with("fused-orphan", train={"path": str(world["root"] / "deleted"), "key": "0" * 64})
    results = evaluate_runs([orphan], out=world["root"] / "eval-orphan", beam=1, progress=False)
    assert results.row("fused-orphan").num_sentences == 10


def test_evaluating_an_untrained_run_dir_is_a_user_error(world, tmp_path):
    from prlmfuse.evaluate import evaluate_runs

    empty = tmp_path / "not-trained"
    empty.mkdir()
    with pytest.raises(UserError, match="train it first"):
        evaluate_runs([world["baseline"], empty], out=tmp_path / "eval", progress=False)


def test_translate_command_reads_stdin_and_passes_every_decoding_option(world):
    from click.testing import CliRunner

    from prlmfuse.cli import cli
    from prlmfuse.evaluate import translate
    from prlmfuse.evaluate.runs import load_model, open_run, select_weights
    from prlmfuse.fileio import read_lines

    lines = read_lines(world["corpus"].src_path("test"))[:4]
    options = dict(beam=1, lenpen=0.5, max_len_a=0.0, max_len_b=4, min_len=4, no_repeat_ngram_size=2, average_last=2)
    argv = ["translate", "--run", str(world["fused"])]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(cli, argv, input="".join(line + "\n" for line in lines))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == translate(world["fused"], lines, **options)
    # max_len_a = 0, max_len_b = 4 and min_len = 4: four subwords per output; a cap of two gives at most two,
    # so the options reach the search whatever length this barely trained model would choose itself.
    run = open_run(world["fused"])
    _, bpe = load_model(run, select_weights(run, 2))
    assert [len(bpe.encode(h)) for h in result.stdout.splitlines()] == [4] * len(lines)
    short = translate(world["fused"], lines, average_last=2, max_len_a=0.0, max_len_b=2)
    assert all(len(bpe.encode(h)) <= 2 for h in short)


def test_reports_list_the_baseline_first_mark_significant_deltas_and_name_settings(world, tmp_path):
    import dataclasses

    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.evaluate.plots import plot_scores
    from prlmfuse.evaluate.results import EvaluationResults, results_markdown

    out = world["root"] / "eval-order"
    # Directories in the other order: the reports still start with the baseline.
    results = evaluate_runs([world["fused"], world["baseline"]], out=out, beam=2, average_last=3, progress=False)
    assert [r.run for r in results.rows] == ["baseline", "fused"]
    md = (out / "results.md").read_text()
    assert md.index("| baseline |") < md.index("| fused |")
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["baseline", "fused"]
    assert "* marks p < 0.05" in md

    # The same rows with a significant and a non-significant p: only the first is marked.
    fused = results.row("fused")
    marked = {}
    for p in (0.01, 0.2):
        row = dataclasses.replace(fused, p_value={"bleu": p}, delta={"bleu": 1.5})
        text = results_markdown(EvaluationResults(out, "baseline", [results.row("baseline"), row], results.settings))
        marked[p] = next(line for line in text.splitlines() if line.startswith("| fused |"))
    assert "p=0.010*)" in marked[0.01] and "p=0.200)" in marked[0.2]
    plot_scores(EvaluationResults(out, "baseline", [results.row("baseline"), dataclasses.replace(
        fused, p_value={"bleu": 0.01}, delta={"bleu": 1.5})], results.settings), tmp_path / "scores-significant.png")
    assert (tmp_path / "scores-significant.png").read_bytes()[:4] == b"\x89PNG"


def test_setting_labels_name_prlm_layer_merge_position_side():
    from prlmfuse.evaluate.results import setting_label

    assert setting_label("baseline", {"prlm": "-", "layer": "-"}) == "baseline: no PrLM"
    fused = {"prlm": "minilm-l6", "layer": "-2", "merge": "sum", "position": "ffn", "side": "source"}
    assert setting_label("fused", fused) == "fused: minilm-l6 L-2, sum/ffn/source"
    two = {"prlm": "minilm-l6 + e5", "layer": "-2 + dyn_cls", "merge": "gate", "position": "attn", "side": "both"}
    assert setting_label("two", two) == "two: minilm-l6 L-2 + e5 dyn_cls, gate/attn/both"


def test_evaluate_command_ends_with_a_summary_a_person_reads(world, capsys, monkeypatch):
    from helpers.reliability import run_cli
    from prlmfuse.fileio import read_lines

    out = world["root"] / "eval-summary"
    code, stdout, err = run_cli(["evaluate", "--runs", world["fused"], world["baseline"], "--out", out, "--beam", "2",
                                 "--average-last", "3"], capsys, monkeypatch)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == f"results: {out / 'results.md'}"
    assert lines[1] == "BLEU on test (10 sentences):"
    assert lines[2].lstrip().startswith("baseline: no PrLM") and lines[2].endswith("(baseline)")
    assert lines[3].lstrip().startswith("fused: tiny-bert L-2, sum/add_norm1/both") and " Δ " in lines[3] and " p=" in lines[3]
    sources = read_lines(world["corpus"].src_path("test"))
    refs = read_lines(world["corpus"].tgt_path("test"))
    hyps = read_lines(out / "hyp.fused.test.txt")
    examples = [i for i, line in enumerate(lines) if line.startswith("example: test line ")]
    assert len(examples) == 2
    for at in examples:
        n = int(lines[at].rsplit(" ", 1)[1]) - 1
        block = [line.split(None, 1) for line in lines[at + 1:at + 5]]
        assert [b[0] for b in block] == ["source", "reference", "baseline", "fused"]
        assert block[0][1] == sources[n] and block[1][1] == refs[n] and block[3][1:] == ([hyps[n]] if hyps[n] else [])
    assert lines[-1] == f"plots: {out / 'scores.png'}, {out / 'dev_loss.png'}"
    # Hypotheses are the model's own output: a control character in one is shown, never refused as input would be.
    from prlmfuse.evaluate import evaluate_runs, summary_lines

    results = evaluate_runs([world["fused"], world["baseline"]], out=out, beam=2, average_last=3, progress=False)
    hyp_file = out / "hyp.fused.test.txt"
    hyp_file.write_text("\x01" + hyp_file.read_text(encoding="utf-8"), encoding="utf-8")
    assert summary_lines(results)[-1] == lines[-1]


def test_evaluate_command_scores_dev_when_asked(world, capsys, monkeypatch):
    from helpers.reliability import run_cli
    from prlmfuse.fileio import read_lines

    out = world["root"] / "eval-dev"
    code, stdout, err = run_cli(["evaluate", "--runs", world["fused"], world["baseline"], "--out", out, "--beam", "1",
                                 "--average-last", "1", "--split", "dev"], capsys, monkeypatch)
    assert code == 0, err
    assert stdout.splitlines()[1] == "BLEU on dev (8 sentences):"
    assert len(read_lines(out / "hyp.fused.dev.txt")) == 8
    assert not (out / "hyp.fused.test.txt").exists()
    assert "## dev (8 sentences)" in (out / "results.md").read_text()
