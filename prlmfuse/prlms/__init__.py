"""Frozen pretrained LMs (PrLMs): name -> checkpoint directory with a content identity -> loaded model.

    info = resolve_checkpoint("minilm-l6")      # alias, local directory or hub id -> CheckpointInfo
    model, tokenizer = load_prlm(info)          # frozen base model, right-padding tokenizer
    list_aliases() -> rows for `prlmfuse checkpoints list`
    prepare_alias("e5-small-multilingual")     # convert an offline alias once into $PRLMFUSE_HOME

Modules: registry (aliases, preparation, resolution), identity (checkpoint_identity), info
(CheckpointInfo read from a config), loading (load_prlm), convert_e5 and convert_gguf (the two
offline formats turned into transformers directories).
"""

from prlmfuse.prlms.identity import checkpoint_identity
from prlmfuse.prlms.info import MAX_LENGTH_CAP, CheckpointInfo
from prlmfuse.prlms.loading import load_prlm
from prlmfuse.prlms.registry import list_aliases, prepare_alias, resolve_checkpoint

__all__ = [
    "MAX_LENGTH_CAP",
    "CheckpointInfo",
    "checkpoint_identity",
    "list_aliases",
    "load_prlm",
    "prepare_alias",
    "resolve_checkpoint",
]
