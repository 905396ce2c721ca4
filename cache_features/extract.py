"""Turn a corpus into PrLM hidden states: tokenize, middle-cut, plan batches, run the frozen model.

Nothing here touches the disk; `builder.py` streams what `FeatureExtractor` returns into shards.
"""

from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from prlmfuse.batching import token_budget_batches
from prlmfuse.errors import UserError
from prlmfuse.precision import free_memory, is_out_of_memory

logger = logging.getLogger(__name__)

# Where each family keeps its stack of transformer layers, relative to the AutoModel base model.
_LAYER_LIST_PATHS = ("encoder.layer", "transformer.layer", "h", "layers", "decoder.layers", "encoder.layers")
# Norms HF applies after the last layer (and folds into hidden_states[-1] only).
_FINAL_NORM_PATHS = ("ln_f", "norm", "final_layer_norm", "decoder.final_layer_norm", "final_layernorm")


# ----------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class LayerSelection:
    """Which hidden_states indices are stored (absolute, 0 = embeddings, num_layers = last)."""

    token_layers: tuple[int, ...]  # stored as per-token features, ascending
    num_layers: int  # transformer layers of the checkpoint

    @property
    def highest(self) -> int:
        return self.token_layers[-1]

    @property
    def pooled_layers(self) -> tuple[int, ...]:
        # The first-token and mean vectors a run can read: Dyn[CLS] and Dyn[Aver] weigh the stored
        # layers by their own (compat.choose_layers), so no other layer's are kept.
        return self.token_layers


def parse_layers(spec: str | int | Sequence[int], num_layers: int) -> LayerSelection:
    """'-2', '-2,-3', 'all', 5 or [4, 5] -> absolute, sorted, de-duplicated hidden_states indices."""
    lo, hi = -(num_layers + 1), num_layers
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return LayerSelection(tuple(range(num_layers + 1)), num_layers)
        try:
            raw = [int(part) for part in text.split(",") if part.strip() != ""]
        except ValueError:
            raise UserError(
                f"layers {spec!r} is not a comma-separated list of integers; use e.g. '-2', '-2,-3' or 'all'"
            ) from None
    elif isinstance(spec, int):
        raw = [spec]
    else:
        raw = [int(x) for x in spec]
    if not raw:
        raise UserError("layers is empty; give at least one index, e.g. '-2' (penultimate) or 'all'")
    absolute = set()
    for index in raw:
        if not lo <= index <= hi:
            raise UserError(
                f"layer index {index} is outside this model's hidden states; valid range is {lo}..{hi} "
                f"(0 = embeddings, {hi} = last of {num_layers} layers, negative counts from the end)"
            )
        absolute.add(index % (num_layers + 1))
    return LayerSelection(tuple(sorted(absolute)), num_layers)


