"""Load a resolved PrLM checkpoint as a frozen model and a right-padding tokenizer.

transformers is imported inside the functions, so importing the PrLM package stays fast.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING

from prlmfuse.errors import UserError
from prlmfuse.prlms.info import CheckpointInfo, load_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _tokenizer_quirk_kwargs(family: str) -> dict:
    # transformers 4.57.3+ warns about a Mistral pre-tokenizer regex for *every* local directory
    # saved by it, whatever the model; the warning claims tokenization will be wrong. It only
    # applies to Mistral tokenizers, so say so explicitly for everything else.
    from transformers import PreTrainedTokenizerBase

    accepts = "fix_mistral_regex" in inspect.signature(PreTrainedTokenizerBase._from_pretrained).parameters
    if accepts and family not in {"mistral", "mistral3", "ministral", "pixtral", "voxtral"}:
        return {"fix_mistral_regex": False}
    return {}


def load_prlm(info: CheckpointInfo) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Frozen base model (eval, no grad) and a right-padding tokenizer with a pad token."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    config = load_config(info.path, info.name, info.trust_remote_code)
    kwargs = {}
    model_class = None
    with contextlib.suppress(Exception):
        model_class = AutoModel._model_mapping[type(config)]
    if model_class is not None and "add_pooling_layer" in inspect.signature(model_class.__init__).parameters:
        # The pooler is never used for features, and the converted checkpoints do not ship one.
        kwargs["add_pooling_layer"] = False

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    # Without the pooler, transformers warns that the checkpoint's pooler weights go unused: expected.
    hf_logging.set_verbosity_error()
    # Its per-tensor "Loading weights" bar would sit between each stage's first line and its own progress.
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(
            info.path, config=config, trust_remote_code=info.trust_remote_code, use_safetensors=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(
            info.path, trust_remote_code=info.trust_remote_code, **_tokenizer_quirk_kwargs(info.family)
        )
    except OSError as e:
        raise UserError(f"cannot load checkpoint '{info.name}' from {info.path}: {str(e).splitlines()[0]}") from None
    except (ValueError, TypeError, KeyError, AttributeError, ImportError) as e:
        # What transformers and tokenizers raise for a tokenizer or weights they cannot make sense of.
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot load checkpoint '{info.name}' from {info.path} ({type(e).__name__}: {first}); "
                        "check that its model and tokenizer files are complete") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    model.requires_grad_(False)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        # GPT-2/Llama ship no pad token; right padding plus the attention mask keeps eos-as-pad
        # from ever being attended to.
        if tokenizer.eos_token is None:
            raise UserError(f"checkpoint '{info.name}' has neither a pad nor an eos token; add a pad token to its tokenizer")
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
