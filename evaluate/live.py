"""Translate raw text with a trained run, running its frozen PrLM on the input ("live" features).

The features must be the ones the run was trained on: same checkpoint (identity checked),
same layers, same middle-cut truncation, same dtype rounding and the same bf16-or-not forward
pass. The surest way to guarantee that is to go through the cache stage itself: the input lines
are written to a temporary corpus file and `build_cache` encodes them into a temporary cache with
the training cache's settings, which is then read exactly as the batch evaluation reads its
test cache. The temporary directory is removed afterwards; nothing is left under a trusted name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

from prlmfuse.errors import UserError
from prlmfuse.evaluate.jobs import (
    BranchFeatures,
    DecodeSettings,
    _read_manifest,
    check_cache_key,
    decode_corpus,
    encode_sources,
    load_model,
    note_truncated,
    open_run,
    run_layer_rows,
    select_weights,
)
from prlmfuse.fileio import sha256_file


def _train_key_fields(prlm: dict) -> dict | None:
    """key_fields of the cache the run trained on, if that cache is still readable and unchanged."""
    entry = (prlm.get("caches") or {}).get("train") or {}
    if not entry.get("path"):
        return None
    manifest = _read_manifest(str(entry["path"]))
    if manifest is None or manifest.get("key") != entry.get("key"):
        return None
    return manifest.get("key_fields")


def live_features(
    run_dir: str | os.PathLike,
    lines: Sequence[str],
    workdir: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    max_tokens: int = 8192,
    progress: bool = False,
) -> list[BranchFeatures]:
    """Run each PrLM of the run over `lines` into a cache under `workdir`; one BranchFeatures per branch."""
    from prlmfuse.cache_features import CacheReader, build_cache
    from prlmfuse.prlms import resolve_checkpoint

    run = open_run(run_dir)
    workdir = Path(workdir)
    corpus_file = workdir / "input.src"
    corpus_file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    specs = run.model_config.get("prlms") or []
    branches: list[BranchFeatures] = []
    for i, (prlm, spec) in enumerate(zip(run.prlms, specs)):
        name = str(prlm.get("checkpoint"))
        info = resolve_checkpoint(name, trust_remote_code=trust_remote_code)
        if prlm.get("identity") and info.identity != prlm["identity"]:
            raise UserError(
                f"checkpoint {name} now resolves to different files (identity {info.identity[:12]}) than run "
                f"{run.name} was trained with ({str(prlm['identity'])[:12]}); restore that checkpoint or retrain"
            )
        train_fields = _train_key_fields(prlm)
        layers = (train_fields or {}).get("layers") or prlm.get("cache_layers") or prlm.get("layers")
        autocast = None
        if train_fields and "autocast" in train_fields:
            autocast = train_fields["autocast"] != "off"
        result = build_cache(
            name,
            corpus_file,
            workdir / f"prlm-{i}",
            layers=[int(x) for x in layers],
            backend="zarr",
            dtype=str(prlm.get("dtype") or "float16"),
            max_tokens=max_tokens,
            autocast=autocast,
            progress=progress,
            trust_remote_code=trust_remote_code,
        )
        reader = CacheReader(result.path, in_memory=True)
        check_cache_key(reader.manifest, train_fields, prlm, where=f"live features of {name}",
                        src_sha256=sha256_file(corpus_file))
        layer_rows, pooled_rows = run_layer_rows(
            prlm, int(spec.get("num_pooled", 0)), list(reader.layers), list(reader.pooled_layers),
            where=f"live features of {name}",
        )
        branches.append(BranchFeatures(reader, layer_rows, pooled_rows))
    return branches


def translate(
    run_dir: str | os.PathLike,
    lines: Sequence[str],
    *,
    beam: int = 5,
    lenpen: float = 1.0,
    average_last: int = 5,
    no_repeat_ngram_size: int | None = None,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    min_len: int = 1,
    batch_tokens: int = 4096,
    bf16: bool = False,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> list[str]:
    """Decode raw source lines with a trained run; its PrLM(s) run live on the input.

    Same decoding as `evaluate_runs` (average of the newest `average_last` checkpoints, 0 = best;
    no_repeat_ngram_size defaults to 3 for summarization runs), one output line per input line.
    """
    if beam < 1:
        raise UserError(f"beam must be >= 1, got {beam}")
    run = open_run(run_dir)
    # One sentence per line: a stray newline or carriage return would shift every later line.
    lines = [" ".join(line.replace("\r", " ").replace("\n", " ").split()) if ("\n" in line or "\r" in line) else line
             for line in lines]
    if not lines:
        return []
    weights = select_weights(run, average_last)
    settings = DecodeSettings.for_run(run, no_repeat_ngram_size, beam=beam, lenpen=lenpen, max_len_a=max_len_a,
                                      max_len_b=max_len_b, min_len=min_len, bf16=bf16)
    model, bpe = load_model(run, weights)
    cut: dict = {}
    src_ids = encode_sources(bpe, lines, int(run.model_config.get("max_positions", 1024)), stats=cut)
    if progress:
        note_truncated(cut, f"{run.name}/translate")
    with tempfile.TemporaryDirectory(prefix="prlmfuse-live-") as workdir:
        branches = live_features(run.run_dir, lines, workdir, trust_remote_code=trust_remote_code, progress=progress)
        decoded = decode_corpus(model, bpe, src_ids, branches, settings, batch_tokens=batch_tokens,
                                progress=progress, desc=f"{run.name}/translate")
    return decoded.hyps
