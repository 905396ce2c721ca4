"""Wrong or silent results, refused or redone: edited corpus files, damaged test caches, stale checkpoint
averages, float16 overflow and int8 outliers.

Everything here runs on real files: a small real Bible corpus, a random-weight BERT, its caches and
seconds-long runs, built once for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import reliability, small_runs
from prlmfuse.errors import UserError
from prlmfuse.fileio import sha256_file

torch.set_num_threads(1)


def _same_size_edit(path: Path) -> None:
    """Change one letter of the first line: the file keeps its size and its line count."""
    data = bytearray(path.read_bytes())
    i = next(i for i, b in enumerate(data) if chr(b).isalpha())
    data[i] = ord("q") if data[i] != ord("q") else ord("z")
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A corpus, a tiny PrLM, its caches and a trained fused run."""
    from prlmfuse.train_fused import train_run
    from prlmfuse.train_fused.config import PrLMUse

    root = tmp_path_factory.mktemp("results")
    corpus = small_runs.small_bible(root / "corpus", train=120, dev=12, test=12)
    prlm = small_runs.tiny_prlm(root / "prlm")
    paths = small_runs.build_caches(prlm, corpus, root / "cache")
    use = PrLMUse(checkpoint=str(prlm), layer=-2)
    run = small_runs.tiny_run("fused", prlms=[use])
    train_run(run, corpus, [small_runs.caches_for(use, paths)], root / "runs" / "fused", progress=False)
    return {"root": root, "corpus": corpus, "prlm": prlm, "paths": paths, "use": use, "run": run}


def _copy_corpus(world, tmp_path: Path):
    from prlmfuse.corpora import load_corpus

    shutil.copytree(world["corpus"].root, tmp_path / "corpus")
    return load_corpus(tmp_path / "corpus")


# ------------------------------------------------------------------------------------------ edited corpus files


