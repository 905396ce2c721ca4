"""Converter: a SmolLM2 GGUF file -> a transformers Llama directory with the GGUF's own special tokens.

torch, gguf, tokenizers and transformers are imported inside the converter, so importing the PrLM
registry stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.prlms.info import MAX_LENGTH_CAP


def convert_gguf(source: Path, out: Path) -> None:
    """Write a Llama model and tokenizer converted from the GGUF file `source` into the directory `out`."""
    import torch
    from gguf import GGUFReader
    from tokenizers import processors
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # This is what from_pretrained(gguf_file=...) does internally, minus its hard requirement on
    # `accelerate` (only used there for device placement, which a CPU conversion does not need).
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise UserError(
            f"{source}: GGUF tensors do not match {type(model).__name__} (missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}); reinstall the package or upgrade transformers"
        )
    model.tie_weights()
    model.config.name_or_path = source.stem
    model.save_pretrained(out, safe_serialization=True)
    _rope_readable_by_both_majors(out / "config.json")

    # transformers' GGUF tokenizer conversion keeps the byte-level BPE but takes its special tokens
    # from Llama defaults (eos <|im_start|>, a prepended BOS); the GGUF metadata says otherwise.
    converted = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, trust_remote_code=False)
    fields = GGUFReader(str(source)).fields

    def field(key: str, default=None):
        return fields[key].contents() if key in fields else default

    tokens = field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = field(key)
        return tokens[idx] if idx is not None else None

    backend = converted.backend_tokenizer
    if field("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"{source}: expected a byte-level BPE (gpt2) tokenizer in the GGUF metadata")
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    context = field(f"{field('general.architecture')}.context_length")
    tokenizer = GPT2TokenizerFast(
        tokenizer_object=backend, bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"), unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"), add_prefix_space=False,
        model_max_length=int(context) if context else MAX_LENGTH_CAP,
    )
    if field("tokenizer.chat_template"):
        tokenizer.chat_template = field("tokenizer.chat_template")
    tokenizer.save_pretrained(out)


def _rope_readable_by_both_majors(config_file: Path) -> None:
    """Write the RoPE settings in both spellings: transformers 5 saves only `rope_parameters`, which
    4.x ignores (it would silently fall back to rope_theta 10,000), and 4.x saves only `rope_theta`."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        if "rope_theta" in params:
            config.setdefault("rope_theta", params["rope_theta"])
        if params.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
    elif "rope_theta" in config:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default",
                                     **(config.get("rope_scaling") or {})}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
