"""The fused Transformer: a Transformer encoder-decoder with one PrLM branch per frozen PrLM.

Park & Zhao (2021) add to every encoder layer an attention over the cached PrLM states H_P and
a PrLM feed-forward, and merge that flow with the layer's source flow. This file gives the model's
equations and holds its encoder and decoder layers and the incremental decoding API used by
`prlmfuse.evaluate.decode`; its parts are blocks.py's (positions, attention, FFN, the merge of flows)
and layer_selection.py's (the cached PrLM layers a branch reads); its configuration and rules are
`train_fused.config`'s (ModelConfig, PrLMSpec).

Notation for one encoder layer with input H, PrLM features Z_1..Z_k (after layer selection,
width d_p each), `drop` = dropout, and Merge(a_0, a_1..a_k) the merge strategy (below):

    A_S = drop(SelfAttn(H, H, H))          A_j = drop(PrLMAttn_j(H, Z_j, Z_j))

The PrLM attention's key/value projections take width d_p to d_model, so PrLMs of any width
plug in directly. `drop` is `dropout`; attention weights take `attention_dropout`, the FFN's hidden
activations `activation_dropout` (FFN(x) = fc2(drop_act(act(fc1(x))))), and Z_j, once per
forward, `feature_dropout` (off by default: noise a PrLM run in train mode would give its output). Post-LN (the paper's setting, `pre_ln=False`), by merge `position`:

    attn:       x = LN1(H + Merge(A_S, A_1..A_k))
                H' = LN2(x + drop(FFN(x)))
    add_norm1:  x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)
                x = Merge(x_S, x_1..x_k);  H' = LN2(x + drop(FFN(x)))
    ffn:        x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)                      (default)
                F_S = drop(FFN(x_S));  F_j = drop(FFN_j(x_j))
                H' = LN2(x_S + Merge(F_S, F_1..F_k))
    add_norm2:  x_S, x_j as for ffn
                y_S = LN2(x_S + drop(FFN(x_S)));  y_j = LN2_j(x_j + drop(FFN_j(x_j)))
                H' = Merge(y_S, y_1..y_k)

`ffn` is the paper's equation H' = (Flow_P + Flow_S) + Attn_S read with post-LN: the flows
are the two FFN outputs and "+ Attn_S" is the residual x_S (the source flow's first
add&norm), then the usual second add&norm.

Pre-LN (`pre_ln=True`) normalises sublayer inputs instead of outputs, and both attentions
share the normalised query h = LN1(H):

    attn:       x = H + Merge(drop(SelfAttn(h)), drop(PrLMAttn_j(h, Z_j))..);  H' = x + drop(FFN(LN2(x)))
    ffn:        x_S = H + A_S;  x_j = H + A_j
                H' = x_S + Merge(drop(FFN(LN2(x_S))), drop(FFN_j(LN2_j(x_j)))..)

Pre-LN has no add&norm after a sublayer, and merging two residual streams there would add H
k+1 times per layer (the stream would grow geometrically with depth), so `add_norm1` and
`add_norm2` are rejected with `pre_ln=True`; the encoder and decoder end with a final LN.

Merge strategies over the source flow a and PrLM flows b_1..b_k:

    sum:      a + b_1 + .. + b_k                                       (default, the paper's)
    average:  (a + b_1 + .. + b_k) / (k + 1)
    gate:     softmax over the k+1 flows of per-dimension logits [0, l_1..l_k],
              l = W[a; b_1; ..; b_k] + c. For k = 1 this is Yang et al. (2020):
              g*a + (1-g)*b with g = sigmoid(-l) = sigmoid(W'[a; b] + c'), W' = -W.
    dropnet:  Zhu et al. (2020). Training: one draw per layer and batch (as in bert-nmt); with
              probability p/2 only a, with p/2 only the PrLM flows (their mean), else the
              average of all k+1 flows. Evaluation: always the average.
    direct:   no PrLM branch. Each PrLM's features go through Linear(d_p, d_model) plus
              sinusoidal positions and replace the source embeddings; with several PrLMs their
              sequences are concatenated. The encoder runs over that sequence with the PrLM
              masks; src_tokens are not read.

Side `target` (or `both`) gives every decoder layer PrLM attentions too, as bert-nmt (Zhu et al.
2020) does: their outputs are merged with the encoder-decoder attention output, whatever
`position` says (that option is about the encoder):

    x2 = LN2(x1 + Merge(drop(EncAttn(x1, enc)), drop(PrLMAttn_j(x1, Z_j))..))

Side `target_flow` (or `both_flow`) follows the authors' fairseq fork (Park & Zhao's code): each
decoder PrLM attention reads the encoder attention's query x1 and starts a flow of its own, with
its own add&norm and FFN, merged with the decoder's flow at `position` by the encoder's equations
above, the encoder attention in the role of SelfAttn (e.g. `ffn`: x_E = LN2(x1 + drop(EncAttn));
x_j = LN2_j(x1 + drop(PrLMAttn_j)); H' = LN3(x_E + Merge(drop(FFN(x_E)), drop(FFN_j(x_j))..))).
With position `attn` the two sides coincide.

Layer selection (fixed, Dyn[CLS]/Dyn[Aver], DWAtt, Concat) turns a branch's cached layers into Z_j;
layer_selection.py's docstring gives its equations.

Initialisation is fairseq 0.12's transformer's: attention q, k, v xavier-uniform with gain
1/sqrt(2) when keys have the query's width (plain xavier for a PrLM branch's wider or narrower
keys) with nn.Linear's default biases, out_proj xavier with a zero bias, the FFN at nn.Linear's
default, embeddings N(0, d^-1/2) with the padding row zero; projections fairseq has no
counterpart for get its `Linear` helper's xavier-uniform with a zero bias (`xavier_linear`), except the
Dyn[CLS]/Dyn[Aver] scorer, which keeps nn.Linear's default as the authors' fork does.

Token ids: pad 0, bos 1, eos 2 by default (see ModelConfig). Sequences may be padded on either
side; positions count real tokens only, so padding never changes the real tokens' outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prlmfuse.errors import UserError
from prlmfuse.train_fused.blocks import (
    FeedForward,
    FlowMerge,
    MultiheadAttention,
    SinusoidalPositions,
    positions_from_mask,
    xavier_linear,
)
# The model's configuration lives in its own module, as Hugging Face's configuration_*.py files do.
from prlmfuse.train_fused.config import ModelConfig, PrLMSpec  # noqa: F401  (PrLMSpec re-exported beside the model)
from prlmfuse.train_fused.layer_selection import build_layer_selection


# ----------------------------------------------------------------------------- inputs and outputs


@dataclass
class PrLMFeatures:
    """Cached features of one PrLM for a batch, as the data loader hands them to the model."""

    states: Tensor  # [B, n_layers, M, d_p] float16/bfloat16/float32 (the model casts to its own dtype)
    mask: Tensor  # [B, M] bool, True = real token
    pooled: Tensor | None = None  # [B, n_pooled, 2, d_p]; [..., 0, :] first token, [..., 1, :] mean


@dataclass
class EncoderOut:
    """Everything the decoder reads from the source side, computed once per encode().

    The decoder's encoder-attention keys/values (and PrLM-attention keys/values on the target
    side) are projected here, so each decoding step only projects its own new token.
    """

    states: Tensor  # [B, S, d_model]
    mask: Tensor  # [B, S] bool, True = real position
    cross_kv: list[tuple[Tensor, Tensor]]  # per decoder layer: encoder-attention (k, v), [B, heads, S, head_dim]
    prlm_kv: list[list[tuple[Tensor, Tensor]]]  # per decoder layer, per PrLM: (k, v), [B, heads, M_j, head_dim]
    prlm_masks: list[Tensor]  # per PrLM: [B, M_j] bool (target side only; else empty)

    def index_select(self, idx: Tensor) -> "EncoderOut":
        """Rows `idx` of the batch, e.g. each sentence repeated beam times, or the unfinished ones."""

        def pick(t: Tensor) -> Tensor:
            return t.index_select(0, idx)

        return EncoderOut(
            states=pick(self.states),
            mask=pick(self.mask),
            cross_kv=[(pick(k), pick(v)) for k, v in self.cross_kv],
            prlm_kv=[[(pick(k), pick(v)) for k, v in layer] for layer in self.prlm_kv],
            prlm_masks=[pick(m) for m in self.prlm_masks],
        )


# ----------------------------------------------------------------------------- layers


class FusedLayer(nn.Module):
    """What encoder and decoder layers share: the FFN sublayer after the layer's main attention and,
    with PrLM branches, one PrLM flow per branch merged with the main flow at `position`.

    The main attention is the self-attention in the encoder and the encoder attention in the decoder
    (a bert-nmt decoder layer is position `attn`). The `merge_at_<position>` methods are the module
    docstring's equations: each takes H (`h`, the sublayer's input and so its residual), A_S (`a_s`) and
    A_1..A_k (`a_prlm`), the attention outputs after dropout, and returns H'. LN1 is the main
    attention's add&norm, passed in as `norm1`; LN2 is `final_layer_norm`. PrLM flow j has
    LN1_j = prlm_attn_layer_norm[j], FFN_j = prlm_ffn[j] and LN2_j = prlm_final_layer_norm[j].
    """

    def __init__(self, config: ModelConfig, position: str):
        super().__init__()
        self.pre_ln = config.pre_ln
        self.position = position
        self.dropout = nn.Dropout(config.dropout)

    def add_ffn_and_prlm_flows(self, config: ModelConfig, prlm_widths: list[int]) -> None:
        """The FFN sublayer, then per PrLM an attention and the add&norms and FFN its flow has at `position`.

        Subclasses call this after creating their attentions: creation order fixes the seeded init
        and the parameter order that saved optimizer states follow.
        """
        d, k = config.d_model, len(prlm_widths)
        self.ffn = FeedForward(d, config.ffn, config.activation, config.activation_dropout)
        self.final_layer_norm = nn.LayerNorm(d)
        self.num_prlms = k
        if not k:
            return
        self.prlm_attn = nn.ModuleList(MultiheadAttention(d, config.heads, config.attention_dropout, w) for w in prlm_widths)
        # Each module below exists only where the position's equations read it, so checkpoints hold no unused weights.
        if not self.pre_ln and self.position != "attn":
            self.prlm_attn_layer_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(k))
        if self.position in ("ffn", "add_norm2"):
            self.prlm_ffn = nn.ModuleList(
                FeedForward(d, config.ffn, config.activation, config.activation_dropout) for _ in range(k)
            )
            if self.pre_ln or self.position == "add_norm2":
                self.prlm_final_layer_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(k))
        self.merge = FlowMerge(config.merge, d, k, config.dropnet_p)

    def ffn_sublayer(self, x: Tensor) -> Tensor:
        """LN2(x + drop(FFN(x))); pre-LN: x + drop(FFN(LN2(x)))."""
        if self.pre_ln:
            return x + self.dropout(self.ffn(self.final_layer_norm(x)))
        return self.final_layer_norm(x + self.dropout(self.ffn(x)))

    def merge_flows(self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm) -> Tensor:
        """H' from the main attention's output a_s and the PrLM attentions' a_prlm, merged at `position`."""
        # Looked up per call: a bound method stored on the module would make a reference cycle, so a
        # deleted model's (GPU) memory would wait for the garbage collector.
        merge_at = {
            "attn": self.merge_at_attn,
            "add_norm1": self.merge_at_add_norm1,
            "ffn": self.merge_at_ffn,
            "add_norm2": self.merge_at_add_norm2,
        }[self.position]
        return merge_at(h, a_s, a_prlm, norm1)

    def merge_at_attn(self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm) -> Tensor:
        """Position `attn`:

            x = LN1(H + Merge(A_S, A_1..A_k));  H' = LN2(x + drop(FFN(x)))
            pre-LN:  x = H + Merge(A_S, A_1..A_k);  H' = x + drop(FFN(LN2(x)))
        """
        x = h + self.merge([a_s, *a_prlm])
        if not self.pre_ln:
            x = norm1(x)
        return self.ffn_sublayer(x)

    def merge_at_add_norm1(self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm) -> Tensor:
        """Position `add_norm1` (post-LN only; ModelConfig rejects it with pre_ln):

            x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)
            x = Merge(x_S, x_1..x_k);  H' = LN2(x + drop(FFN(x)))
        """
        x_s, x_prlm = self.first_add_norms(h, a_s, a_prlm, norm1)
        return self.ffn_sublayer(self.merge([x_s, *x_prlm]))

    def merge_at_ffn(self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm) -> Tensor:
        """Position `ffn` (the default):

            x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)
            F_S = drop(FFN(x_S));  F_j = drop(FFN_j(x_j))
            H' = LN2(x_S + Merge(F_S, F_1..F_k))
            pre-LN:  x_S = H + A_S;  x_j = H + A_j
                     H' = x_S + Merge(drop(FFN(LN2(x_S))), drop(FFN_j(LN2_j(x_j)))..)
        """
        if self.pre_ln:
            x_s, x_prlm = h + a_s, [h + a for a in a_prlm]
            f_s = self.dropout(self.ffn(self.final_layer_norm(x_s)))
            f_prlm = [self.dropout(ffn(norm(x))) for ffn, norm, x in zip(self.prlm_ffn, self.prlm_final_layer_norm, x_prlm)]
            return x_s + self.merge([f_s, *f_prlm])
        x_s, x_prlm = self.first_add_norms(h, a_s, a_prlm, norm1)
        f_s = self.dropout(self.ffn(x_s))
        f_prlm = [self.dropout(ffn(x)) for ffn, x in zip(self.prlm_ffn, x_prlm)]
        return self.final_layer_norm(x_s + self.merge([f_s, *f_prlm]))

    def merge_at_add_norm2(self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm) -> Tensor:
        """Position `add_norm2` (post-LN only; ModelConfig rejects it with pre_ln):

            x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)
            y_S = LN2(x_S + drop(FFN(x_S)));  y_j = LN2_j(x_j + drop(FFN_j(x_j)))
            H' = Merge(y_S, y_1..y_k)
        """
        x_s, x_prlm = self.first_add_norms(h, a_s, a_prlm, norm1)
        y_s = self.final_layer_norm(x_s + self.dropout(self.ffn(x_s)))
        y_prlm = [norm(x + self.dropout(ffn(x))) for ffn, norm, x in zip(self.prlm_ffn, self.prlm_final_layer_norm, x_prlm)]
        return self.merge([y_s, *y_prlm])

    def first_add_norms(
        self, h: Tensor, a_s: Tensor, a_prlm: list[Tensor], norm1: nn.LayerNorm
    ) -> tuple[Tensor, list[Tensor]]:
        """The post-LN first add&norms: x_S = LN1(H + A_S);  x_j = LN1_j(H + A_j)."""
        return norm1(h + a_s), [norm(h + a) for norm, a in zip(self.prlm_attn_layer_norm, a_prlm)]


