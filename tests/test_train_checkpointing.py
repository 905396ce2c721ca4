"""Checkpoint files of a run directory: safetensors round trips, optimizer state, pruning, averaging."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from prlmfuse.errors import UserError
from prlmfuse.train_fused import checkpointing as ck
from prlmfuse.train_fused import run_dir as rd
from prlmfuse.train_fused import weights

torch.set_num_threads(1)


class TiedLM(torch.nn.Module):
    """Small module with a tied input/output embedding, like the fused Transformer's."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.embed(x))))


def _train_some(model, optimizer, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 11, (4, 5), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _state(update: int) -> rd.TrainingState:
    return rd.TrainingState(update=update, epoch=0, batch_in_epoch=update, torch_rng_state=[1, 2, 3])


def test_save_resume_gives_identical_continuation(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
    _train_some(model, opt, 3)
    ck.save_checkpoint(tmp_path, model, opt, _state(3), is_best=True, keep_last=5)
    _train_some(model, opt, 4, seed=1)

    torch.manual_seed(123)
    again = TiedLM()
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2, betas=(0.9, 0.98))
    state = rd.latest_trainer_state(tmp_path)
    assert state.update == 3 and state.checkpoint == "checkpoints/update-00000003.safetensors"
    ck.load_checkpoint(tmp_path, state, again, opt2)
    assert again.out.weight is again.embed.weight  # tying survives loading
    _train_some(again, opt2, 4, seed=1)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_trainer_state_file_round_trips_key_for_key():
    saved = {
        "update": 12, "epoch": 2, "batch_in_epoch": 0, "best_dev_loss": 5.5, "best_epoch_dev_loss": 5.5,
        "bad_epochs": 0, "last_dev_loss": 5.75, "tokens_seen": 4096, "wall_time": 3.25, "seed": 1,
        "batches_per_epoch": 6, "world_size": 1, "oom_retries": 1, "oom_in_a_row": 0, "lr": 0.0004,
        "torch_rng_state": [1, 2, 3],
        "checkpoint": "checkpoints/update-00000012.safetensors", "optimizer": "checkpoints/optimizer-00000012.safetensors",
    }
    state = rd.TrainingState.from_dict(saved)
    assert state.to_dict() == saved  # no cuda_rng_state or grad_scaler key appears for a CPU fp32 run
    assert rd.is_epoch_end(state)
    # A key the trainer no longer writes is ignored; one an older file lacks takes the default.
    older = rd.TrainingState.from_dict({k: v for k, v in saved.items() if k != "best_epoch_dev_loss"} | {"bad_evals": 3})
    assert older == rd.TrainingState(**{**saved, "best_epoch_dev_loss": None})


def test_optimizer_tensors_have_stable_names(tmp_path):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_some(model, opt, 1)
    ck.save_checkpoint(tmp_path, model, opt, _state(1), is_best=False, keep_last=2)
    tensors = load_file(str(rd.optimizer_path(tmp_path, 1)))
    assert set(tensors) == {
        f"{p}.{k}" for p in ("embed.weight", "hidden.weight", "hidden.bias") for k in ("exp_avg", "exp_avg_sq", "step")
    }
    assert not (tmp_path / "best.safetensors").exists()


def test_keep_last_prunes_and_trainer_state_is_written_last(tmp_path):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for u in (1, 2, 3, 4):
        _train_some(model, opt, 1, seed=u)
        ck.save_checkpoint(tmp_path, model, opt, _state(u), is_best=(u == 2), keep_last=2)
    assert rd.complete_checkpoints(tmp_path) == [3, 4]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [
        "optimizer-00000003.safetensors", "optimizer-00000004.safetensors",
        "update-00000003.json", "update-00000003.safetensors", "update-00000004.json", "update-00000004.safetensors",
    ]
    assert json.loads((tmp_path / "trainer_state.json").read_text())["update"] == 4
    assert load_file(str(tmp_path / "best.safetensors")).keys() == load_file(str(rd.weights_path(tmp_path, 2 + 2))).keys()
    # No temp files left behind by the atomic writes.
    assert not [p for p in tmp_path.rglob(".*.tmp")]


def test_half_written_checkpoint_is_ignored(tmp_path):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_some(model, opt, 1)
    ck.save_checkpoint(tmp_path, model, opt, _state(1), is_best=False, keep_last=5)
    # A kill after the weights of update 2 but before its JSON and trainer_state.json.
    ck.save_weights(model, rd.weights_path(tmp_path, 2))
    assert rd.complete_checkpoints(tmp_path) == [1]
    assert rd.latest_trainer_state(tmp_path).update == 1
    # trainer_state.json missing entirely: fall back to the newest complete checkpoint's own JSON.
    (tmp_path / "trainer_state.json").unlink()
    assert rd.latest_trainer_state(tmp_path).update == 1


def test_average_is_the_mean_and_is_reused(tmp_path):
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = []
    for u in (1, 2, 3):
        _train_some(model, opt, 1, seed=u)
        ck.save_checkpoint(tmp_path, model, opt, _state(u), is_best=False, keep_last=5)
        saved.append({k: v.clone() for k, v in load_file(str(rd.weights_path(tmp_path, u))).items()})
    out = weights.average_checkpoints(tmp_path, last=2)
    assert out == tmp_path / "average-last2.safetensors"
    averaged = load_file(str(out))
    for name in averaged:
        torch.testing.assert_close(averaged[name], (saved[1][name] + saved[2][name]) / 2)
    mtime = out.stat().st_mtime_ns
    assert weights.average_checkpoints(tmp_path, last=2) == out and out.stat().st_mtime_ns == mtime
    fresh = TiedLM()
    weights.load_weights(fresh, out)
    torch.testing.assert_close(fresh.embed.weight, averaged["embed.weight"])


def test_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no complete checkpoints"):
        weights.average_checkpoints(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match="corrupt"):
        weights.load_weights(TiedLM(), tmp_path / "bad.safetensors")
    other = torch.nn.Linear(3, 3)
    ck.save_weights(other, tmp_path / "other.safetensors")
    with pytest.raises(UserError, match="do not fit"):
        weights.load_weights(TiedLM(), tmp_path / "other.safetensors")


def test_a_budget_trained_on_past_keeps_the_saves_its_average_reads(tmp_path):
    # Saves at 1..4 (keep_last 2), stopped at its budget of 4; then trained on to 7.
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {}
    for u in range(1, 8):
        if u == 5:  # what train does before it trains on from a budget end
            ck.settle_budget_end(tmp_path, SimpleNamespace(max_updates=7, max_epochs=None, patience=None), rd.latest_trainer_state(tmp_path))
        _train_some(model, opt, 1, seed=u)
        state = _state(u)
        state.budget_ends = [4] if u >= 4 else None
        ck.save_checkpoint(tmp_path, model, opt, state, is_best=False, keep_last=2)
        saved[u] = {k: v.clone() for k, v in load_file(str(rd.weights_path(tmp_path, u))).items()}
        if u == 4:
            straight = load_file(str(weights.average_checkpoints(tmp_path, last=2)))
            straight_all = load_file(str(weights.average_checkpoints(tmp_path, last=5)))
    # checkpoints/ is pruned as ever, so a plain average is of the newest saves only; 3 and 4 were linked aside.
    assert rd.complete_checkpoints(tmp_path) == [6, 7]
    newest = load_file(str(weights.average_checkpoints(tmp_path, last=5)))
    torch.testing.assert_close(newest["hidden.weight"], (saved[6]["hidden.weight"] + saved[7]["hidden.weight"]) / 2)
    assert [p.name for p in rd.budget_saves(tmp_path, 4, "saves")] == ["update-00000003.safetensors",
                                                                     "update-00000004.safetensors"]
    for last, expected in ((2, straight), (5, straight_all)):  # 5: the two it had then, as at update 4
        out = weights.average_checkpoints(tmp_path, last=last, at_update=4)
        assert out == tmp_path / f"average-last{last}-at4.safetensors"
        again = load_file(str(out))
        assert again.keys() == expected.keys() and all(torch.equal(again[k], expected[k]) for k in again)
    assert rd.budget_state(tmp_path, 4).update == 4 and rd.budget_state(tmp_path, 7).update == 7
    assert [p.name for p in rd.budget_saves(tmp_path, 7, "saves")] == ["update-00000006.safetensors",
                                                                     "update-00000007.safetensors"]
    # An update the run did not stop at and train on past is refused, in one line naming what it has.
    with pytest.raises(UserError, match=r"keeps no saves of update 6 \(the budget ends it trained on past: 4; its last "
                                        r"update, 7\)"):
        weights.average_checkpoints(tmp_path, last=2, at_update=6)
    with pytest.raises(UserError, match="no checkpoint saved at an epoch end by update 4"):
        rd.budget_saves(tmp_path, 4, "epochs")
    assert "budget_ends" not in _state(1).to_dict()  # a run that never reached a budget writes no key


def test_a_run_done_at_its_budget_records_it_where_its_state_does_not(tmp_path):
    # A run stepped to 3 before budget ends were recorded (or stopped by a signal right after that save):
    # asked for 3 again, it records the budget end in its files, so training on keeps what an average there reads.
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for u in (1, 2, 3):
        _train_some(model, opt, 1, seed=u)
        ck.save_checkpoint(tmp_path, model, opt, _state(u), is_best=False, keep_last=5)
    state = rd.latest_trainer_state(tmp_path)
    ck.settle_budget_end(tmp_path, SimpleNamespace(max_updates=3, max_epochs=None, patience=None), state)
    assert state.budget_ends == [3]
    assert rd.latest_trainer_state(tmp_path).budget_ends == [3]
    assert json.loads(rd.state_path(tmp_path, 3).read_text())["budget_ends"] == [3]
    assert "budget_ends" not in json.loads(rd.state_path(tmp_path, 2).read_text())
    ck.settle_budget_end(tmp_path, SimpleNamespace(max_updates=9, max_epochs=None, patience=None), state)
    assert sorted(p.name for p in rd.budget_dir(tmp_path, 3).iterdir()) == [
        f"update-0000000{u}.{ext}" for u in (1, 2, 3) for ext in ("json", "safetensors")]
