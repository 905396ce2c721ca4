"""The fused Transformer's building blocks: positions, attention, feed-forward and the merge of flows.

modeling.py's docstring gives the equations they take part in and the initialisation they follow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position embeddings (fairseq layout: all sines, then all cosines)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        half = dim // 2
        inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
        # Not persistent: recomputed from dim, so it never enters checkpoints.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
        if self.dim % 2:
            emb = F.pad(emb, (0, 1))
        return emb


def positions_from_mask(mask: Tensor) -> Tensor:
    """0, 1, 2, .. over the real tokens of each row, whichever side the padding is on."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def xavier_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """nn.Linear initialised as fairseq's `Linear` helper: xavier-uniform weight, zero bias."""
    linear = nn.Linear(in_features, out_features, bias)
    nn.init.xavier_uniform_(linear.weight)
    if bias:
        nn.init.zeros_(linear.bias)
    return linear


def cpu_training_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """softmax(q k^T / sqrt(head_dim) + mask) v through plain matmuls, for CPU training steps.

    Why: autograd through these matmuls trains faster on CPU than SDPA's kernels, whose backward is
    the slower part (`python bench/attention_kernel.py` times the two side by side).
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(torch.softmax(scores, dim=-1), dropout_p, training=dropout_p > 0)
    return torch.matmul(weights, v)


class MultiheadAttention(nn.Module):
    """Scaled dot-product attention with separate projections; keys/values may have another width.

    Initialised as fairseq's MultiheadAttention.reset_parameters (see there).
    """

    def __init__(self, d_model: int, heads: int, attn_dropout: float, kv_width: int | None = None):
        super().__init__()
        self.heads = heads
        self.head_dim = d_model // heads
        self.attn_dropout = attn_dropout
        kv_width = kv_width or d_model
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(kv_width, d_model)
        self.v_proj = nn.Linear(kv_width, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.qkv_same_dim = kv_width == d_model
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fairseq's init: q, k, v xavier-uniform (gain 1/sqrt(2) when keys have the query's width,
        fairseq's `qkv_same_dim`), their biases left at nn.Linear's default; out_proj xavier, bias 0."""
        gain = 1 / math.sqrt(2) if self.qkv_same_dim else 1.0
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B, heads, S, head_dim] of `memory` [B, S, kv_width]."""
        return self._split_heads(self.k_proj(memory)), self._split_heads(self.v_proj(memory))

    def attend(
        self, query_states: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """Attend from query_states [B, T, d] over projected keys/values.

        key_mask [B, S] (True = real key). causal: the T queries are the last T positions of the
        S keys (full prefix when T == S, one new step when T == 1).
        """
        batch, q_len, d_model = query_states.shape
        k_len = keys.shape[2]
        q = self._split_heads(self.q_proj(query_states))
        attn_mask, empty_rows = None, None
        if key_mask is not None:
            # A row with no real key would softmax over nothing (NaN); it attends to everything and
            # its output is zeroed below, so it contributes nothing. Done for every row, since asking
            # whether any row is empty would wait for the device (and break a compiled graph).
            empty_rows = ~key_mask.any(dim=-1)
            key_mask = key_mask | empty_rows[:, None]
            attn_mask = key_mask[:, None, None, :]
        written_out = q.device.type == "cpu" and q.requires_grad
        is_causal = False
        if causal and q_len > 1:
            if attn_mask is None and q_len == k_len and not written_out:
                is_causal = True
            else:
                causal_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
                attn_mask = causal_mask if attn_mask is None else attn_mask & causal_mask
        dropout_p = self.attn_dropout if self.training else 0.0
        if written_out:
            out = cpu_training_attention(q, keys, values, attn_mask, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, d_model))
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[:, None, None], 0.0)
        return out

    def forward(self, query_states: Tensor, memory: Tensor, key_mask: Tensor | None = None) -> Tensor:
        keys, values = self.project_kv(memory)
        return self.attend(query_states, keys, values, key_mask)


class FeedForward(nn.Module):
    """fc2(act(fc1(x))); both Linears keep nn.Linear's default init, as fairseq's build_fc1/build_fc2."""

    def __init__(self, d_model: int, ffn: int, activation: str, activation_dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)
        self.activation = F.relu if activation == "relu" else F.gelu
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout(self.activation(self.fc1(x))))


class FlowMerge(nn.Module):
    """Merge the source flow flows[0] with the PrLM flows flows[1:] (see modeling.py's docstring)."""

    def __init__(self, strategy: str, d_model: int, num_prlms: int, dropnet_p: float):
        super().__init__()
        self.strategy = strategy
        self.dropnet_p = dropnet_p
        self.num_prlms = num_prlms
        if strategy == "gate":
            # One logit vector per PrLM flow; the source flow is the reference class at 0.
            # fairseq has no gate; its `Linear` helper is what its other learned projections get.
            self.gate_proj = xavier_linear((num_prlms + 1) * d_model, num_prlms * d_model)

    def forward(self, flows: list[Tensor]) -> Tensor:
        if self.strategy == "sum":
            return _sum(flows)
        if self.strategy == "average":
            return _sum(flows) / len(flows)
        if self.strategy == "gate":
            logits = self.gate_proj(torch.cat(flows, dim=-1)).unflatten(-1, (self.num_prlms, -1))
            logits = torch.cat([torch.zeros_like(logits[..., :1, :]), logits], dim=-2)
            weights = torch.softmax(logits.float(), dim=-2).to(logits.dtype)
            return (weights * torch.stack(flows, dim=-2)).sum(dim=-2)
        if self.strategy == "dropnet":
            if self.training and self.dropnet_p > 0:
                draw = float(torch.rand(()))
                if draw < self.dropnet_p / 2:
                    return flows[0]
                if draw < self.dropnet_p:
                    return _sum(flows[1:]) / (len(flows) - 1)
            return _sum(flows) / len(flows)
        raise AssertionError(f"merge {self.strategy!r} has no PrLM branch to merge")


def _sum(tensors: list[Tensor]) -> Tensor:
    out = tensors[0]
    for t in tensors[1:]:
        out = out + t
    return out
