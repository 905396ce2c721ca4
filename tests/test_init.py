"""The model starts from fairseq 0.12's transformer init: every parameter group's statistics.

fairseq: MultiheadAttention.reset_parameters gives q, k and v xavier-uniform with gain 1/sqrt(2)
when keys and values have the query's width (plain xavier otherwise) and leaves their biases at
nn.Linear's default; out_proj is xavier-uniform with a zero bias; the FFN's fc1 and fc2 keep
nn.Linear's default (kaiming-uniform, bound 1/sqrt(fan_in), bias within the same bound);
embeddings are N(0, d^-0.5) with the padding row zero; LayerNorms start at weight 1, bias 0.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from prlmfuse.train_fused.modeling import FusedTransformer, ModelConfig, PrLMSpec

VOCAB = 4000
PRLM_WIDTH = 384


def _models() -> dict[str, FusedTransformer]:
    torch.manual_seed(0)
    baseline = FusedTransformer(ModelConfig.from_preset("small", vocab_size=VOCAB))
    prlm = PrLMSpec(name="p", width=PRLM_WIDTH, num_layers=1, num_pooled=1)
    fused = FusedTransformer(ModelConfig.from_preset("small", vocab_size=VOCAB, prlms=[prlm], side="both"))
    return {"baseline": baseline, "fused": fused}


MODELS = _models()


def _groups(model: FusedTransformer) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Parameters by init rule; every parameter lands in exactly one group."""
    rules = [
        ("embedding", r"^embed_tokens\.weight$"),
        ("layer_norm_weight", r"layer_norm(\.\d+)?\.weight$"),
        ("layer_norm_bias", r"layer_norm(\.\d+)?\.bias$"),
        ("qkv_same_dim_weight", r"\.(self_attn|encoder_attn)\.[qkv]_proj\.weight$"),
        ("prlm_qkv_weight", r"\.prlm_attn\.\d+\.[qkv]_proj\.weight$"),
        ("qkv_bias", r"_attn(\.\d+)?\.[qkv]_proj\.bias$"),
        ("out_proj_weight", r"_attn(\.\d+)?\.out_proj\.weight$"),
        ("out_proj_bias", r"_attn(\.\d+)?\.out_proj\.bias$"),
        ("ffn_weight", r"ffn(\.\d+)?\.fc[12]\.weight$"),
        ("ffn_bias", r"ffn(\.\d+)?\.fc[12]\.bias$"),
    ]
    groups: dict[str, list] = {name: [] for name, _ in rules}
    for name, param in model.named_parameters():
        matched = [group for group, pattern in rules if re.search(pattern, name)]
        assert len(matched) == 1, f"{name}: matched {matched}; give it an init rule here"
        groups[matched[0]].append((name, param.detach()))
    return groups


