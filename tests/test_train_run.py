"""Stage two end to end on real (small) data: a tiny BERT's cached features, the Bible corpus, train_run."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import prlmfuse
from prlmfuse.errors import UserError
from prlmfuse.train_fused import PrLMUse, average_checkpoints, load_run, train_run
from prlmfuse.train_fused.branches import PrLMBranch
from prlmfuse.cache_features import CacheReader
from prlmfuse.train_fused.data import PairDataset

from helpers import small_runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    corpus = small_runs.small_bible(root)
    ckpt = small_runs.tiny_prlm(root / "bert")
    paths = small_runs.build_caches(ckpt, corpus, root / "cache", layers="-2,-1")
    return corpus, ckpt, paths


def _weights(run_dir: Path, update: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"update-{update:08d}.safetensors"))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fused_run_layout_run_json_and_load_run(world, tmp_path):
    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt), layer=-2)
    run = small_runs.tiny_run("fused", prlms=[use], max_updates=16)
    run_dir = train_run(run, corpus, [small_runs.caches_for(use, paths)], tmp_path / "fused", progress=False)
    assert run_dir == tmp_path / "fused"

    for name in ("run.json", "bpe.json", "best.safetensors", "trainer_state.json", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["update"] == 16 and state["checkpoint"] == "checkpoints/update-00000016.safetensors"
    # save_every=4, keep_last=3: the last three saves remain.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("update-*.safetensors")) == [
        f"update-{u:08d}.safetensors" for u in (8, 12, 16)
    ]

    info = json.loads((run_dir / "run.json").read_text())
    assert info["prlmfuse_version"] == prlmfuse.__version__
    assert info["corpus"]["root"] == str(corpus.root.resolve())
    assert info["corpus"]["sha256"]["train"]["src"] == corpus.src_sha256("train")
    assert info["model"]["d_model"] == 64 and info["model"]["enc_layers"] == 2  # tiny preset resolved to sizes
    (prlm,) = info["prlms"]
    assert prlm["layers"] == [2] and prlm["pooled_layers"] == [] and prlm["layer_mode"] == "fixed"
    assert prlm["key_fields"]["layers"] == [2, 3]
    for split in ("train", "dev", "test"):
        manifest = json.loads((Path(paths[split]) / "manifest.json").read_text())
        assert prlm["caches"][split] == {"path": paths[split], "key": manifest["key"]}
    assert info["train"]["name"] == "fused" and info["train"]["prlms"][0]["layer"] == -2

    records = _metrics(run_dir)
    train_records = [r for r in records if "loss" in r]
    dev_records = [r for r in records if "dev_loss" in r]
    assert [r["update"] for r in dev_records] == [4, 8, 12, 16]
    assert {"update", "loss", "lr", "tokens_per_s", "wall_time", "data_wait_fraction"} <= set(train_records[0])
    assert train_records[-1]["loss"] < train_records[0]["loss"]  # it learns
    assert state["best_dev_loss"] == min(r["dev_loss"] for r in dev_records)

    model, bpe, loaded = load_run(run_dir, "last")
    assert not model.training and loaded["weights"].endswith("update-00000016.safetensors")
    for name, tensor in _weights(run_dir, 16).items():
        torch.testing.assert_close(model.state_dict()[name], tensor)
    assert bpe.vocab_size == info["model"]["vocab_size"]
    # The loaded model runs on features read exactly as in training.
    dataset = PairDataset([torch.tensor(bpe.encode("God said")).numpy()], [torch.tensor(bpe.encode("神")).numpy()],
                          [PrLMBranch(CacheReader(paths["test"]), layer_rows=(0,), pooled_rows=None)])
    batch = dataset.__getitems__([0])
    with torch.no_grad():
        logits = model(batch.src_tokens, batch.tgt_in, batch.prlm)
    assert logits.shape == (1, batch.tgt_in.shape[1], bpe.vocab_size) and torch.isfinite(logits).all()

    average = average_checkpoints(run_dir, last=2)
    expected = {k: (_weights(run_dir, 12)[k] + _weights(run_dir, 16)[k]) / 2 for k in _weights(run_dir, 16)}
    for name, tensor in load_file(str(average)).items():
        torch.testing.assert_close(tensor, expected[name])
    _, _, best_info = load_run(run_dir, "best")
    assert best_info["weights"].endswith("best.safetensors")
    model_avg, _, avg_info = load_run(run_dir, "average", last=2)
    assert Path(avg_info["weights"]) == run_dir / "average-last2.safetensors"


@pytest.mark.parametrize("layer, read_window, static_shapes", [("dwatt", 0, False), ("dyn_cls", 2, False), (-2, 0, True)])
def test_resume_continues_the_same_schedule(world, tmp_path, layer, read_window, static_shapes):
    """2N updates straight == N updates, stop, resume N more (mid-epoch): same weights, same loss curve."""
    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt), layer=layer)
    caches = [small_runs.caches_for(use, paths)]
    settings = dict(prlms=[use], dropout=0.1, save_every=3, read_window=read_window, static_shapes=static_shapes)
    straight = train_run(small_runs.tiny_run("r", max_updates=12, **settings), corpus, caches,
                         tmp_path / "straight", progress=False)
    split = tmp_path / "split"
    train_run(small_runs.tiny_run("r", max_updates=6, **settings), corpus, caches, split, progress=False)
    state = json.loads((split / "trainer_state.json").read_text())
    assert 0 < state["batch_in_epoch"] and (state["batches_per_epoch"] > 6 or state["epoch"] > 0)
    # Lines logged after the last checkpoint of an interrupted run must not survive the resume.
    with open(split / "metrics.jsonl", "a") as f:
        f.write('{"update": 7, "loss": 99.0}\n{"update": 8, "lo')
    train_run(small_runs.tiny_run("r", max_updates=12, **settings), corpus, caches, split, progress=False)
    a, b = _weights(straight, 12), _weights(split, 12)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "updates_per_s", "wall_time", "data_wait_fraction")} for r in rs]
    assert strip(_metrics(straight)) == strip(_metrics(split))
    state = json.loads((split / "trainer_state.json").read_text())
    assert state["update"] == 12 and state["lr"] == pytest.approx(7e-4 * (4 / 12) ** 0.5)


def test_feature_norm_trains_resumes_and_changing_it_is_refused(world, tmp_path):
    corpus, ckpt, paths = world
    plain, normed = PrLMUse(checkpoint=str(ckpt)), PrLMUse(checkpoint=str(ckpt), feature_norm=True)
    caches = lambda use: [small_runs.caches_for(use, paths)]  # noqa: E731
    old = train_run(small_runs.tiny_run("o", prlms=[plain], max_updates=3, save_every=3), corpus, caches(plain),
                    tmp_path / "old", progress=False)
    train_run(small_runs.tiny_run("o", prlms=[plain], max_updates=6, save_every=3), corpus, caches(plain), old, progress=False)
    assert json.loads((old / "trainer_state.json").read_text())["update"] == 6
    with pytest.raises(UserError, match="feature_norm"):
        train_run(small_runs.tiny_run("o", prlms=[normed], max_updates=9, save_every=3), corpus, caches(normed), old,
                  progress=False)

    run = train_run(small_runs.tiny_run("n", prlms=[normed], max_updates=3, save_every=3), corpus, caches(normed),
                    tmp_path / "normed", progress=False)
    assert json.loads((run / "run.json").read_text())["model"]["prlms"][0]["feature_norm"] is True
    assert "prlm_feature_norms.0.weight" in _weights(run, 3)


def test_a_run_json_of_the_older_format_resumes_and_loads(world, tmp_path):
    """run.json files that name the model's attention dropout attn_dropout and lack train.dropnet_p,
    train.read_window, train.match_params, train.match_by and the PrLM's control (written before they were
    run settings) resume as the same run and load for decoding."""
    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt))
    caches = [small_runs.caches_for(use, paths)]
    run = lambda updates: small_runs.tiny_run("o", prlms=[use], merge="dropnet", attention_dropout=0.1,  # noqa: E731
                                              max_updates=updates, save_every=3)
    run_dir = train_run(run(3), corpus, caches, tmp_path / "old", progress=False)
    info = json.loads((run_dir / "run.json").read_text())
    info["model"]["attn_dropout"] = info["model"].pop("attention_dropout")
    del info["train"]["dropnet_p"], info["train"]["read_window"], info["train"]["match_params"]
    del info["train"]["match_by"]
    del info["train"]["prlms"][0]["control"]
    (run_dir / "run.json").write_text(json.dumps(info))
    train_run(run(6), corpus, caches, run_dir, progress=False)
    assert json.loads((run_dir / "trainer_state.json").read_text())["update"] == 6
    model, _, loaded = load_run(run_dir, "last")
    assert model.config.attention_dropout == 0.1 and loaded["train"]["dropnet_p"] == 0.5

@pytest.mark.parametrize("layer", ["concat", -2])  # -2: one layer of a two-layer cache is all that is held
def test_in_memory_features_train_like_features_from_disk(world, tmp_path, layer):
    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt), layer=layer)
    caches = [small_runs.caches_for(use, paths)]
    disk = train_run(small_runs.tiny_run("m", prlms=[use], max_updates=4, num_workers=2), corpus, caches, tmp_path / "disk", progress=False)
    memory = train_run(small_runs.tiny_run("m", prlms=[use], max_updates=4, in_memory_features=True), corpus, caches,
                       tmp_path / "memory", progress=False)
    a, b = _weights(disk, 4), _weights(memory, 4)
    for name in a:
        torch.testing.assert_close(a[name], b[name])


def test_baseline_and_patience_counted_in_epochs(world, tmp_path):
    corpus, _, _ = world
    # lr 0: the dev loss never improves on the first epoch's; patience 2 stops at the end of epoch 3,
    # although save_every=1 evaluates dev after every update (those evaluations do not count).
    run = small_runs.tiny_run("base", lr=0.0, max_updates=None, max_epochs=20, max_train_pairs=24, save_every=1,
                              patience=2)
    run_dir = train_run(run, corpus, [], tmp_path / "base", progress=False)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    per_epoch = state["batches_per_epoch"]
    assert per_epoch >= 2  # several evaluations per epoch
    assert state["epoch"] == 3 and state["batch_in_epoch"] == 0 and state["bad_epochs"] == 2
    assert state["update"] == 3 * per_epoch
    info = json.loads((run_dir / "run.json").read_text())
    assert info["prlms"] == [] and info["model"]["prlms"] == []

    # min_epochs holds patience back: at least 5 epochs.
    run = small_runs.tiny_run("base", lr=0.0, max_updates=None, max_epochs=20, max_train_pairs=24, save_every=100,
                              patience=2, min_epochs=5)
    state = json.loads((train_run(run, corpus, [], tmp_path / "min", progress=False) / "trainer_state.json").read_text())
    assert state["epoch"] == 5 and state["bad_epochs"] == 4


def test_epoch_average_averages_exactly_the_epoch_end_checkpoints(world, tmp_path):
    corpus, _, _ = world
    run = small_runs.tiny_run("ep", lr=2e-3, max_updates=None, max_epochs=4, max_train_pairs=24, save_every=1,
                              keep_last=2, keep_last_epochs=3)
    run_dir = train_run(run, corpus, [], tmp_path / "ep", progress=False)
    per_epoch = json.loads((run_dir / "trainer_state.json").read_text())["batches_per_epoch"]
    assert per_epoch >= 3  # so that the newest two saves hold only one epoch end
    ends = [e * per_epoch for e in (2, 3, 4)]
    # keep_last=2 keeps the newest two saves; the epoch ends 2..4 stay for the average, epoch 1's is pruned.
    kept = sorted(int(p.name[7:15]) for p in (run_dir / "checkpoints").glob("update-*.safetensors"))
    assert kept == sorted({4 * per_epoch - 1, *ends})

    out = average_checkpoints(run_dir, last=3, average="epochs")
    assert out.name == "average-epochs3.safetensors"
    averaged = load_file(str(out))
    for name, value in averaged.items():
        expected = sum(_weights(run_dir, u)[name].double() for u in ends) / 3
        torch.testing.assert_close(value.double(), expected.to(value.dtype).double())
    # The last three saves are another set: the newest save between epoch ends is among them.
    saves = load_file(str(average_checkpoints(run_dir, last=3)))
    assert any(not torch.equal(saves[n], averaged[n]) for n in averaged)

    # Evaluation decodes with exactly that average (evaluate.average: epochs).
    from prlmfuse.evaluate.runs import load_model, open_run, select_weights

    view = open_run(run_dir)
    weights = select_weights(view, 3, "epochs")
    assert [p.name for p in weights] == [f"update-{u:08d}.safetensors" for u in ends]
    model, _ = load_model(view, weights, "epochs")
    for name, value in model.state_dict().items():
        if name in averaged:
            torch.testing.assert_close(value, averaged[name])
    assert [p.name for p in select_weights(view, 9, "epochs")] == [p.name for p in weights]  # fewer exist: all of them
    short = train_run(small_runs.tiny_run("short", max_updates=2, save_every=2), corpus, [], tmp_path / "short",
                      progress=False)
    with pytest.raises(UserError, match="no checkpoint saved at an epoch end"):
        average_checkpoints(short, average="epochs")
    with pytest.raises(UserError, match="no checkpoint saved at an epoch end"):
        select_weights(open_run(short), 3, "epochs")


def test_refusals_are_one_line_user_errors(world, tmp_path):
    corpus, ckpt, paths = world
    use = PrLMUse(checkpoint=str(ckpt), layer=-2)
    wrong = small_runs.caches_for(use, {**paths, "train": paths["dev"]})
    with pytest.raises(UserError, match=r"different train source .*corpus_sha256 .*train\.src sha256 ") as e:
        train_run(small_runs.tiny_run(prlms=[use]), corpus, [wrong], tmp_path / "a", progress=False)
    assert "\n" not in str(e.value)

    deep = PrLMUse(checkpoint=str(ckpt), layer=-3)
    with pytest.raises(UserError, match=r"layer -3 \(hidden_states index 1 of 3 layers\).*holds layers \[2, 3\]"):
        train_run(small_runs.tiny_run(prlms=[deep]), corpus, [small_runs.caches_for(deep, paths)], tmp_path / "b", progress=False)

    bad_mode = PrLMUse(checkpoint=str(ckpt), layer="average-ish")
    with pytest.raises(UserError, match="not a layer index"):
        train_run(small_runs.tiny_run(prlms=[bad_mode]), corpus, [small_runs.caches_for(bad_mode, paths)], tmp_path / "c", progress=False)

    with pytest.raises(UserError, match="1 PrLM.*0 cache"):
        train_run(small_runs.tiny_run(prlms=[use]), corpus, [], tmp_path / "d", progress=False)

    damaged = tmp_path / "damaged"
    shutil.copytree(paths["train"], damaged)
    # Flip a byte early in the first chunk of the layer-2 features (sure to hold real rows).
    chunk = next(p for p in sorted(damaged.rglob("*")) if p.is_file() and "layer_002" in str(p) and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[64] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(UserError, match="damaged|corrupt|unreadable"):
        train_run(small_runs.tiny_run(prlms=[use]), corpus, [small_runs.caches_for(use, {**paths, "train": str(damaged)})],
                  tmp_path / "e", progress=False)

    done = train_run(small_runs.tiny_run(max_updates=2, save_every=2), corpus, [], tmp_path / "f", progress=False)
    for key in ("save_every", "log_every", "max_updates", "patience", "update_freq"):
        with pytest.raises(UserError, match=f"{key}: expected a positive integer, got 0"):
            train_run(small_runs.tiny_run(**{key: 0}), corpus, [], tmp_path / "zero", progress=False)
    assert not (tmp_path / "zero").exists()
    with pytest.raises(UserError, match=r"different configuration \(train\.lr.*start it over with "
                                        r"`prlmfuse train -p PIPELINE --fresh --runs f`"):
        train_run(small_runs.tiny_run(max_updates=4, lr=1e-3), corpus, [], done, progress=False)
    train_run(small_runs.tiny_run(max_updates=4, lr=1e-3), corpus, [], done, resume=False, progress=False)  # as it says
    with pytest.raises(UserError, match="best, last or average"):
        load_run(done, "median")


def test_no_prlm_is_loaded_during_training(world, tmp_path, monkeypatch):
    """Caches from a checkpoint that is then deleted; every way to instantiate a PrLM is booby-trapped."""
    corpus, ckpt, _ = world
    gone = tmp_path / "bert-copy"
    shutil.copytree(ckpt, gone)
    paths = small_runs.build_caches(gone, corpus, tmp_path / "cache", layers="-1")
    shutil.rmtree(gone)

    import transformers
    from transformers import modeling_utils

    instantiated = []

    def trap(*args, **kwargs):
        instantiated.append(args)
        raise AssertionError("a PrLM was instantiated during training")

    monkeypatch.setattr(modeling_utils.PreTrainedModel, "__init__", trap)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", trap)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", trap)
    import prlmfuse.prlms as prlms

    monkeypatch.setattr(prlms, "load_prlm", trap)
    monkeypatch.setattr(prlms, "resolve_checkpoint", trap)

    use = PrLMUse(checkpoint=str(gone), layer=-1)
    run_dir = train_run(small_runs.tiny_run("nolm", prlms=[use], max_updates=4), corpus, [small_runs.caches_for(use, paths)],
                        tmp_path / "run", progress=False)
    assert json.loads((run_dir / "trainer_state.json").read_text())["update"] == 4
    assert instantiated == [] and not gone.exists()


# ---------------------------------------------------------------------------------------- slow

_DRIVER = r"""
import json, sys
from pathlib import Path
import torch

