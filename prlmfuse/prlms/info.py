"""What stage one needs to know about a PrLM checkpoint (CheckpointInfo), read from its config.

transformers is imported inside the functions that need it, so listing aliases and parsing a
pipeline file stay fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prlmfuse.errors import UserError


@dataclass(frozen=True)
class CheckpointInfo:
    name: str              # what the user wrote: alias, hub id or local path
    path: str              # what from_pretrained receives (local dir or hub id)
    family: str            # config.model_type: bert, distilbert, electra, gpt2, xlm-roberta, llama, ...
    num_layers: int        # transformer layers (hidden_states has num_layers + 1 entries, 0 = embeddings)
    hidden_size: int
    max_length: int        # max input tokens including special tokens
    is_causal: bool        # decoder-only LM (GPT-2, Llama...)
    identity: str          # sha256 over config, weight and tokenizer files (hex)
    trust_remote_code: bool = False


# Long inputs are rare for sentence-level fusion, and attention memory grows with the square of the
# length, so even a PrLM trained on 8k contexts is fed at most this many tokens.
MAX_LENGTH_CAP = 2048

# Models whose learned position table starts at padding_idx + 1, so two rows are unusable.
_POSITION_OFFSET_FAMILIES = {
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert", "mpnet",
    "roberta-prelayernorm", "xmod",
}
_CAUSAL_FAMILIES = {
    "gpt2", "gpt_neo", "gpt_neox", "gptj", "gpt_bigcode", "codegen", "ctrl", "xglm", "opt", "bloom",
    "falcon", "mpt", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi",
    "phi3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "stablelm", "starcoder2", "cohere",
    "granite", "smollm3",
}


def load_config(path: str, name: str, trust_remote_code: bool, *, local_files_only: bool = False):
    """transformers' AutoConfig for a checkpoint, with its unknown-model errors as UserError."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=local_files_only)
    except ValueError as e:
        # transformers raises ValueError for unknown model types and for repos that need remote code.
        raise UserError(f"cannot read the config of checkpoint '{name}': {str(e).splitlines()[0]}") from None


def _max_length(config, tokenizer_max: int | None) -> int:
    family = config.model_type
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and family in _POSITION_OFFSET_FAMILIES:
        positions -= 2
    candidates = [n for n in (tokenizer_max, positions) if n is not None and 0 < n < 1_000_000]
    if not candidates:
        return MAX_LENGTH_CAP
    return min(min(candidates), MAX_LENGTH_CAP)


def _tokenizer_max_length(directory: Path) -> int | None:
    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        value = cfg.get("model_max_length")
        return int(value) if value is not None else None
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return None


def _is_causal(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return bool(
        getattr(config, "is_decoder", False)
        or config.model_type in _CAUSAL_FAMILIES
        or any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
    )


def describe(name: str, path: str, config, directory: Path, identity: str, trust_remote_code: bool) -> CheckpointInfo:
    """CheckpointInfo from a loaded config and the local directory holding its tokenizer files."""
    num_layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if num_layers is None or hidden is None:
        raise UserError(
            f"checkpoint '{name}' ({config.model_type}) has no num_hidden_layers/hidden_size in its config; "
            "use an encoder or decoder-only language model"
        )
    return CheckpointInfo(
        name=name, path=path, family=config.model_type, num_layers=int(num_layers), hidden_size=int(hidden),
        max_length=_max_length(config, _tokenizer_max_length(directory)), is_causal=_is_causal(config),
        identity=identity, trust_remote_code=trust_remote_code,
    )
