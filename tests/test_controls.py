"""Controls that separate what a PrLM learned from the branch's extra parameters, on real small data:
shuffled features, an untrained PrLM of the same architecture, a baseline matched in parameters."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prlmfuse.config import load_pipeline
from prlmfuse.errors import UserError
from prlmfuse.fileio import read_lines
from prlmfuse.train_fused import PrLMUse, train_run
from prlmfuse.train_fused.branches import shuffled_rows
from prlmfuse.train_fused.config import ModelConfig
from prlmfuse.train_fused.matching import (MATCH_TOLERANCE, matched_depth, matched_ffn, run_parameters,
                                           trainable_parameters)
from prlmfuse.train_fused.modeling import FusedTransformer
from prlmfuse.train_fused.run_setup import open_run_branches

from helpers import small_runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("controls")
    corpus = small_runs.small_bible(root)
    ckpt = small_runs.tiny_prlm(root / "bert")
    paths = small_runs.build_caches(ckpt, corpus, root / "cache", layers="-2")
    return corpus, ckpt, paths


def refusal(tmp_path: Path, text: str) -> str:
    """The one-line error pipeline.yaml `text` is refused with (it names the file, line and column)."""
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(text))
    with pytest.raises(UserError) as e:
        load_pipeline(p)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{p}:")
    return message


# ----------------------------------------------------------------------------- shuffled features


def test_shuffled_rows_never_read_the_own_sentence_nor_an_identical_source_text():
    lines = [f"verse {i % 7}" for i in range(40)] + ["alone", "also alone"]  # each text 5-6 times
    rows = shuffled_rows(lines, 1, where="train source")
    assert sorted(rows) == list(range(len(lines)))  # a permutation: every sentence's features read once
    assert all(lines[rows[i]] != lines[i] for i in range(len(lines)))
    assert np.array_equal(rows, shuffled_rows(lines, 1, where="train source"))  # the seed decides it
    assert not np.array_equal(rows, shuffled_rows(lines, 2, where="train source"))


def test_shuffled_rows_refuse_a_split_one_text_fills_more_than_half():
    with pytest.raises(UserError, match="no source text fills more than half") as e:
        shuffled_rows(["amen"] * 6 + ["selah"] * 5, 1, where="dev source")
    assert str(e.value).startswith("dev source:")
    assert sorted(shuffled_rows(["amen"] * 5 + ["selah"] * 5, 1, where="dev source")) == list(range(10))


def test_a_shuffled_run_reads_another_sentences_features_the_same_way_everywhere(world, tmp_path):
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.evaluate.live import translate
    from prlmfuse.evaluate.runs import open_run

    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt), layer=-2, control="shuffled")
    run = small_runs.tiny_run("shuffled", prlms=[use], max_updates=8)
    caches = [small_runs.caches_for(use, paths)]

    branches = open_run_branches(run, corpus, caches)
    for split in ("train", "dev", "test"):
        (branch,) = branches[split]
        expected = shuffled_rows(read_lines(corpus.src_path(split)), run.seed, where=split)
        assert np.array_equal(branch.rows, expected)
    # A batch's features are those of the sentences the permutation names, never the sentence's own.
    from prlmfuse.train_fused.data import batch_features

    (train,) = branches["train"]
    feats = batch_features(train, [0, 1, 2])
    for b, i in enumerate([0, 1, 2]):
        other = train.reader.features(int(train.rows[i]))[list(train.layer_rows)]
        n = other.shape[1]
        torch.testing.assert_close(feats.states[b, :, :n].float(), other.float())
        own = train.reader.features(i)[list(train.layer_rows)]
        assert own.shape != other.shape or not torch.equal(own.float(), other.float())

    # Stopped at update 4 and resumed: the same weights as 8 updates straight (the permutation is the same).
    straight = train_run(run, corpus, caches, tmp_path / "straight", progress=False)
    half = small_runs.tiny_run("shuffled", prlms=[use], max_updates=4)
    train_run(half, corpus, caches, tmp_path / "resumed", progress=False)
    resumed = train_run(run, corpus, caches, tmp_path / "resumed", progress=False)
    a = load_file(str(straight / "checkpoints" / "update-00000008.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "update-00000008.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Evaluation opens the test cache with the training run's permutation of that split.
    view = open_run(straight)
    (test_branch,) = view.open_branches(view.test_cache_paths("test"), source=str(corpus.src_path("test")),
                                        source_name="test source", source_sha256=corpus.src_sha256("test"),
                                        source_lines=int(corpus.splits["test"]["src"]["lines"]))
    assert np.array_equal(test_branch.rows, branches["test"][0].rows)
    results = evaluate_runs([straight], out=tmp_path / "results", beam=1, average_last=1, progress=False)
    info = json.loads((straight / "run.json").read_text())
    assert results.row("shuffled").trainable_parameters == info["trainable_parameters"] > 0

    with pytest.raises(UserError, match="control 'shuffled'") as e:
        translate(straight, ["In the beginning"], device="cpu")
    assert "\n" not in str(e.value)


def test_the_control_is_checked_where_it_is_written(tmp_path):
    assert refusal(tmp_path, """
        cache: {checkpoints: [{name: minilm-l6}]}
        train:
          defaults: {max_updates: 5}
          runs:
            fused: {prlms: [{checkpoint: minilm-l6, control: shufled}]}
    """) == f"{tmp_path / 'p.yaml'}:6:54: train.runs.fused.prlms.0.control: 'shufled' is not one of shuffled"


# ----------------------------------------------------------------------------- matched parameters


@pytest.mark.parametrize("layer, preset", [(-2, "small"), ("concat", "small"), (-2, "tiny")])
def test_a_matched_baseline_lands_within_one_percent(layer, preset):
    from prlmfuse.train_fused.branches import branch_spec

    layers = [5] if layer == -2 else list(range(7))
    spec = branch_spec(PrLMUse(checkpoint="minilm-l6", layer=layer), 384, layers, [], "fixed" if layer == -2 else layer)
    fused = small_runs.tiny_run("fused", preset=preset, prlms=[PrLMUse("minilm-l6", layer)], side="both")
    target = run_parameters(fused, 4000, [spec])
    base = small_runs.tiny_run("matched", preset=preset, match_params="fused")
    width = matched_ffn(base, target, 4000)
    assert width % 8 == 0
    got = run_parameters(small_runs.tiny_run("m", preset=preset, ffn=width), 4000, [])
    assert abs(got - target) <= MATCH_TOLERANCE * target
    # The count is the model's own: the trainable tensors of the model built for real.
    model = FusedTransformer(ModelConfig.from_preset(preset, vocab_size=4000, ffn=width))
    assert got == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("layer", [-2, "concat"])
def test_a_deeper_baseline_grows_both_sides_to_the_nearest_depth_then_lands_within_one_percent(layer):
    from prlmfuse.train_fused.branches import branch_spec

    layers = [5] if layer == -2 else list(range(7))
    spec = branch_spec(PrLMUse(checkpoint="minilm-l6", layer=layer), 384, layers, [], "fixed" if layer == -2 else layer)
    fused = small_runs.tiny_run("fused", preset="small", prlms=[PrLMUse("minilm-l6", layer)], side="both")
    target = run_parameters(fused, 4000, [spec])
    sizes = matched_depth(small_runs.tiny_run("deeper", preset="small", match_params="fused", match_by="depth"),
                          target, 4000)
    n = sizes["enc_layers"] - 3
    assert n >= 1 and sizes["dec_layers"] == 3 + n and sizes["ffn"] % 8 == 0

    def count(depth: int, ffn: int = 1024) -> int:
        return run_parameters(small_runs.tiny_run("m", preset="small", enc_layers=3 + depth, dec_layers=3 + depth,
                                                  ffn=ffn), 4000, [])

    # n is the depth nearest the target at the preset's own FFN; the FFN then closes the rest.
    assert all(abs(count(n) - target) <= abs(count(other) - target) for other in (n - 1, n + 1) if other >= 1)
    got = count(n, sizes["ffn"])
    assert abs(got - target) <= MATCH_TOLERANCE * target
    model = FusedTransformer(ModelConfig.from_preset("small", vocab_size=4000, **sizes))
    assert got == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_matching_a_run_with_prlms_is_refused():
    run = small_runs.tiny_run("x", prlms=[PrLMUse("minilm-l6")])
    with pytest.raises(UserError, match="without PrLMs"):
        matched_ffn(run, 10**6, 600)


@pytest.mark.parametrize("extra, message", [
    ("fused2: {prlms: [{checkpoint: minilm-l6}], match_params: base}",
     "train.runs.fused2.match_params: widens a run without PrLMs"),
    ("m: {match_params: m}", "train.runs.m.match_params: names this run itself"),
    ("m: {match_params: fusd}", "train.runs.m.match_params: no run named 'fusd'; did you mean 'fused'?"),
    ("m: {match_params: fused}, m2: {match_params: m}", "train.runs.m2.match_params: 'm' is itself matched (to 'fused')"),
    ("m: {match_params: fused, ffn: 512}", "train.runs.m.ffn: is chosen by match_params ('fused')"),
    ("m: {match_params: fused, match_by: depth, dec_layers: 4}",
     "train.runs.m.dec_layers: is chosen by match_params ('fused') with match_by depth"),
    ("m: {match_by: depth}", "train.runs.m.match_by: says how match_params grows a run, and this run has no"),
    ("m: {match_params: fused, match_by: deep}", "train.runs.m.match_by: 'deep' is not one of ffn, depth"),
])
def test_match_params_refusals_point_at_the_setting(tmp_path, extra, message):
    text = refusal(tmp_path, """
        cache: {checkpoints: [{name: minilm-l6}]}
        train:
          defaults: {max_updates: 5}
          runs: {base: {}, fused: {prlms: [{checkpoint: minilm-l6}]}, %s}
    """ % extra)
    assert message in text
    # The place is the run's own line, where each of these settings is written.
    assert text.startswith(f"{tmp_path / 'p.yaml'}:5:")


def test_match_by_in_the_defaults_reaches_only_the_matched_runs(tmp_path):
    text = """
        cache: {checkpoints: [{name: minilm-l6}]}
        train:
          defaults: {max_updates: 5, match_by: BY}
          runs: {base: {}, fused: {prlms: [{checkpoint: minilm-l6}]}, grown: {match_params: fused}}
    """
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(text.replace("BY", "depth")))
    cfg = load_pipeline(p)
    assert cfg.run("grown").match_by == "depth"
    assert cfg.run("base").match_by is None and cfg.run("fused").match_by is None
    # ffn is what no match_by means: one value for one model in run.json.
    p.write_text(textwrap.dedent(text.replace("BY", "ffn")))
    assert load_pipeline(p).run("grown").match_by is None
    # A layer count inherited from the defaults is pointed out where it is written.
    message = refusal(tmp_path, text.replace("BY", "depth, enc_layers: 4"))
    assert message.startswith(f"{p}:4:") and "train.defaults.enc_layers: is chosen by match_params" in message


def test_a_depth_match_that_cannot_land_says_why():
    run = small_runs.tiny_run("deeper", preset="small", match_params="fused", match_by="depth")
    with pytest.raises(UserError, match="match_by depth adds at least one layer on each side \\(4\\+4 layers\\)"):
        matched_depth(run, 3_000_000, 4000)  # under what one more layer pair leaves at the narrowest FFN


def _pipeline(tmp_path: Path, ckpt: Path, corpus, runs: str, entries: str = "") -> Path:
    p = tmp_path / "pipeline.yaml"
    files = {f"{s}_{side}": str(getattr(corpus, f"{side}_path")(s)) for s in ("train", "dev", "test") for side in ("src", "tgt")}
    p.write_text(textwrap.dedent(f"""
        workdir: {tmp_path / 'work'}
        data:
          kind: text
          src: en
          tgt: ja
          files: {json.dumps(files)}
        cache:
          checkpoints:
            - {{name: {ckpt}, layers: [-2]}}
        {entries}
        train:
          defaults: {{preset: tiny, bpe_vocab: 600, max_tokens: 300, max_updates: 4, max_epochs: null, save_every: 4,
                      warmup: 4, num_workers: 0, seed: 3}}
          runs:
        {runs}
    """))
    return p


def test_a_matched_run_trains_at_its_width_and_records_its_count(world, tmp_path):
    from prlmfuse.pipeline import train_runs
    from prlmfuse.pipeline_inputs import build_caches, ensure_data, planned_parameters
    from prlmfuse.plan import plan_lines

    corpus, ckpt, _ = world
    p = _pipeline(tmp_path, ckpt, corpus, f"""
            fused: {{prlms: [{{checkpoint: {ckpt}, layer: -2}}], side: both}}
            matched: {{match_params: fused}}
            deeper: {{match_params: fused, match_by: depth}}""")
    cfg = load_pipeline(p)
    ensure_data(cfg)
    target = planned_parameters(cfg, cfg.run("fused"))
    plan = "\n".join(plan_lines(cfg, None))
    assert f"matched to fused's {target:,}" in plan and "ffn 128;" in plan  # the tiny preset's own width for fused
    assert f"matched to fused's {target:,} by depth" in plan
    build_caches(cfg, ensure_data(cfg, build=False))
    matched_dir, deeper_dir = train_runs(cfg, ["matched", "deeper"])
    info = json.loads((matched_dir / "run.json").read_text())
    assert info["train"]["match_params"] == "fused" and info["model"]["ffn"] == info["train"]["ffn"] > 128
    assert info["model"]["enc_layers"] == info["model"]["dec_layers"] == 2  # the tiny preset's own depth
    deeper = json.loads((deeper_dir / "run.json").read_text())
    assert deeper["train"]["match_by"] == "depth"
    assert deeper["model"]["enc_layers"] == deeper["model"]["dec_layers"] == deeper["train"]["enc_layers"] > 2
    for run_dir, record in ((matched_dir, info), (deeper_dir, deeper)):
        weights = load_file(str(run_dir / "checkpoints" / "update-00000004.safetensors"))
        assert record["trainable_parameters"] == sum(t.numel() for t in weights.values())
    # Both counted at the configured bpe_vocab; the trained BPE may hold fewer ids, so run.json's count
    # is the model's own and the match holds at the configured size.
    for name in ("matched", "deeper"):
        assert abs(planned_parameters(cfg, cfg.run(name)) - target) <= MATCH_TOLERANCE * target


# ----------------------------------------------------------------------------- an untrained PrLM


def test_an_untrained_prlm_is_its_own_checkpoint_with_its_own_cache_key(world, tmp_path):
    from prlmfuse.pipeline_inputs import cache_jobs, ensure_data
    from prlmfuse.prlms import resolve_checkpoint

    corpus, ckpt, _ = world
    p = _pipeline(tmp_path, ckpt, corpus, f"""
            fused: {{prlms: [{{checkpoint: {ckpt}, layer: -2}}]}}
            untrained: {{prlms: [{{checkpoint: bert-untrained, layer: -2}}]}}""",
                  entries=f"    - {{name: bert-untrained, checkpoint: {ckpt}, init: random, seed: 4, layers: [-2]}}")
    cfg = load_pipeline(p)
    jobs = cache_jobs(cfg, ensure_data(cfg))
    trained = {j.split: j for j in jobs if j.entry.init == "pretrained"}
    untrained = {j.split: j for j in jobs if j.entry.init == "random"}
    assert set(trained) == set(untrained) == {"train", "dev", "test"}
    assert all(trained[s].out != untrained[s].out for s in trained)
    directory = Path(untrained["train"].checkpoint)
    assert directory == cfg.workdir / "checkpoints" / "bert-untrained"
    a, b = resolve_checkpoint(str(ckpt)), resolve_checkpoint(str(directory))
    assert (a.family, a.num_layers, a.hidden_size) == (b.family, b.num_layers, b.hidden_size)
    assert a.identity != b.identity
    from transformers import AutoTokenizer

    text = "In the beginning God created the heaven and the earth."
    assert AutoTokenizer.from_pretrained(str(directory))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(ckpt))(text)["input_ids"]
    made = (directory / "model.safetensors").stat().st_mtime_ns
    cache_jobs(cfg, ensure_data(cfg, build=False))  # made once, then reused
    assert (directory / "model.safetensors").stat().st_mtime_ns == made
    # Another seed gives other weights.
    from prlmfuse.prlms.random_init import prepare_random_init

    other = prepare_random_init(str(ckpt), tmp_path / "seed-5", 5)
    w4, w5 = load_file(str(directory / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert any(not torch.equal(w4[k], w5[k]) for k in w4 if w4[k].is_floating_point() and w4[k].numel() > 1)


@pytest.mark.parametrize("entry, message", [
    ("{name: minilm-l6, init: random}", "init: random needs a name of its own and `checkpoint`"),
    ("{name: x, checkpoint: minilm-l6, init: randm}", "cache.checkpoints.1.init: 'randm' is not one of pretrained, random"),
    ("{name: x, checkpoint: minilm-l6, seed: 3}", "cache.checkpoints.1.seed: only init: random reads seed"),
    ("{name: minilm-l6, checkpoint: e5-small-multilingual}", "cache.checkpoints.1.name: 'minilm-l6' names another checkpoint"),
])
def test_checkpoint_entry_refusals(tmp_path, entry, message):
    assert message in refusal(tmp_path, f"""
        cache:
          checkpoints:
            - {{name: minilm-l6}}
            - {entry}
        train: {{defaults: {{max_updates: 5}}, runs: {{base: {{}}}}}}
    """)


def test_trainable_parameters_count_only_what_trains():
    config = ModelConfig.from_preset("tiny", vocab_size=600)
    model = FusedTransformer(config)
    assert trainable_parameters(config) == sum(p.numel() for p in model.parameters() if p.requires_grad)