# ----------------------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class EncodedCorpus:
    """Token ids of every sentence, flat (int32) with offsets, plus what the middle cut removed."""

    flat_ids: np.ndarray  # int32 [total_tokens]
    offsets: np.ndarray  # int64 [num_sentences + 1]
    truncated_sentences: int
    truncated_tokens: int

    @property
    def num_sentences(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def ids(self, i: int) -> np.ndarray:
        return self.flat_ids[self.offsets[i] : self.offsets[i + 1]]


def middle_cut(ids: list[int], max_length: int) -> list[int]:
    """Keep the head and the tail and drop the middle (Sun et al. 2019, head+tail).

    Applied to the sequence *with* its special tokens, so [CLS] ... [SEP] (or <s> ... </s>) survive.
    The head gets a quarter of the budget, as in Sun et al.'s best setting (128 + 382 of 512).
    """
    if len(ids) <= max_length:
        return ids
    head = max(1, max_length // 4)
    tail = max_length - head
    return ids[:head] + ids[len(ids) - tail :]


def _fallback_token(tokenizer) -> int:
    for tok_id in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.cls_token_id, tokenizer.unk_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


def encode_corpus(tokenizer, lines: Iterable[str], *, max_length: int, chunk_lines: int = 2048) -> EncodedCorpus:
    """Tokenize with the checkpoint's own special tokens, middle-cut to max_length, pack flat.

    Lines are tokenized in chunks so memory stays at the flat int32 ids, whatever the corpus size.
    An empty line keeps its special tokens; a causal LM that adds none gets one BOS (or EOS) token,
    because a forward pass needs at least one position.
    """
    if max_length < 2:
        raise UserError(f"max_length {max_length} is too small; a sentence needs room for its special tokens")
    fallback = _fallback_token(tokenizer)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    truncated_sentences = truncated_tokens = 0

    def flush(batch: list[str]) -> None:
        nonlocal truncated_sentences, truncated_tokens
        encoded = tokenizer(
            batch,
            add_special_tokens=True,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )["input_ids"]
        for ids in encoded:
            if not ids:
                ids = [fallback]
            if len(ids) > max_length:
                truncated_sentences += 1
                truncated_tokens += len(ids) - max_length
                ids = middle_cut(ids, max_length)
            pieces.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))

    buffer: list[str] = []
    for line in lines:
        buffer.append(line)
        if len(buffer) >= chunk_lines:
            flush(buffer)
            buffer = []
    if buffer:
        flush(buffer)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return EncodedCorpus(flat, offsets, truncated_sentences, truncated_tokens)


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class ShardPlan:
    """One shard: consecutive batches of the plan. Its bounds depend only on the plan."""

    index: int
    batches: tuple[np.ndarray, ...]  # global sentence ids per batch, in plan order

    @property
    def sentence_ids(self) -> np.ndarray:
        return np.concatenate(self.batches)

    @property
    def name_stem(self) -> str:
        return f"shard-{self.index:05d}"


def plan_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Sentences sorted by length (ties by sentence id), cut into batches within max_tokens."""
    return token_budget_batches(np.argsort(lengths, kind="stable"), lengths, max_tokens)


def plan_shards(batches: list[np.ndarray], lengths: np.ndarray, bytes_per_token: int, shard_bytes: int) -> list[ShardPlan]:
    """Group whole batches into shards of at most ~shard_bytes of token features (at least one batch each)."""
    shards: list[ShardPlan] = []
    current: list[np.ndarray] = []
    current_bytes = 0
    for batch in batches:
        batch_bytes = int(lengths[batch].sum()) * bytes_per_token
        if current and current_bytes + batch_bytes > shard_bytes:
            shards.append(ShardPlan(len(shards), tuple(current)))
            current, current_bytes = [], 0
        current.append(batch)
        current_bytes += batch_bytes
    if current:
        shards.append(ShardPlan(len(shards), tuple(current)))
    return shards


def collate(corpus: EncodedCorpus, sentence_ids: np.ndarray, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention_mask (1 = real token) for one batch."""
    lengths = corpus.lengths[sentence_ids]
    width = int(lengths.max())
    input_ids = np.full((len(sentence_ids), width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(sentence_ids), width), dtype=np.int64)
    for row, (sid, n) in enumerate(zip(sentence_ids, lengths)):
        input_ids[row, :n] = corpus.ids(int(sid))
        attention_mask[row, :n] = 1
    return torch.from_numpy(input_ids), torch.from_numpy(attention_mask)


def pad_token_id(tokenizer) -> int:
    # padded positions are masked out, so any valid id works when the tokenizer defines none (GPT-2)
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


# ----------------------------------------------------------------------------- forward


def _get_path(module: nn.Module, dotted: str) -> nn.Module | None:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _replace_path(root: nn.Module, dotted: str, new: nn.Module | None) -> None:
    """Replace root.<dotted> in `root` only: every container on the way is shallow-copied first,
    so the caller's model keeps its own layers and norm."""
    parts = dotted.split(".")
    parent = root
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = new


def find_layer_list(model: nn.Module) -> str:
    for path in _LAYER_LIST_PATHS:
        if isinstance(_get_path(model, path), nn.ModuleList):
            return path
    raise UserError(
        f"cannot find the transformer layer list of {type(model).__name__}; supported layouts: "
        + ", ".join(_LAYER_LIST_PATHS)
    )