class EncoderLayer(FusedLayer):
    """A Transformer encoder layer, with one PrLM branch per width in `prlm_widths` (see module docstring)."""

    def __init__(self, config: ModelConfig, prlm_widths: list[int]):
        super().__init__(config, position=config.position)
        self.self_attn = MultiheadAttention(config.d_model, config.heads, config.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.add_ffn_and_prlm_flows(config, prlm_widths)

    def forward(self, x: Tensor, mask: Tensor, prlm_states: list[tuple[Tensor, Tensor]]) -> Tensor:
        """x [B, S, d], mask [B, S]; prlm_states: per branch (Z_j [B, M_j, d_p], its mask [B, M_j])."""
        # Pre-LN: the self-attention and the PrLM attentions share the normalised query h = LN1(H).
        attn_in = self.self_attn_layer_norm(x) if self.pre_ln else x
        a_s = self.dropout(self.self_attn(attn_in, attn_in, mask))
        if not self.num_prlms:
            x = x + a_s
            return self.ffn_sublayer(x if self.pre_ln else self.self_attn_layer_norm(x))
        a_prlm = [self.dropout(attn(attn_in, z, z_mask)) for attn, (z, z_mask) in zip(self.prlm_attn, prlm_states)]
        return self.merge_flows(x, a_s, a_prlm, norm1=self.self_attn_layer_norm)


class DecoderLayer(FusedLayer):
    """Causal self-attention, encoder attention and FFN; PrLM attentions on the target side merge with the
    encoder attention (bert-nmt style) or, for a `*_flow` side, as flows of their own at `position`."""

    def __init__(self, config: ModelConfig, prlm_widths: list[int]):
        # bert-nmt style merges where the encoder attention's output is; a flow merges at `position`.
        super().__init__(config, position=config.position if config.decoder_flow else "attn")
        d = config.d_model
        self.self_attn = MultiheadAttention(d, config.heads, config.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MultiheadAttention(d, config.heads, config.attention_dropout)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.add_ffn_and_prlm_flows(config, prlm_widths)

    def forward(
        self, x: Tensor, enc: EncoderOut, layer_index: int, past_kv: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, d]: the newest T target positions; past_kv: self-attention (k, v) of earlier positions.

        Returns the layer output and the self-attention (k, v) of all positions so far.
        """
        # Causal self-attention over the cached positions plus the new ones.
        attn_in = self.self_attn_layer_norm(x) if self.pre_ln else x
        keys, values = self.self_attn.project_kv(attn_in)
        if past_kv is not None:
            keys = torch.cat([past_kv[0], keys], dim=2)
            values = torch.cat([past_kv[1], values], dim=2)
        x = x + self.dropout(self.self_attn.attend(attn_in, keys, values, causal=True))
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)

        # Encoder attention, and the PrLM attentions reading the same query, merged at self.position.
        attn_in = self.encoder_attn_layer_norm(x) if self.pre_ln else x
        enc_k, enc_v = enc.cross_kv[layer_index]
        a_enc = self.dropout(self.encoder_attn.attend(attn_in, enc_k, enc_v, enc.mask))
        if not self.num_prlms:
            x = x + a_enc
            return self.ffn_sublayer(x if self.pre_ln else self.encoder_attn_layer_norm(x)), (keys, values)
        a_prlm = [
            self.dropout(attn.attend(attn_in, k, v, m))
            for attn, (k, v), m in zip(self.prlm_attn, enc.prlm_kv[layer_index], enc.prlm_masks)
        ]
        return self.merge_flows(x, a_enc, a_prlm, norm1=self.encoder_attn_layer_norm), (keys, values)


# ----------------------------------------------------------------------------- the model


class FusedTransformer(nn.Module):
    """Transformer encoder-decoder with PrLM branches; `config.prlms == []` is the plain baseline."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        unshaped = [p.name for p in config.prlms if not p.shaped]
        if unshaped:
            raise ValueError(f"PrLM branch(es) {', '.join(unshaped)} have no feature shape; take each PrLMSpec "
                             "from its cache (train_fused.branches.open_branch)")
        self.config = config
        d = config.d_model
        widths = [p.width for p in config.prlms]
        # One matrix for source, target and output embeddings (joint BPE); fairseq's Embedding init.
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_id)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=d**-0.5)
        with torch.no_grad():
            self.embed_tokens.weight[config.pad_id].zero_()
        self.embed_scale = math.sqrt(d)
        self.embed_positions = SinusoidalPositions(d)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.prlm_layers = nn.ModuleList(build_layer_selection(p) for p in config.prlms)
        # Identity has no parameters: checkpoints of branches without the norm are unchanged.
        self.prlm_feature_norms = nn.ModuleList(
            nn.LayerNorm(p.width) if p.feature_norm else nn.Identity() for p in config.prlms
        )
        self.feature_dropout = nn.Dropout(config.feature_dropout)
        if config.merge == "direct":
            # Maps an input of another width to d_model, as fairseq's project_in_dim (its `Linear` helper).
            self.direct_proj = nn.ModuleList(xavier_linear(w, d) for w in widths)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(config, widths if config.encoder_prlms else []) for _ in range(config.enc_layers)
        )
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(config, widths if config.decoder_prlms else []) for _ in range(config.dec_layers)
        )
        if config.pre_ln:
            self.encoder_layer_norm = nn.LayerNorm(d)
            self.decoder_layer_norm = nn.LayerNorm(d)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- encoder

    def _check_features(self, prlm_features: list[PrLMFeatures] | None, batch: int) -> list[PrLMFeatures]:
        prlm_features = list(prlm_features or [])
        specs = self.config.prlms
        if len(prlm_features) != len(specs):
            raise UserError(
                f"model has {len(specs)} PrLM branch(es) ({', '.join(s.name for s in specs) or 'baseline'}) "
                f"but got features of {len(prlm_features)}; pass one PrLMFeatures per configured PrLM, in order"
            )
        dtype = self.embed_tokens.weight.dtype
        checked = []
        for spec, feats in zip(specs, prlm_features):
            states, mask = feats.states, feats.mask
            if states.dim() != 4 or states.shape[0] != batch or states.shape[1] != spec.num_layers or states.shape[3] != spec.width:
                raise UserError(
                    f"PrLM {spec.name!r}: features of shape {tuple(states.shape)}, expected "
                    f"[{batch}, {spec.num_layers}, M, {spec.width}]; the cache does not match the model's PrLMSpec"
                )
            if mask.shape != (batch, states.shape[2]):
                raise UserError(f"PrLM {spec.name!r}: mask of shape {tuple(mask.shape)}, expected {(batch, states.shape[2])}")
            pooled = feats.pooled
            if spec.layer_mode in ("dyn_cls", "dyn_aver"):
                if pooled is None or tuple(pooled.shape) != (batch, spec.num_pooled, 2, spec.width):
                    got = None if pooled is None else tuple(pooled.shape)
                    raise UserError(
                        f"PrLM {spec.name!r}: {spec.layer_mode} needs pooled features "
                        f"[{batch}, {spec.num_pooled}, 2, {spec.width}], got {got}; use a cache with pooled vectors"
                    )
                pooled = pooled.to(dtype)
            checked.append(PrLMFeatures(states.to(dtype), mask.to(torch.bool), pooled))
        return checked

    def encode(self, src_tokens: Tensor, prlm_features: list[PrLMFeatures] | None) -> EncoderOut:
        """Run the encoder over src_tokens [B, S] (or, for merge 'direct', over the PrLM features)."""
        config = self.config
        batch = src_tokens.shape[0]
        prlm_features = self._check_features(prlm_features, batch)
        # (Z_j [B, M_j, d_p], mask [B, M_j]) per PrLM, read by the key/value projections of every branch
        # attention; one feature-dropout mask per forward, as a PrLM run in train mode gives every layer one output.
        prlm_states = [(self.feature_dropout(norm(select(f))), f.mask)
                       for select, norm, f in zip(self.prlm_layers, self.prlm_feature_norms, prlm_features)]

        if config.merge == "direct":
            pieces = [proj(z) + self.embed_positions(positions_from_mask(m))
                      for proj, (z, m) in zip(self.direct_proj, prlm_states)]
            x = torch.cat(pieces, dim=1)
            mask = torch.cat([m for _, m in prlm_states], dim=1)
        else:
            mask = src_tokens != config.pad_id
            x = self.embed_scale * self.embed_tokens(src_tokens) + self.embed_positions(positions_from_mask(mask))
        x = self.embed_dropout(x)

        encoder_prlm_states = prlm_states if config.encoder_prlms else []
        for layer in self.encoder_layers:
            x = layer(x, mask, encoder_prlm_states)
        if config.pre_ln:
            x = self.encoder_layer_norm(x)

        cross_kv = [layer.encoder_attn.project_kv(x) for layer in self.decoder_layers]
        if config.decoder_prlms:
            prlm_kv = [[attn.project_kv(z) for attn, (z, _) in zip(layer.prlm_attn, prlm_states)]
                       for layer in self.decoder_layers]
            prlm_masks = [m for _, m in prlm_states]
        else:
            prlm_kv = [[] for _ in self.decoder_layers]
            prlm_masks = []
        return EncoderOut(states=x, mask=mask, cross_kv=cross_kv, prlm_kv=prlm_kv, prlm_masks=prlm_masks)

    # -- decoder

    def decode(
        self, prev_tokens: Tensor, enc: EncoderOut, cache: list | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Logits [B, T, V] for prev_tokens [B, T] and the grown self-attention cache.

        cache None: prev_tokens is the full prefix (starting with bos). With a cache (as returned
        by the previous call): prev_tokens are the newest token(s) only, placed after the cached
        positions, and only they are computed — each step costs O(t), not O(t^2).
        """
        states, new_cache = self.decoder_states(prev_tokens, enc, cache)
        return self.output_logits(states), new_cache

    def decoder_states(
        self, prev_tokens: Tensor, enc: EncoderOut, cache: list | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The decoder's last hidden states [B, T, d] (what `decode` projects to logits) and the cache."""
        past_len = 0 if cache is None else cache[0][0].shape[2]
        new_len = prev_tokens.shape[1]
        positions = torch.arange(past_len, past_len + new_len, device=prev_tokens.device)
        x = self.embed_scale * self.embed_tokens(prev_tokens) + self.embed_positions(positions)
        x = self.embed_dropout(x)
        new_cache = []
        for i, layer in enumerate(self.decoder_layers):
            x, layer_kv = layer(x, enc, i, None if cache is None else cache[i])
            new_cache.append(layer_kv)
        if self.config.pre_ln:
            x = self.decoder_layer_norm(x)
        return x, new_cache

    def output_logits(self, states: Tensor) -> Tensor:
        """Vocabulary logits of decoder states [..., d]: the output projection, tied to the embeddings."""
        return F.linear(states, self.embed_tokens.weight)

    @staticmethod
    def reorder_cache(cache: list[tuple[Tensor, Tensor]], idx: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The cache rows `idx` (beam reordering, dropping finished sentences)."""
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in cache]

    def forward(
        self, src_tokens: Tensor, tgt_in: Tensor, prlm_features: list[PrLMFeatures] | None, scored: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced logits [B, T, V]; tgt_in starts with bos and is padded on the right.

        scored [B, T] (True where the next token counts, i.e. not padding): logits [N, V] of those
        N positions only, in row-major order. Why: the tied output projection, its float32 cast and
        the loss are the widest tensors of a training step; padding rows are never computed.
        """
        states, _ = self.decoder_states(tgt_in, self.encode(src_tokens, prlm_features))
        if scored is not None:
            # index_select rather than states[scored]: its backward is an index_add, not an index_put
            # with accumulate, which is the slower of the two on CPU.
            states = states.flatten(0, 1).index_select(0, scored.flatten().nonzero().squeeze(1))
        return self.output_logits(states)
