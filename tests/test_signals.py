"""The resume point and the stop signals, in-process: a torn resume point is never resumed from, and a
second signal while the first is handled is ignored."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from prlmfuse.train_fused import train_run
from prlmfuse.train_fused import run_dir as rundir

from helpers import small_runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return small_runs.fused_world(tmp_path_factory.mktemp("resume-point"))


def test_a_resume_point_cut_short_falls_back_to_the_last_complete_state(world, tmp_path):
    """A kill during the resume point's write leaves files without their state.json: the rerun resumes from
    the last scheduled checkpoint (or from an older complete resume point), never from the torn one."""
    from prlmfuse.train_fused.checkpointing import save_resume_point

    corpus, use, caches = world
    run_dir = train_run(small_runs.tiny_run("fused", prlms=[use], max_updates=4, save_every=4), corpus, caches,
                        tmp_path / "run", progress=False)
    assert rundir.state_to_resume(run_dir).update == 4
    scheduled = rundir.latest_trainer_state(run_dir)
    weights, optimizer, state = rundir.resume_paths(run_dir, 6)
    weights.parent.mkdir()
    shutil.copy(run_dir / scheduled.checkpoint, weights)  # weights written, killed before the state
    assert rundir.state_to_resume(run_dir).update == 4

    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.config import ModelConfig

    model = FusedTransformer(ModelConfig.from_dict(json.loads((run_dir / "run.json").read_text())["model"]))
    adam = torch.optim.Adam(model.parameters())
    save_resume_point(run_dir, model, adam, rundir.TrainingState(update=5, epoch=0, batch_in_epoch=5))
    assert rundir.state_to_resume(run_dir).update == 5 and not weights.exists()  # the complete one, the torn one gone
    (run_dir / rundir.RESUME_DIR / "optimizer-00000005.safetensors").unlink()  # a file it names is missing
    assert rundir.state_to_resume(run_dir).update == 4


def test_a_second_stop_signal_is_ignored_while_the_first_is_handled():
    import signal as sig

    from prlmfuse import signals

    before = sig.getsignal(sig.SIGTERM)
    with signals.handled():
        with signals.deferred():
            sig.raise_signal(sig.SIGTERM)
            sig.raise_signal(sig.SIGUSR1)  # e.g. SLURM's second signal while the resume point is written
        assert signals.received() == sig.SIGTERM
        sig.raise_signal(sig.SIGTERM)  # outside training too: already stopping, nothing raised
    assert sig.getsignal(sig.SIGTERM) is before and signals.received() is None  # the command's handlers go with it
