"""A tiny world for `search` and the launchers: the first verses of the real Bible, a random 2-layer BERT with
every layer cached once (in a cache root every test's pipeline shares), and pipeline files around them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import small_runs

# Four settings: two that learn (lr 0.003) and two that cannot (lr 1e-7), over two layer choices.
SPACE = "{lr: [0.003, 1.0e-7], layer: [-2, concat]}"


def build_world(root: Path) -> dict:
    """Corpus files, a tiny PrLM, and its train/dev/test caches built once under root/cache."""
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import build_caches, ensure_data

    small_runs.small_bible(root / "corpus", train=80, dev=8, test=8)
    prlm = small_runs.tiny_prlm(root / "prlm", layers=2, width=32)
    world = {"root": root, "raw": root / "corpus" / "raw", "prlm": prlm, "cache": root / "cache"}
    path = write_pipeline(root / "build", world)
    cfg = load_pipeline(path)
    build_caches(cfg, ensure_data(cfg))
    return world


def write_pipeline(directory: Path, world: dict, *, full: int = 16, least: int = 4, space: str = SPACE,
                   launcher: str = "", search_extra: str = "", runs: str = "") -> Path:
    """A pipeline file in `directory` (its workdir directory/work) over the shared corpus and cache."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = world["raw"]
    files = {f"{s}_{side}": str(raw / f"{s}.{side}") for s in ("train", "dev", "test") for side in ("src", "tgt")}
    text = f"""\
workdir: {directory / 'work'}
data: {{kind: text, src: en, tgt: ja, files: {json.dumps(files)}}}
precision: fp32
cache:
  root: {world['cache']}
  checkpoints:
    - {{name: tiny, checkpoint: {world['prlm']}, layers: all}}
train:
  defaults: {{preset: tiny, bpe_vocab: 400, max_tokens: 300, max_epochs: null, max_updates: {full}, warmup: 2,
             save_every: 100, keep_last: 2, log_every: 1, num_workers: 0, dropout: 0.0, seed: 3}}
  runs:
    fused: {{prlms: [{{checkpoint: tiny, layer: -2}}]}}
    base: {{}}
{runs}evaluate: {{baseline: base, beam: 1, average_last: 1, max_len_b: 4}}
{launcher}search:
  name: s
  base: fused
  space: {space}
  max_updates: {full}
  min_updates: {least}
  reduction_factor: 2
{search_extra}"""
    path = directory / "pipeline.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def with_data(path: Path) -> Path:
    """The pipeline's corpus registered in its workdir (`prlmfuse run --only data`), for `train` to find."""
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import ensure_data

    ensure_data(load_pipeline(path))
    return path


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1", **extra)


def cli(*args, cwd=None, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prlmfuse.cli", *map(str, args)], cwd=cwd, env=env(**extra_env),
                          capture_output=True, text=True, timeout=600)


def start(*args, **extra_env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prlmfuse.cli", *map(str, args)], env=env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(condition, proc: subprocess.Popen | None = None, timeout: float = 300, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            if proc is not None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def updates_logged(run_dir: Path) -> int:
    """The newest update of a run's metrics.jsonl (0 before any)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    updates = [json.loads(line).get("update", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return max(updates, default=0)


def study_trials(workdir: Path, name: str = "s") -> list:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(workdir / "search" / name / "journal.log")))
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