def truncated_model(model: nn.Module, highest: int) -> nn.Module:
    """A view of `model` that runs only layers 1..highest, sharing all weights.

    hidden_states[highest] of the view equals hidden_states[highest] of the full model: when the
    view stops early, the final norm (GPT-2 ln_f, Llama norm) is dropped, because HF applies it only
    to the very last layer's output.
    """
    layer_path = find_layer_list(model)
    layers = _get_path(model, layer_path)
    num_layers = len(layers)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    if highest < num_layers:
        _replace_path(view, layer_path, nn.ModuleList(list(layers)[:highest]))
        for norm_path in _FINAL_NORM_PATHS:
            if _get_path(model, norm_path) is not None and norm_path.rsplit(".", 1)[0] != layer_path:
                _replace_path(view, norm_path, nn.Identity())
                break
    if "pooler" in view._modules:  # BERT / XLM-R pooler output is never stored
        view._modules["pooler"] = None
    return view


class FeatureExtractor:
    """Frozen PrLM -> (token features of the selected layers, first-token and mean vectors of those layers)."""

    def __init__(self, model: nn.Module, selection: LayerSelection, *, runtime=None):
        """runtime: a prlmfuse.precision.Runtime (device and autocast precision); None is the CPU at fp32."""
        from prlmfuse.precision import Runtime

        self.selection = selection
        self.runtime = runtime if runtime is not None else Runtime(torch.device("cpu"), torch.float32)
        self.model = truncated_model(model.eval().to(self.runtime.device), selection.highest)
        # DistilBERT and other encoders take no use_cache argument; causal LMs must not build a KV cache
        self.forward_kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns token_states float32 [n_token_layers, B, T, d] and pooled float32 [B, n_pooled, 2, d],
        on the runtime's device (inputs may be on the host: they are moved there).

        A batch that runs out of memory is run again in halves and the halves' features joined: right
        padding with a mask makes each sentence's features independent of its batch, so they are the same.
        """
        try:
            return self._forward(input_ids, attention_mask)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
        free_memory(self.runtime.device)  # outside the except block: the failed pass's frames are gone
        batch, width = input_ids.shape
        if batch == 1:
            raise UserError(f"out of memory running the PrLM over one sentence of {width} tokens; lower its "
                            "max_length or run the cache stage on a device with more memory")
        logger.warning("cache: out of memory on %d sentences of %d tokens; running them in halves", batch, width)
        halves = [self(input_ids[rows], attention_mask[rows]) for rows in (slice(0, batch // 2), slice(batch // 2, batch))]
        return torch.cat([h[0] for h in halves], dim=1), torch.cat([h[1] for h in halves], dim=0)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.runtime.device
        if input_ids.device != device:
            non_blocking = input_ids.is_pinned()
            input_ids = input_ids.to(device, non_blocking=non_blocking)
            attention_mask = attention_mask.to(device, non_blocking=non_blocking)
        with torch.inference_mode(), self.runtime.autocast():
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, return_dict=True,
                **self.forward_kwargs,
            )
            hidden = out.hidden_states
            if not hidden and self.selection.highest == 0:
                # models that record hidden states by hooks (Llama; every model in transformers 5) record
                # nothing when no layer runs; the embeddings are then last_hidden_state, the final norm
                # having been dropped from the view
                hidden = (out.last_hidden_state,)
            if len(hidden) != self.selection.highest + 1:
                raise RuntimeError(
                    f"{type(self.model).__name__} returned {len(hidden)} hidden states, "
                    f"expected {self.selection.highest + 1}"
                )
        # pooling runs outside autocast: a bmm inside it would be cast back down to bf16
        with torch.inference_mode():
            weights = attention_mask.to(torch.float32)
            weights = (weights / weights.sum(1, keepdim=True).clamp(min=1))[:, None, :]  # [B, 1, T]
            token_states = torch.stack([hidden[k].float() for k in self.selection.token_layers])
            # the pooled layers are the stored ones (LayerSelection.pooled_layers)
            first = [h[:, 0] for h in token_states]
            mean = [torch.bmm(weights, h)[:, 0] for h in token_states]
            pooled = torch.stack([torch.stack(first, 1), torch.stack(mean, 1)], dim=2)  # [B, n_pooled, 2, d]
        return token_states, pooled
