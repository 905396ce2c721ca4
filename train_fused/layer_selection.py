"""PrLM layer selection: how a branch combines the layers its cache holds into the one sequence it attends to.

Layer selection (`PrLMSpec.layer_mode`) turns the cached states [B, n, M, d_p] into Z [B, M, d_p]
in the PrLM's own width, before the branch's key/value projections:

    fixed:     n must be 1; Z = states[:, 0]
    dyn_cls / dyn_aver (Park & Zhao, Table 3a, scored as the authors' fairseq fork does): over the
               transformer layers 1..L only (never the embedding layer), per sentence,
               s = W [p_1; ..; p_L] + c  (one Linear from the L concatenated sentence vectors to L
               logits), p_n the first-token (dyn_cls) or mean (dyn_aver) vector of layer n from
               `pooled`;  alpha = softmax(s);  Z = sum_n alpha_n states_n
    dwatt      (ElNokrashy et al. 2022, eqs. 3-10): per token,
               k_n = W_K kpos_n (kpos_n ~ U(0,1), fixed, 24 dims);  v_n = LN_n(f_V,n(z_n));
               q = 1 + elu(z_L + f_Q(z_L)), z_L the last cached layer;  f(z) = W LN(gelu(U z))
               with a bottleneck of d_p/2;  Z = z_L + sum_n softmax_n(q . k_n) v_n
               (unscaled dot product, as in the paper's eq. 7)
    concat:    Z = sum_n W_n z_n + b (one Linear over the concatenated layers)

DWAtt and Concat read every cached layer, the embedding layer included (unmeasured whether dropping it helps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prlmfuse.train_fused.blocks import xavier_linear
from prlmfuse.train_fused.config import PrLMSpec

if TYPE_CHECKING:
    from prlmfuse.train_fused.modeling import PrLMFeatures

# DWAtt hyper-parameters from ElNokrashy et al. (2022), Table 4.
DWATT_BOTTLENECK = 0.5
DWATT_KEY_POS_DIM = 24


class FixedLayer(nn.Module):
    """The cache holds exactly the wanted layer."""

    def __init__(self, spec: PrLMSpec):
        super().__init__()

    def forward(self, features: PrLMFeatures) -> Tensor:
        return features.states[:, 0]


class DynamicLayerWeights(nn.Module):
    """Dyn[CLS] / Dyn[Aver]: a per-sentence softmax over layers scored from all layers' sentence vectors."""

    def __init__(self, spec: PrLMSpec):
        super().__init__()
        self.pooled_row = 0 if spec.layer_mode == "dyn_cls" else 1
        self.register_buffer("pooled_index", torch.tensor(spec.pooled_index, dtype=torch.long), persistent=False)
        # The authors' fork scores with a plain nn.Linear (torch's default init) over the concatenation.
        self.score = nn.Linear(spec.num_layers * spec.width, spec.num_layers)

    def layer_weights(self, pooled: Tensor) -> Tensor:
        """alpha [B, n_layers] from pooled [B, n_pooled, 2, d]."""
        sentence_vectors = pooled.index_select(1, self.pooled_index)[:, :, self.pooled_row]
        return torch.softmax(self.score(sentence_vectors.flatten(1)).float(), dim=-1)

    def forward(self, features: PrLMFeatures) -> Tensor:
        alpha = self.layer_weights(features.pooled).to(features.states.dtype)
        return torch.einsum("bn,bnmd->bmd", alpha, features.states)


class DepthWiseAttention(nn.Module):
    """DWAtt (ElNokrashy et al. 2022): per-token attention over layers, query from the last layer."""

    def __init__(self, spec: PrLMSpec):
        super().__init__()
        n, d = spec.num_layers, spec.width
        hidden = max(1, int(d * DWATT_BOTTLENECK))
        # kpos_n ~ U(0, 1) are fixed, not learned (paper section 9.2); persistent so a checkpoint
        # reproduces the same keys.
        self.register_buffer("key_positions", torch.rand(n, DWATT_KEY_POS_DIM))
        # The paper gives no init; its Linears get fairseq's `Linear` helper init, as the stacked
        # per-layer weights below do.
        self.key_proj = xavier_linear(DWATT_KEY_POS_DIM, d)
        # f_Q(z) = W LN(gelu(U z))
        self.query_down = xavier_linear(d, hidden)
        self.query_norm = nn.LayerNorm(hidden)
        self.query_up = xavier_linear(hidden, d)
        # f_V,n: one bottleneck MLP and one output LN per layer, nothing shared; stacked over n.
        self.value_down_weight = nn.Parameter(torch.empty(n, hidden, d))
        self.value_down_bias = nn.Parameter(torch.zeros(n, hidden))
        self.value_mid_norm_weight = nn.Parameter(torch.ones(n, hidden))
        self.value_mid_norm_bias = nn.Parameter(torch.zeros(n, hidden))
        self.value_up_weight = nn.Parameter(torch.empty(n, d, hidden))
        self.value_up_bias = nn.Parameter(torch.zeros(n, d))
        self.value_norm_weight = nn.Parameter(torch.ones(n, d))
        self.value_norm_bias = nn.Parameter(torch.zeros(n, d))
        for i in range(n):
            nn.init.xavier_uniform_(self.value_down_weight.data[i])
            nn.init.xavier_uniform_(self.value_up_weight.data[i])

    @staticmethod
    def _per_layer_norm(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        # x [B, n, M, h]; weight/bias [n, h]
        x = F.layer_norm(x, x.shape[-1:])
        return x * weight[None, :, None, :] + bias[None, :, None, :]

    def forward(self, features: PrLMFeatures) -> Tensor:
        z = features.states  # [B, n, M, d]
        z_last = z[:, -1]
        query = 1.0 + F.elu(z_last + self.query_up(self.query_norm(F.gelu(self.query_down(z_last)))))
        keys = self.key_proj(self.key_positions)  # [n, d]
        hidden = torch.einsum("bnmd,nhd->bnmh", z, self.value_down_weight) + self.value_down_bias[None, :, None, :]
        hidden = self._per_layer_norm(F.gelu(hidden), self.value_mid_norm_weight, self.value_mid_norm_bias)
        values = torch.einsum("bnmh,ndh->bnmd", hidden, self.value_up_weight) + self.value_up_bias[None, :, None, :]
        values = self._per_layer_norm(values, self.value_norm_weight, self.value_norm_bias)
        scores = torch.softmax((query @ keys.transpose(0, 1)).float(), dim=-1).to(values.dtype)  # [B, M, n]
        return z_last + torch.einsum("bmn,bnmd->bmd", scores, values)


class LayerConcat(nn.Module):
    """Concat (ElNokrashy et al. 2022): sum_n W_n z_n, i.e. one Linear over the concatenated layers."""

    def __init__(self, spec: PrLMSpec):
        super().__init__()
        # A learned projection with no fairseq counterpart: fairseq's `Linear` helper init.
        self.proj = xavier_linear(spec.num_layers * spec.width, spec.width)

    def forward(self, features: PrLMFeatures) -> Tensor:
        z = features.states  # [B, n, M, d]
        return self.proj(z.permute(0, 2, 1, 3).flatten(2))


def build_layer_selection(spec: PrLMSpec) -> nn.Module:
    return {
        "fixed": FixedLayer,
        "dyn_cls": DynamicLayerWeights,
        "dyn_aver": DynamicLayerWeights,
        "dwatt": DepthWiseAttention,
        "concat": LayerConcat,
    }[spec.layer_mode](spec)
