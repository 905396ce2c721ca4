"""`prlmfuse train curve`: a run's dev loss with its gain over a span of updates, and where it went flat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prlmfuse.errors import UserError
from prlmfuse.train_fused.dev_curve import dev_curve

# Dev evaluations every 500 updates and at two epoch ends, as a run's metrics.jsonl holds them beside its
# train records; the last loss rises.
EVALUATIONS = [(500, 6.0), (1000, 5.0), (1500, 4.5), (1784, 4.4), (2000, 4.3), (2500, 4.2), (3000, 4.16),
               (3500, 4.14), (3568, 4.139), (4000, 4.13), (4500, 4.135)]


def _run_dir(tmp_path, evaluations=EVALUATIONS, name="probe"):
    run = tmp_path / name
    run.mkdir()
    records = []
    for update, loss in evaluations:
        records.append({"update": update - 1, "loss": loss + 1.0, "lr": 1e-3})  # a train record: no dev loss
        records.append({"update": update, "dev_loss": loss, "dev_nll_loss": loss - 0.5, "epoch": 1})
    lines = [json.dumps(r) for r in records] + ['{"update": 4600, "dev_lo']  # a line cut short by a kill
    (run / "metrics.jsonl").write_text("\n".join(lines), encoding="utf-8")
    return run


def test_each_gain_is_the_relative_fall_since_the_loss_a_span_earlier(tmp_path):
    curve = dev_curve(_run_dir(tmp_path), over=1000, below=0.01)
    gains = {p.update: p.gain for p in curve.points}
    assert [p.update for p in curve.points] == [u for u, _ in EVALUATIONS]
    assert gains[500] is None and gains[1000] is None  # nothing was evaluated a span earlier
    assert gains[1500] == pytest.approx((6.0 - 4.5) / 6.0)
    assert gains[2000] == pytest.approx((5.0 - 4.3) / 5.0)
    # 784 updates: interpolated between the evaluations at 500 and 1,000
    assert gains[1784] == pytest.approx((6.0 - 0.568 - 4.4) / (6.0 - 0.568))
    # 2,568 updates: between 2,500 and 3,000
    at_2568 = 4.2 + (4.16 - 4.2) * 68 / 500
    assert gains[3568] == pytest.approx((at_2568 - 4.139) / at_2568)
    assert gains[4500] == pytest.approx((4.14 - 4.135) / 4.14)
    assert curve.flat_at == 4000 and all(p.gain >= 0.01 for p in curve.points if p.gain is not None and p.update < 4000)
    assert dev_curve(_run_dir(tmp_path, name="b"), over=1000, below=0.005).flat_at == 4500
    assert dev_curve(_run_dir(tmp_path, name="c"), over=1000, below=0.001).flat_at is None
    rose = dev_curve(_run_dir(tmp_path, name="e"), over=500, below=0.001)
    assert rose.points[-1].gain < 0 and rose.flat_at == 4500  # a loss that rose counts as flat
    nll = dev_curve(_run_dir(tmp_path, name="d"), over=500, nll=True)
    assert nll.key == "dev_nll_loss" and nll.points[1].loss == pytest.approx(4.5)
    assert nll.points[1].gain == pytest.approx((5.5 - 4.5) / 5.5)


def test_the_command_prints_and_writes_each_curve_and_refuses_a_run_without_one(tmp_path):
    probe = _run_dir(tmp_path)
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "train", "curve", str(probe), "--json",
                          str(tmp_path / "curve.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"{probe}: dev_loss, gain over 1,000 updates"
    assert "     1,500   4.5000   25.00%" in lines
    assert "  flat at update 4,000: its first gain under 1% over 1,000 updates" in lines
    saved = json.loads((tmp_path / "curve.json").read_text())[str(probe)]
    assert saved["flat_at"] == 4000 and saved["points"][2] == [1500, 4.5, pytest.approx(0.25)]
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "train", "curve", str(probe), "--below", "0.1"],
                         capture_output=True, text=True)
    assert out.stdout.splitlines()[-1] == "  not flat: its last evaluation (update 4,500) still gains 0.12% over 1,000 updates"
    assert not any("rose there" in line for line in lines)  # flat at 4,000, where the loss still fell
    # At 0.5% the rule first fires at 4,500, where the loss rose: the command says so.
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "train", "curve", str(probe), "--below", "0.5"],
                         capture_output=True, text=True)
    assert out.stdout.splitlines()[-2:] == [
        "  flat at update 4,500: its first gain under 0.5% over 1,000 updates",
        "  its dev loss rose there (4.1350, after 4.1300 at update 4,000): one evaluation can trip the rule, so read "
        "the gains after it"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="has no dev evaluation"):
        dev_curve(empty)
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "train", "curve", str(probe), str(empty), "--json",
                          str(tmp_path / "none.json")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{empty} has no dev evaluation (dev_loss) in its metrics.jsonl" in out.stderr
    assert out.stdout == "" and not (tmp_path / "none.json").exists()  # every run read before anything is written


def test_a_resumed_runs_repeated_evaluation_counts_once_and_a_curve_without_a_usable_loss_is_refused(tmp_path):
    # a run resumed from a save before its last dev evaluation evaluates that update again: the later record counts
    resumed = _run_dir(tmp_path, EVALUATIONS[:4] + [(1500, 4.55)] + EVALUATIONS[4:], name="resumed")
    curve = dev_curve(resumed)
    assert [p.update for p in curve.points] == [u for u, _ in EVALUATIONS]
    assert curve.points[2].loss == 4.55 and curve.points[2].gain == pytest.approx((6.0 - 4.55) / 6.0)

    diverged = _run_dir(tmp_path, EVALUATIONS[:3] + [(1784, float("nan"))], name="diverged")
    with pytest.raises(UserError, match="dev loss at update 1,784 is nan, and a relative gain needs a finite, positive"):
        dev_curve(diverged)
    older = tmp_path / "older"  # a run whose metrics.jsonl has no dev NLL
    older.mkdir()
    (older / "metrics.jsonl").write_text(json.dumps({"update": 500, "dev_loss": 6.0}) + "\n", encoding="utf-8")
    assert dev_curve(older).points[0].loss == 6.0
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "train", "curve", str(older), "--nll"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "has dev losses but no dev NLL (dev_nll_loss), as runs of older versions do; drop --nll" in out.stderr