def main():
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import small_runs as s
    from prlmfuse.corpora import load_corpus
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.train_fused import PrLMUse, train_run
    args = json.loads(sys.argv[1])
    corpus = load_corpus(args["corpus"])
    use = PrLMUse(checkpoint=args["ckpt"], layer=-2)
    run = s.tiny_run("sub", prlms=[use], **args["run"])
    runtime = resolve_runtime("cpu", args.get("precision", "auto"))
    train_run(run, corpus, [s.caches_for(use, args["paths"])], args["out"], progress=False, runtime=runtime)

if __name__ == "__main__":
    main()
"""


def _driver(tmp_path: Path) -> Path:
    path = tmp_path / "driver.py"
    path.write_text(_DRIVER.format(tests=str(Path(__file__).parent)))
    return path


@pytest.mark.slow
def test_kill_9_then_resume_matches_an_uninterrupted_run(world, tmp_path):
    corpus, ckpt, paths = world
    overrides = dict(max_updates=40, save_every=5, dropout=0.1, num_workers=1, max_tokens=200)
    args = {"corpus": str(corpus.root), "ckpt": str(ckpt), "paths": paths, "run": overrides}
    driver = _driver(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    straight = tmp_path / "straight"
    subprocess.run([sys.executable, str(driver), json.dumps({**args, "out": str(straight)})], check=True, env=env)

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(driver), json.dumps({**args, "out": str(killed)})], env=env,
                            start_new_session=True)
    deadline = time.time() + 300
    state = killed / "trainer_state.json"
    while time.time() < deadline and proc.poll() is None:
        if state.is_file() and json.loads(state.read_text())["update"] >= 15:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its DataLoader worker, mid-update
    proc.wait()
    interrupted_at = json.loads(state.read_text())["update"]
    assert interrupted_at < 40
    subprocess.run([sys.executable, str(driver), json.dumps({**args, "out": str(killed)})], check=True, env=env)

    a, b = _weights(straight, 40), _weights(killed, 40)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    assert not list(killed.rglob(".*.tmp"))


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(world, tmp_path):
    corpus, ckpt, paths = world
    overrides = dict(max_updates=6, save_every=3, max_tokens=400)
    # fp32: under bf16 autocast (chosen on CPUs with fast bf16) two half-batch forwards round
    # differently from one full batch, which hides what this test checks, the gradient reduction.
    args = {"corpus": str(corpus.root), "ckpt": str(ckpt), "paths": paths, "run": overrides, "precision": "fp32"}
    driver = _driver(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    subprocess.run([sys.executable, str(driver), json.dumps({**args, "out": str(single)})], check=True, env=env)
    ddp = tmp_path / "ddp"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
         json.dumps({**args, "out": str(ddp)})],
        check=True, env=env,
    )
    a, b = _weights(single, 6), _weights(ddp, 6)
    info = json.loads((ddp / "run.json").read_text())
    assert info["world_size"] == 2
    # The initial weights (same seed as train_run), to measure how far training moved them.
    from prlmfuse.train_fused.modeling import FusedTransformer, ModelConfig

    torch.manual_seed(3)
    start = FusedTransformer(ModelConfig.from_dict(info["model"])).state_dict()
    moved = torch.sqrt(sum(((a[k] - start[k]).double() ** 2).sum() for k in a))
    apart = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    # Summation order differs (two half-batch sums vs one), and Adam turns the rounding noise of
    # near-zero gradients into +-lr steps; the two trajectories must still agree to 1%.
    assert moved > 1e-3 and apart < 0.01 * moved, (float(apart), float(moved))
    single_dev = [r["dev_loss"] for r in _metrics(single) if "dev_loss" in r]
    ddp_dev = [r["dev_loss"] for r in _metrics(ddp) if "dev_loss" in r]
    assert ddp_dev == pytest.approx(single_dev, rel=1e-4)


def test_two_gloo_ranks_step_together_through_storage_windows(world, tmp_path):
    """read_window under torchrun: each rank batches its own stretch of every window, the ranks take the same
    number of steps through epoch ends (a rank with one step more would hang the gradient all-reduce)."""
    corpus, ckpt, paths = world
    overrides = dict(max_updates=16, save_every=8, max_tokens=1600, read_window=2)
    args = {"corpus": str(corpus.root), "ckpt": str(ckpt), "paths": paths, "run": overrides, "precision": "fp32",
            "out": str(tmp_path / "ddp")}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(_driver(tmp_path)),
         json.dumps(args)],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    state = json.loads((tmp_path / "ddp" / "trainer_state.json").read_text())
    assert state["update"] == 16 and state["epoch"] >= 1, state  # across an epoch end
    info = json.loads((tmp_path / "ddp" / "run.json").read_text())
    assert info["world_size"] == 2 and info["train"]["read_window"] == 2
    assert all(math.isfinite(r["dev_loss"]) for r in _metrics(tmp_path / "ddp") if "dev_loss" in r)


def test_run_dropouts_reach_the_model():
    run = small_runs.tiny_run("d", attention_dropout=0.1, activation_dropout=0.2, feature_dropout=0.3, dropnet_p=0.4)
    config = run.model_config(vocab_size=64, prlms=[])
    assert (config.attention_dropout, config.activation_dropout, config.feature_dropout) == (0.1, 0.2, 0.3)
    assert config.dropnet_p == 0.4


def _trainer(tmp_path, run, corpus):
    """A Trainer over the baseline model of `run` (fp32 on the CPU), with the corpus's real BPE'd pairs."""
    from prlmfuse.distributed import DistContext
    from prlmfuse.precision import Runtime
    from prlmfuse.train_fused.bpe import train_bpe
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.run_setup import _encode_split
    from prlmfuse.train_fused.trainer import Trainer
    from prlmfuse.fileio import read_lines

    bpe = train_bpe(read_lines(corpus.src_path("train")) + read_lines(corpus.tgt_path("train")), run.bpe_vocab)
    torch.manual_seed(run.seed)
    model = FusedTransformer(run.model_config(bpe.vocab_size, []))
    src, tgt = _encode_split(bpe, corpus, "train", 64)
    train_set = PairDataset(src, tgt, [])
    trainer = Trainer(run, tmp_path, model, train_set, train_set, DistContext(), progress=False,
                      runtime=Runtime(torch.device("cpu"), torch.float32))
    return trainer, train_set


def test_update_freq_n_batches_give_the_gradient_of_one_batch_of_all(world, tmp_path):
    corpus, _, _ = world
    run = small_runs.tiny_run("acc", dropout=0.0, update_freq=3)
    accumulated, data = _trainer(tmp_path / "a", run, corpus)
    whole, _ = _trainer(tmp_path / "b", run, corpus)
    parts = [list(range(0, 5)), list(range(5, 12)), list(range(12, 16))]
    micro = [data.__getitems__(p) for p in parts]
    stats_micro = accumulated.train_step(micro)
    stats_whole = whole.train_step(data.__getitems__([i for p in parts for i in p]))
    assert stats_micro[2] == stats_whole[2] == sum(b.ntokens for b in micro)
    assert float(stats_micro[0]) == pytest.approx(float(stats_whole[0]), rel=1e-5)
    # The gradients the update used (left in .grad: zeroed at the start of the next update), not the
    # weights: Adam turns the float noise of a zero gradient (a key bias's) into a full-size step.
    for (name, a), b in zip(accumulated.model.named_parameters(), whole.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert accumulated.state.update == whole.state.update == 1


def test_update_freq_counts_updates_and_resumes_exactly(world, tmp_path):
    corpus, _, _ = world
    run = lambda n: small_runs.tiny_run("acc", dropout=0.1, update_freq=2, max_updates=n, save_every=3)  # noqa: E731
    straight = train_run(run(6), corpus, [], tmp_path / "straight", progress=False)
    split = tmp_path / "split"
    train_run(run(3), corpus, [], split, progress=False)
    train_run(run(6), corpus, [], split, progress=False)
    a, b = _weights(straight, 6), _weights(split, 6)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    state = json.loads((straight / "trainer_state.json").read_text())
    # Two batches per update: the schedule counts 6 updates, the data position 12 batches (mod the epoch).
    assert state["update"] == 6
    assert (state["epoch"] * state["batches_per_epoch"] + state["batch_in_epoch"]) in (12, 12 + state["epoch"] % 2)
    assert state["lr"] == pytest.approx(7e-4 * min(6 / 4, (4 / 6) ** 0.5))
    with pytest.raises(UserError, match="update_freq"):
        train_run(small_runs.tiny_run("acc", dropout=0.1, update_freq=3, max_updates=9, save_every=3), corpus, [],
                  split, progress=False)


def test_dyn_modes_read_transformer_layers_only_from_a_cache_of_every_layer(world, tmp_path):
    """Dyn[CLS]/Dyn[Aver] weigh hidden_states 1..L of a `layers: all` cache; DWAtt and Concat also read 0.
    Held in memory, each branch holds what it reads and no more: the pooled rows only for the Dyn modes."""
    from prlmfuse.cache_features import build_cache, in_memory_bytes
    from prlmfuse.train_fused.branches import open_branch

    corpus, ckpt, _ = world
    cache = build_cache(str(ckpt), corpus.src_path("dev"), tmp_path / "all", layers="all", progress=False).path
    entry = corpus.splits["dev"]["src"]
    opened = {}
    for layer in ("dyn_cls", "dyn_aver", "dwatt", "concat", -2):
        opened[layer] = open_branch(PrLMUse(checkpoint=str(ckpt), layer=layer), str(cache), trained=None,
                                    source=str(corpus.src_path("dev")), source_name="dev source",
                                    source_sha256=entry["sha256"], source_lines=entry["lines"], seed=1, in_memory=True)
    for layer, (layers, pooled) in {"dyn_cls": ([1, 2, 3], True), "dyn_aver": ([1, 2, 3], True),
                                    "dwatt": ([0, 1, 2, 3], False), "concat": ([0, 1, 2, 3], False),
                                    -2: ([2], False)}.items():
        memory = opened[layer].reader._memory
        names = {name for arrays in memory.values() for name in arrays}
        assert names == {"sentence_ids", "offsets", *(f"layer_{x:03d}" for x in layers)} | ({"pooled"} if pooled else set())
        held = sum(a.nbytes for arrays in memory.values() for a in arrays.values())
        assert held == in_memory_bytes(cache, layers, pooled=pooled), layer
    assert opened["dyn_cls"].reader.layers == [0, 1, 2, 3]
    for layer in ("dyn_cls", "dyn_aver"):
        branch = opened[layer]
        assert branch.record["layers"] == [1, 2, 3] and branch.record["pooled_layers"] == [1, 2, 3]
        assert branch.layer_rows == (1, 2, 3) and branch.pooled_rows == (1, 2, 3)
        assert branch.spec.num_layers == 3 and branch.spec.pooled_index == [0, 1, 2]
    for layer in ("dwatt", "concat"):
        assert opened[layer].layer_rows == (0, 1, 2, 3) and opened[layer].spec.num_layers == 4


def test_a_finished_run_says_so_when_trained_again(world, tmp_path, caplog):
    corpus, _, _ = world
    run = small_runs.tiny_run("again", max_updates=2)
    with caplog.at_level("INFO", logger="prlmfuse"):
        train_run(run, corpus, [], tmp_path / "again", progress=False)
        caplog.clear()
        train_run(run, corpus, [], tmp_path / "again", progress=False)
    assert "train: again done at update 2 (max_updates reached)" in caplog.messages