def _xavier_bound(weight: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = weight.shape
    return gain * math.sqrt(6.0 / (fan_in + fan_out))


def _assert_uniform(values: torch.Tensor, bound: float, what: str) -> None:
    """values look like U(-bound, bound): within the bound, reaching near it, std bound/sqrt(3)."""
    values = values.flatten().float()
    assert values.abs().max() <= bound * (1 + 1e-6), f"{what}: max {values.abs().max():.4g} above bound {bound:.4g}"
    assert values.abs().max() >= 0.9 * bound, f"{what}: max {values.abs().max():.4g} far below bound {bound:.4g}"
    # 3 standard errors of a uniform sample's std, plus a little
    tolerance = 3 * math.sqrt(0.8 / values.numel()) / 2 + 0.01
    expected = bound / math.sqrt(3)
    assert abs(values.std().item() / expected - 1) < tolerance, f"{what}: std {values.std():.4g}, expected {expected:.4g}"
    assert abs(values.mean().item()) < 3 * expected / math.sqrt(values.numel()) + 1e-6, f"{what}: mean {values.mean():.4g}"


@pytest.mark.parametrize("kind", list(MODELS))
def test_attention_projections_follow_fairseqs_reset_parameters(kind):
    groups = _groups(MODELS[kind])
    for name, w in groups["qkv_same_dim_weight"]:
        _assert_uniform(w, _xavier_bound(w, 1 / math.sqrt(2)), name)
    for name, w in groups["out_proj_weight"]:
        _assert_uniform(w, _xavier_bound(w, 1.0), name)
    for name, b in groups["out_proj_bias"]:
        assert torch.count_nonzero(b) == 0, name
    # q, k, v biases keep nn.Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)); pooled by fan_in.
    params = dict(MODELS[kind].named_parameters())
    by_fan_in: dict[int, list[torch.Tensor]] = {}
    for name, b in groups["qkv_bias"]:
        fan_in = params[name.removesuffix("bias") + "weight"].shape[1]
        by_fan_in.setdefault(fan_in, []).append(b)
    assert by_fan_in
    for fan_in, biases in by_fan_in.items():
        _assert_uniform(torch.cat(biases), 1 / math.sqrt(fan_in), f"q/k/v biases, fan_in {fan_in}")


def test_prlm_branch_attentions_get_plain_xavier():
    """Keys of the PrLM's width (not d_model): fairseq's qkv_same_dim is false, gain 1."""
    groups = _groups(MODELS["fused"])
    names = [n for n, _ in groups["prlm_qkv_weight"]]
    # every encoder and decoder layer has one PrLM attention (side both)
    assert len(names) == 3 * (3 + 3)
    assert any(".k_proj." in n for n in names) and any(".q_proj." in n for n in names)
    for name, w in groups["prlm_qkv_weight"]:
        if not name.endswith("q_proj.weight"):
            assert w.shape[1] == PRLM_WIDTH, name
        _assert_uniform(w, _xavier_bound(w, 1.0), name)
    assert not _groups(MODELS["baseline"])["prlm_qkv_weight"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_ffn_linears_keep_torchs_default(kind):
    groups = _groups(MODELS[kind])
    assert groups["ffn_weight"]
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for name, w in groups["ffn_weight"]:
        _assert_uniform(w, 1 / math.sqrt(w.shape[1]), name)
        by_shape.setdefault(tuple(w.shape), []).append(w)
    params = dict(MODELS[kind].named_parameters())
    by_fan_in: dict[int, list[torch.Tensor]] = {}
    for name, b in groups["ffn_bias"]:
        by_fan_in.setdefault(params[name.removesuffix("bias") + "weight"].shape[1], []).append(b)
    for fan_in, biases in by_fan_in.items():
        _assert_uniform(torch.cat(biases), 1 / math.sqrt(fan_in), f"FFN biases, fan_in {fan_in}")


@pytest.mark.parametrize("kind", list(MODELS))
def test_embeddings_and_layer_norms(kind):
    model = MODELS[kind]
    groups = _groups(model)
    (_, emb), = groups["embedding"]
    d = model.config.d_model
    assert torch.count_nonzero(emb[model.config.pad_id]) == 0
    rows = torch.cat([emb[: model.config.pad_id], emb[model.config.pad_id + 1 :]])
    assert abs(rows.std().item() / d**-0.5 - 1) < 0.01
    assert abs(rows.mean().item()) < 3 * d**-0.5 / math.sqrt(rows.numel())
    # normal, not uniform: about 0.3% of the draws lie beyond 3 standard deviations
    assert 0.001 < (rows.abs() > 3 * d**-0.5).float().mean().item() < 0.006
    assert groups["layer_norm_weight"] and groups["layer_norm_bias"]
    assert all(torch.all(w == 1) for _, w in groups["layer_norm_weight"])
    assert all(torch.all(b == 0) for _, b in groups["layer_norm_bias"])


@pytest.mark.parametrize(
    "overrides, attribute",
    [
        (dict(merge="gate"), "encoder_layers.0.merge.gate_proj"),
        (dict(merge="direct"), "direct_proj.0"),
        (dict(layer_mode="concat", num_layers=3), "prlm_layers.0.proj"),
        (dict(layer_mode="dwatt", num_layers=3), "prlm_layers.0.query_down"),
    ],
)
def test_projections_without_a_fairseq_counterpart_get_its_linear_helper_init(overrides, attribute):
    """Gate, direct input projection and layer selection: xavier-uniform, zero bias (fairseq's `Linear`)."""
    spec_keys = {"layer_mode", "num_layers"}
    spec = dict(name="p", width=PRLM_WIDTH, num_layers=1, num_pooled=3)
    spec.update({k: v for k, v in overrides.items() if k in spec_keys})
    config = dict(prlms=[PrLMSpec(**spec)], **{k: v for k, v in overrides.items() if k not in spec_keys})
    torch.manual_seed(0)
    model = FusedTransformer(ModelConfig.from_preset("small", vocab_size=VOCAB, **config))
    linear = model.get_submodule(attribute)
    _assert_uniform(linear.weight, _xavier_bound(linear.weight, 1.0), attribute)
    assert linear.bias is None or torch.count_nonzero(linear.bias) == 0


def test_dynamic_layer_scorer_keeps_torchs_default_as_the_authors_fork():
    """Dyn[CLS]/Dyn[Aver]: the fork's plain nn.Linear(L * d_p, L), bound 1/sqrt(fan_in) for weight and bias."""
    spec = PrLMSpec(name="p", width=PRLM_WIDTH, num_layers=6, num_pooled=6, layer_mode="dyn_cls")
    torch.manual_seed(0)
    score = FusedTransformer(ModelConfig.from_preset("small", vocab_size=VOCAB, prlms=[spec])).prlm_layers[0].score
    assert score.weight.shape == (6, 6 * PRLM_WIDTH)
    _assert_uniform(score.weight, 1 / math.sqrt(6 * PRLM_WIDTH), "score.weight")
    assert score.bias.abs().max() <= 1 / math.sqrt(6 * PRLM_WIDTH)
