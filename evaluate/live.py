"""Translate raw text with a trained run, running its frozen PrLM on the input ("live" features).

The features must be the ones the run was trained on: same checkpoint (identity checked),
same layers, same middle-cut truncation, same dtype rounding and the same compute precision
(on whichever device runs it here). The surest way to guarantee that is to go through the cache stage itself: the input lines
are written to a temporary corpus file and `build_cache` encodes them into a temporary cache with
the training cache's settings, which is then read exactly as the batch evaluation reads its
test cache. The temporary directory is removed afterwards; nothing is left under a trusted name.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from prlmfuse.cache_features.compat import precision_of
from prlmfuse.errors import UserError
from prlmfuse.evaluate.corpus_decode import decode_corpus, encode_sources, note_truncated
from prlmfuse.evaluate.runs import RunView, load_model, open_run, select_weights
from prlmfuse.evaluate.settings import AVERAGE, AVERAGE_LAST, BATCH_TOKENS, DEFAULTS, DecodeSettings
from prlmfuse.fileio import sha256_file
from prlmfuse.precision import Runtime, resolve_runtime
from prlmfuse.train_fused.branches import PrLMBranch

logger = logging.getLogger(__name__)


def live_features(
    run: RunView,
    lines: Sequence[str],
    workdir: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    max_tokens: int | None = None,
    progress: bool = False,
    device: str = "auto",
) -> list[PrLMBranch]:
    """Run each PrLM of the run over `lines` into a cache under `workdir` with the key fields of the
    cache the run trained on; one PrLMBranch per branch, opened like a test cache."""
    from prlmfuse.cache_features import build_cache
    from prlmfuse.prlms import resolve_checkpoint

    workdir = Path(workdir)
    corpus_file = workdir / "input.src"
    corpus_file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    paths = []
    for i, prlm in enumerate(run.prlms):
        trained = prlm["key_fields"]
        # The checkpoint the cache was built from: a pipeline's label for it (cache.checkpoints' name) may differ.
        name = str(trained.get("checkpoint") or prlm["checkpoint"])
        info = resolve_checkpoint(name, trust_remote_code=trust_remote_code)
        if info.identity != trained["checkpoint_identity"]:
            raise UserError(
                f"checkpoint {name} now resolves to different files (identity {info.identity[:12]}) than run "
                f"{run.name} was trained with ({str(trained['checkpoint_identity'])[:12]}); restore that checkpoint or retrain"
            )
        result = build_cache(
            name,
            corpus_file,
            workdir / f"prlm-{i}",
            layers=[int(x) for x in trained["layers"]],
            # A private cache read once: either backend serves, and an offline node may lack zarr.
            backend="zarr" if importlib.util.find_spec("zarr") is not None else "hdf5",
            dtype=str(trained["dtype"]),
            max_tokens=max_tokens,
            # the precision the run's training features were computed at, on whichever device runs it here
            device=device,
            precision=precision_of(trained),
            progress=progress,
            trust_remote_code=trust_remote_code,
        )
        paths.append(str(result.path))
    return run.open_branches(paths, source=str(corpus_file), source_name="input", source_sha256=sha256_file(corpus_file),
                             source_lines=len(lines))


def translate(
    run_dir: str | os.PathLike,
    lines: Sequence[str],
    *,
    beam: int = DEFAULTS.beam,
    lenpen: float = DEFAULTS.lenpen,
    average_last: int = AVERAGE_LAST,
    average: str = AVERAGE,
    no_repeat_ngram_size: int | None = None,
    max_len_a: float = DEFAULTS.max_len_a,
    max_len_b: int = DEFAULTS.max_len_b,
    min_len: int = DEFAULTS.min_len,
    batch_tokens: int = BATCH_TOKENS,
    bf16: bool = DEFAULTS.bf16,
    trust_remote_code: bool = False,
    progress: bool = False,
    device: str = "auto",
) -> list[str]:
    """Decode raw source lines with a trained run; its PrLM(s) run live on the input.

    Same decoding as `evaluate_runs` (average of the newest `average_last` checkpoints, or epoch-end
    checkpoints for average="epochs", 0 = best;
    no_repeat_ngram_size defaults to 3 for summarization runs), one output line per input line.
    """
    if beam < 1:
        raise UserError(f"beam must be >= 1, got {beam}")
    runtime = Runtime(resolve_runtime(device, "auto").device, torch.bfloat16 if bf16 else torch.float32)
    run = open_run(run_dir)
    shuffled = [str(use.get("checkpoint")) for use in (run.record.get("train") or {}).get("prlms") or []
                if use.get("control") == "shuffled"]
    if shuffled:
        raise UserError(f"run {run.name} reads {', '.join(shuffled)} under control 'shuffled' (another sentence's "
                        "features from its split), which raw text has no split for; translate with a run without it")
    # One sentence per line: a stray newline or carriage return would shift every later line.
    lines = [" ".join(line.replace("\r", " ").replace("\n", " ").split()) if ("\n" in line or "\r" in line) else line
             for line in lines]
    if not lines:
        return []
    weights = select_weights(run, average_last, average)
    settings = DecodeSettings.for_run(run, no_repeat_ngram_size, beam=beam, lenpen=lenpen, max_len_a=max_len_a,
                                      max_len_b=max_len_b, min_len=min_len, bf16=bf16)
    logger.info("translate: %s, %d line(s) (%s)", run.name, len(lines), runtime.describe())
    model, bpe = load_model(run, weights, average)
    model.to(runtime.device)
    cut: dict = {}
    src_ids = encode_sources(bpe, lines, int(run.model_config.get("max_positions", 1024)),
                             max_source_tokens=run.max_source_tokens, stats=cut)
    if progress:
        note_truncated(cut, f"{run.name}/translate")
    with tempfile.TemporaryDirectory(prefix="prlmfuse-live-") as workdir:
        branches = live_features(run, lines, workdir, trust_remote_code=trust_remote_code, progress=progress,
                                 device=str(runtime.device))
        decoded = decode_corpus(model, bpe, src_ids, branches, settings, batch_tokens=batch_tokens,
                                progress=progress, desc=f"{run.name}/translate")
    return decoded.hyps