def test_a_same_size_edit_of_train_src_is_refused_by_every_stage(world, tmp_path):
    from prlmfuse.corpora import load_corpus
    from prlmfuse.evaluate import evaluate_runs
    from prlmfuse.train_fused import train_run

    corpus = _copy_corpus(world, tmp_path)
    train_src = corpus.src_path("train")
    size, lines = train_src.stat().st_size, train_src.read_bytes().count(b"\n")
    _same_size_edit(train_src)
    assert (train_src.stat().st_size, train_src.read_bytes().count(b"\n")) == (size, lines)

    # Opening the corpus (every stage does) names the file and the fix in one line.
    with pytest.raises(UserError, match=r"train\.src: content differs .*rebuild the corpus") as error:
        load_corpus(corpus.root)
    assert "\n" not in str(error.value)
    # Training with a Corpus opened before the edit checks the files again before it reads them.
    with pytest.raises(UserError, match=r"train\.src: content differs"):
        train_run(world["run"], corpus, [world["paths"]], tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "run.json").exists()

    # Evaluation (and translate, through the same open_run) of a run trained on this corpus.
    run_dir = tmp_path / "evaluated"
    shutil.copytree(world["root"] / "runs" / "fused", run_dir)
    info = json.loads((run_dir / "run.json").read_text())
    info["corpus"]["root"] = str(corpus.root)
    (run_dir / "run.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match=r"train\.src: content differs"):
        evaluate_runs([run_dir], out=tmp_path / "results", progress=False)


PIPELINE = """\
workdir: {work}
data:
  kind: text
  src: en
  tgt: ja
  files: {{train_src: {raw}/train.src, train_tgt: {raw}/train.tgt, dev_src: {raw}/dev.src, dev_tgt: {raw}/dev.tgt,
          test_src: {raw}/test.src, test_tgt: {raw}/test.tgt}}
precision: fp32
cache:
  checkpoints:
    - {{name: {prlm}, layers: [-2]}}
train:
  defaults: {{preset: tiny, bpe_vocab: 400, max_tokens: 400, max_updates: 2, max_epochs: null, warmup: 2,
             save_every: 2, keep_last: 2, num_workers: 0, dropout: 0.0}}
  runs:
    fused: {{prlms: [{{checkpoint: {prlm}, layer: -2}}]}}
evaluate: {{beam: 1, average_last: 1, max_len_b: 3}}
"""


def _prlmfuse(*args, cwd):
    return subprocess.run([sys.executable, "-m", "prlmfuse.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_prlmfuse_run_rebuilds_what_depends_on_edited_data_files(world, tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(world["root"] / "corpus" / "raw", raw)
    pipe = tmp_path / "pipeline.yaml"
    pipe.write_text(PIPELINE.format(work=tmp_path / "work", raw=raw, prlm=world["prlm"]), encoding="utf-8")
    first = _prlmfuse("run", str(pipe), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    work = tmp_path / "work"
    corpus_json = work / "data" / "text" / "corpus.json"
    before = json.loads(corpus_json.read_text())["splits"]["train"]["src"]["sha256"]

    _same_size_edit(raw / "train.src")
    # A stage that does not rebuild the corpus refuses to go on with the old one...
    refused = _prlmfuse("run", str(pipe), "--only", "train", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    reliability.assert_one_line_error((refused.returncode, refused.stdout, refused.stderr), str(raw / "train.src"), "changed since the corpus")
    plan = _prlmfuse("run", str(pipe), "--dry-run", cwd=tmp_path)
    assert "to rebuild" in plan.stdout and "to train again" in plan.stdout, plan.stdout

    # ... and the whole pipeline rebuilds the corpus, the train cache and the run from the new text.
    again = _prlmfuse("run", str(pipe), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads(corpus_json.read_text())["splits"]["train"]["src"]["sha256"]
    assert after != before
    train_caches = sorted(p.parent.name for p in (work / "cache").rglob("manifest.json") if p.parent.name.startswith("train-"))
    assert len(train_caches) == 2
    run_json = json.loads((work / "runs" / "fused" / "run.json").read_text())
    assert run_json["corpus"]["sha256"]["train"]["src"] == after
    assert run_json["prlms"][0]["key_fields"]["corpus_sha256"] == after
    stale = list((work / "runs").glob("fused.stale-*"))
    assert len(stale) == 1 and json.loads((stale[0] / "run.json").read_text())["corpus"]["sha256"]["train"]["src"] == before

    # An edit of the corpus's own copy is refused by the next stage, naming the file and the fix.
    _same_size_edit(work / "data" / "text" / "train.src")
    copy = _prlmfuse("run", str(pipe), "--only", "train", cwd=tmp_path)
    assert copy.returncode == 2
    reliability.assert_one_line_error((copy.returncode, copy.stdout, copy.stderr), str(work / "data" / "text" / "train.src"), "rebuild the corpus")


def test_a_corpus_registered_before_inputs_were_recorded_is_taken_as_it_is_then_watched(world, tmp_path):
    """A workdir from before the corpus recorded its inputs keeps its corpus (and so its caches and runs);
    `prlmfuse run` records the inputs, and from then on an edit of data.files is noticed."""
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import corpus_dir, ensure_data

    raw = tmp_path / "raw"
    shutil.copytree(world["root"] / "corpus" / "raw", raw)
    pipe = tmp_path / "pipeline.yaml"
    pipe.write_text(PIPELINE.format(work=tmp_path / "work", raw=raw, prlm=world["prlm"]), encoding="utf-8")
    cfg = load_pipeline(pipe)
    corpus = ensure_data(cfg)
    meta_path = corpus_dir(cfg) / "corpus.json"
    meta = json.loads(meta_path.read_text())
    assert meta["inputs"]["train"]["src"]["path"] == str((raw / "train.src").resolve())
    del meta["inputs"]
    meta_path.write_text(json.dumps(meta))
    files = {p.name: p.read_bytes() for p in corpus.root.iterdir() if p.name != "corpus.json"}

    assert ensure_data(cfg, build=False).src_sha256("train") == corpus.src_sha256("train")  # not refused
    assert ensure_data(cfg).src_sha256("train") == corpus.src_sha256("train")
    assert {p.name: p.read_bytes() for p in corpus.root.iterdir() if p.name != "corpus.json"} == files
    assert "inputs" in json.loads(meta_path.read_text())

    _same_size_edit(raw / "train.src")
    with pytest.raises(UserError, match=r"train\.src changed since the corpus"):
        ensure_data(cfg, build=False)
    assert ensure_data(cfg).src_sha256("train") != corpus.src_sha256("train")


# ------------------------------------------------------------------------------------------ damaged test caches


@pytest.mark.parametrize("kind", ["flipped byte", "missing shard"])
def test_a_test_cache_damaged_after_training_is_refused_by_evaluate(world, tmp_path, kind):
    from prlmfuse.evaluate import evaluate_runs

    run_dir = tmp_path / "fused"
    shutil.copytree(world["root"] / "runs" / "fused", run_dir)
    test_cache = tmp_path / "test-cache"
    shutil.copytree(world["paths"]["test"], test_cache)
    info = json.loads((run_dir / "run.json").read_text())
    info["prlms"][0]["caches"]["test"]["path"] = str(test_cache)
    (run_dir / "run.json").write_text(json.dumps(info))

    # Intact, it evaluates (and the check is remembered, so the next one costs a stat per shard file).
    evaluate_runs([run_dir], out=tmp_path / "ok", beam=1, max_len_b=3, progress=False)
    needle = reliability.damage_cache(kind, test_cache)
    with pytest.raises(UserError, match=needle) as error:
        evaluate_runs([run_dir], out=tmp_path / "results", beam=1, max_len_b=3, progress=False)
    assert "\n" not in str(error.value)


def test_a_damaged_live_cache_is_refused_like_a_test_cache(world, tmp_path):
    """translate reads its private cache through the same check as evaluate's test caches."""
    from prlmfuse.evaluate.live import live_features
    from prlmfuse.evaluate.runs import open_run

    run = open_run(world["root"] / "runs" / "fused")
    lines = world["corpus"].src_path("test").read_text(encoding="utf-8").splitlines()[:4]
    (tmp_path / "live").mkdir()
    branches = live_features(run, lines, tmp_path / "live", progress=False)
    assert len(branches) == 1
    needle = reliability.damage_cache("flipped byte", Path(branches[0].reader.path))
    source = tmp_path / "live" / "input.src"
    with pytest.raises(UserError, match=needle):
        run.open_branches([branches[0].reader.path], source=str(source), source_name="input",
                          source_sha256=sha256_file(source), source_lines=len(lines))


# ------------------------------------------------------------------------------------------ checkpoint averages


def test_an_average_is_redone_after_the_run_was_retrained_in_place(world, tmp_path):
    from prlmfuse.train_fused import run_dir as rundir
    from prlmfuse.train_fused import train_run, weights

    run_dir = tmp_path / "fused"
    shutil.copytree(world["root"] / "runs" / "fused", run_dir)
    first = weights.average_checkpoints(run_dir, last=2)
    stale = load_file(str(first))

    # Retrained in place with another seed: the same checkpoint names, other weights.
    shutil.rmtree(run_dir / rundir.CHECKPOINT_DIR)
    for name in (rundir.TRAINER_STATE, rundir.BEST, rundir.RUN_JSON, rundir.BPE_JSON, rundir.METRICS):
        (run_dir / name).unlink(missing_ok=True)
    retrained = small_runs.tiny_run("fused", prlms=[world["use"]], seed=11)
    train_run(retrained, world["corpus"], [world["paths"]], run_dir, progress=False)
    assert first.is_file()  # the old average is still there, under the name a reuse would look for

    again = weights.average_checkpoints(run_dir, last=2)
    fresh = weights.average_checkpoints(run_dir, last=2, out=tmp_path / "fresh.safetensors")
    averaged, expected = load_file(str(again)), load_file(str(fresh))
    assert any(not torch.equal(averaged[k], stale[k]) for k in averaged)
    assert all(torch.equal(averaged[k], expected[k]) for k in expected)


# ------------------------------------------------------------------------------------------ storage dtypes


def test_float16_refuses_values_it_cannot_hold_and_names_the_layer_and_a_dtype_that_fits(tmp_path):
    from safetensors.torch import save_file

    from helpers import tiny_prlms
    from prlmfuse.cache_features import build_cache

    # A causal LM's embeddings are its hidden_states[0] as they are: scaled up, they pass float16's 65504.
    prlm = tiny_prlms.build_tiny("llama", tmp_path / "llama", layers=2, width=32)
    weights = load_file(str(prlm / "model.safetensors"))
    name = next(k for k in weights if "embed_tokens" in k)
    weights[name] = weights[name] * 1e7
    save_file(weights, str(prlm / "model.safetensors"), metadata={"format": "pt"})
    corpus = tiny_prlms.write_corpus(tmp_path / "train.src", ["the cat sat", "a dog ran far away"])

    out = tmp_path / "fp16"
    with pytest.raises(UserError, match=r"hidden_states\[0\] hold values up to [\d,]+, past float16's largest "
                                        r"65,504 .*bfloat16 or float32") as error:
        build_cache(str(prlm), corpus, out, layers="0", dtype="float16", precision="fp32", progress=False)
    assert "\n" not in str(error.value)
    assert not (out / "manifest.json").exists()  # nothing a later run would trust
    for dtype in ("bfloat16", "float32"):
        built = build_cache(str(prlm), corpus, tmp_path / dtype, layers="0", dtype=dtype, precision="fp32", progress=False)
        assert built.manifest["complete"] is True


def _relative_error(approx, exact) -> tuple[float, float]:
    """(Frobenius ||approx - exact|| / ||exact|| over every token, mean of the same per token)."""
    err = approx - exact
    per_token = err.norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)
    return float(err.norm() / exact.norm()), float(per_token.mean())


def test_int8_keeps_the_error_bounded_when_one_value_dominates_a_token():
    from prlmfuse.cache_features.codecs import decode, encode

    torch.manual_seed(0)
    x = torch.randn(64, 96) * 5
    x[:, 7] = 3000.0  # a massive-activation channel, as causal LMs have
    x[0, 40] = -12400.0
    values, side = encode(x, "int8")
    approx = decode(values, side, "int8")
    frobenius, per_token = _relative_error(approx, x)
    assert frobenius < 0.01 and per_token < 0.01
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[:, 7] = False
    rest[0, 40] = False
    # the ordinary values are kept to int8 precision of their own scale, not zeroed by the outliers'
    assert float(((approx - x)[rest]).abs().max()) <= float(x[rest].abs().max()) / 127


def test_int8_quantizes_each_token_on_its_own_whatever_block_it_falls_in():
    """A batch of many blocks' rows (codecs encodes ENCODE_BLOCK_BYTES at a time) gives each token the bytes it
    gets alone, and leading dimensions keep their shape."""
    from prlmfuse.cache_features import codecs

    torch.manual_seed(0)
    width = 96
    block_rows = codecs.ENCODE_BLOCK_BYTES // (4 * width)
    x = torch.randn(2 * block_rows + 5, width) * torch.rand(width) * 40
    x[3] = 0.0  # a token of zeros: scale 0, values 0
    x[block_rows - 1, 11] = -9000.0  # an outlier in a block's last row
    values, side = codecs.encode(x, "int8")
    assert values.dtype == np.int8 and values.shape == x.shape and side["quant"].shape == (len(x), 9)
    for row in (0, 3, block_rows - 1, block_rows, 2 * block_rows + 4):
        alone, alone_side = codecs.encode(x[row : row + 1], "int8")
        assert np.array_equal(values[row], alone[0]) and np.array_equal(side["quant"][row], alone_side["quant"][0])
    assert side["quant"][block_rows - 1, 1] == 11 and side["quant"][block_rows - 1, 5] == -9000.0
    assert not values[3].any() and not side["quant"][3, 0]
    stacked, stacked_side = codecs.encode(x[:12].reshape(3, 4, width), "int8")
    assert np.array_equal(stacked.reshape(12, width), values[:12])
    assert np.array_equal(stacked_side["quant"].reshape(12, 9), side["quant"][:12])


@pytest.mark.slow
def test_int8_relative_error_on_real_smollm2_features(world, tmp_path):
    """The offline SmolLM2-135M (a causal LM whose residual stream holds values in the tens of thousands)
    over real text: int8 features stay within 3% of float32 on early, middle and late layers."""
    from prlmfuse.cache_features import CacheReader, build_cache

    lines = world["corpus"].src_path("train").read_text(encoding="utf-8").splitlines()[:24]
    corpus = tmp_path / "verses.src"
    corpus.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    readers = {}
    for dtype in ("float32", "int8"):
        built = build_cache("smollm2-135m", corpus, tmp_path / dtype, layers="5,15,28", dtype=dtype, precision="fp32",
                            progress=False)
        readers[dtype] = CacheReader(built.path)
    exact = [readers["float32"].features(i) for i in range(len(lines))]
    approx = [readers["int8"].features(i) for i in range(len(lines))]
    for row, layer in enumerate((5, 15, 28)):
        a = torch.cat([f[row] for f in approx])
        e = torch.cat([f[row] for f in exact])
        frobenius, per_token = _relative_error(a, e)
        assert frobenius < 0.03 and per_token < 0.03, (layer, frobenius, per_token, float(e.abs().max()))
