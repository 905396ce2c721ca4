"""An untrained PrLM: a checkpoint's architecture and tokenizer with freshly initialised weights.

The control for "is it what the PrLM learned?": the same branch reading features of the same
architecture that never trained. The weights come from the model class's own initialisation
(`AutoModel.from_config`) under a seed, and are saved once as an ordinary checkpoint directory, so
the cache stage resolves, hashes and keys it like any other checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, publish_directory
from prlmfuse.prlms.info import CheckpointInfo, load_config
from prlmfuse.prlms.registry import resolve_checkpoint

logger = logging.getLogger(__name__)

# Written last into the directory: which checkpoint and seed it was made from.
RECORD = "prlmfuse-random-init.json"


def random_init_record(source: CheckpointInfo, seed: int) -> dict:
    return {"init": "random", "architecture_of": source.name, "source_identity": source.identity, "seed": int(seed)}


def is_prepared(directory: Path, source: CheckpointInfo, seed: int) -> bool:
    """Whether `directory` holds the untrained copy of `source` under `seed` (complete, same source files)."""
    try:
        return json.loads((directory / RECORD).read_text(encoding="utf-8")) == random_init_record(source, seed)
    except (OSError, ValueError):
        return False


def prepare_random_init(source_name: str, directory: str | Path, seed: int, *, trust_remote_code: bool = False) -> Path:
    """The untrained copy of checkpoint `source_name` under `seed` in `directory`, made once (atomically)."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = Path(directory)
    source = resolve_checkpoint(source_name, trust_remote_code=trust_remote_code)
    if is_prepared(directory, source, seed):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    logger.info("initialising an untrained %s (seed %d) into %s (once)", source.name, seed, directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        config = load_config(source.path, source.name, trust_remote_code)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its per-shard bar would sit between the cache stage's lines
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        atomic_write_json(tmp / RECORD, random_init_record(source, seed))
        publish_directory(tmp, directory)
    except OSError as e:
        raise UserError(f"cannot write the untrained copy of {source.name} to {directory}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
