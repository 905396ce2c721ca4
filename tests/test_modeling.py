"""The fused Transformer: every fusion variant trains, padding is invisible, incremental decoding is exact."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from prlmfuse.errors import UserError
from prlmfuse.train_fused.blocks import FlowMerge
from prlmfuse.train_fused.config import LAYER_MODES, PRESETS, SIDES, ModelConfig, PrLMSpec
from prlmfuse.train_fused.modeling import DecoderLayer, EncoderLayer, EncoderOut, FusedTransformer, PrLMFeatures
from prlmfuse.train_fused.update_step import label_smoothed_sums

torch.set_num_threads(1)

VOCAB = 40
PAD, BOS, EOS = 0, 1, 2


def spec(name: str, width: int, mode: str = "fixed", num_layers: int | None = None) -> PrLMSpec:
    n = 1 if mode == "fixed" else (num_layers or 3)
    return PrLMSpec(name=name, width=width, num_layers=n, num_pooled=n, layer_mode=mode)


def tiny_config(prlms=(), **overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", vocab_size=VOCAB, prlms=list(prlms), **overrides)


def make_tokens(lengths: list[int], generator: torch.Generator, bos: bool = False) -> torch.Tensor:
    """Right-padded random token rows of the given real lengths (ids 4.. are ordinary tokens)."""
    out = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randint(4, VOCAB, (n,), generator=generator)
        if bos:
            out[i, 0] = BOS
    return out


def make_features(specs: list[PrLMSpec], lengths: list[int], generator: torch.Generator) -> list[PrLMFeatures]:
    """Random features with right padding; padded positions hold garbage the model must ignore."""
    feats = []
    for s in specs:
        batch, m = len(lengths), max(lengths)
        states = torch.randn(batch, s.num_layers, m, s.width, generator=generator)
        mask = torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]
        pooled = torch.randn(batch, s.num_pooled, 2, s.width, generator=generator)
        feats.append(PrLMFeatures(states=states, mask=mask, pooled=pooled))
    return feats


def pad_features(feats: list[PrLMFeatures], extra: int, generator: torch.Generator) -> list[PrLMFeatures]:
    out = []
    for f in feats:
        b, n, _, d = f.states.shape
        garbage = 100 * torch.randn(b, n, extra, d, generator=generator)
        out.append(
            PrLMFeatures(
                states=torch.cat([f.states, garbage], dim=2),
                mask=torch.cat([f.mask, torch.zeros(b, extra, dtype=torch.bool)], dim=1),
                pooled=f.pooled,
            )
        )
    return out


def batch_for(config: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = make_tokens([6, 4, 5], g)
    tgt = make_tokens([5, 3, 4], g)
    tgt_in = torch.cat([torch.full((3, 1), BOS), tgt[:, :-1]], dim=1)
    tgt_in[tgt_in == PAD] = PAD
    feats = make_features(config.prlms, [7, 5, 3], g)
    return src, tgt_in, tgt, feats


def train_step_is_finite(config: ModelConfig) -> FusedTransformer:
    torch.manual_seed(0)
    model = FusedTransformer(config).train()
    src, tgt_in, tgt, feats = batch_for(config)
    logits = model(src, tgt_in, feats)
    assert logits.shape == (3, tgt_in.shape[1], VOCAB)
    loss, _ = label_smoothed_sums(logits, tgt, 0.1)
    assert int((tgt != PAD).sum()) == 12
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    return model


ONE_PRLM = [spec("bert", 48)]
TWO_PRLMS = [spec("bert", 48), spec("gpt", 24)]


@pytest.mark.parametrize("prlms", [ONE_PRLM, TWO_PRLMS], ids=["1prlm", "2prlms"])
@pytest.mark.parametrize(
    "merge,position,side",
    list(itertools.product(["sum", "average", "gate", "dropnet"], ["attn", "add_norm1", "ffn", "add_norm2"], SIDES)),
)
def test_every_merge_position_side_trains(merge, position, side, prlms):
    config = tiny_config(prlms, merge=merge, position=position, side=side)
    model = train_step_is_finite(config)
    # The PrLM branches are really in the graph: their key projections get gradient.
    k_proj_grads = [
        p.grad for name, p in model.named_parameters() if ".prlm_attn." in name and name.endswith("k_proj.weight")
    ]
    assert len(k_proj_grads) == len(prlms) * (
        config.enc_layers * (side in ("source", "both", "both_flow")) + config.dec_layers * (side != "source")
    )
    if merge != "dropnet":  # dropnet may draw "source flow only" for a layer, leaving its branch without gradient
        assert all(g is not None and g.abs().sum() > 0 for g in k_proj_grads)


@pytest.mark.parametrize("prlms", [ONE_PRLM, TWO_PRLMS], ids=["1prlm", "2prlms"])
@pytest.mark.parametrize("merge", ["sum", "average", "gate", "dropnet"])
@pytest.mark.parametrize("position", ["attn", "ffn"])
@pytest.mark.parametrize("side", ["source", "both"])
def test_pre_ln_variants_train(merge, position, side, prlms):
    train_step_is_finite(tiny_config(prlms, merge=merge, position=position, side=side, pre_ln=True))


@pytest.mark.parametrize("position", ["add_norm1", "add_norm2"])
def test_pre_ln_rejects_add_norm_positions(position):
    with pytest.raises(UserError, match="pre-LN"):
        tiny_config(ONE_PRLM, position=position, pre_ln=True)
    # Without an encoder branch the position is irrelevant and accepted, unless the decoder's flows merge there.
    tiny_config(ONE_PRLM, position=position, pre_ln=True, side="target")
    with pytest.raises(UserError, match="pre-LN"):
        tiny_config(ONE_PRLM, position=position, pre_ln=True, side="target_flow")


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("merge", ["sum", "direct"])
def test_every_layer_mode_trains(mode, merge):
    prlms = [spec("bert", 48, mode, num_layers=4), spec("gpt", 24, mode, num_layers=2)]
    model = train_step_is_finite(tiny_config(prlms, merge=merge))
    selection_grads = [p.grad for name, p in model.named_parameters() if name.startswith("prlm_layers.")]
    if mode == "fixed":
        assert selection_grads == []
    else:
        assert selection_grads and all(g is not None and torch.isfinite(g).all() for g in selection_grads)


def test_baseline_trains_and_has_fewer_parameters():
    baseline = train_step_is_finite(tiny_config())
    fused = FusedTransformer(tiny_config(ONE_PRLM))
    assert baseline.num_parameters() < fused.num_parameters()
    assert not any("prlm" in name for name in baseline.state_dict())


def test_forward_backward_under_bf16_autocast():
    config = tiny_config(TWO_PRLMS, side="both", merge="gate")
    torch.manual_seed(0)
    model = FusedTransformer(config)
    src, tgt_in, tgt, feats = batch_for(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt_in, feats)
        loss, _ = label_smoothed_sums(logits, tgt, 0.1)
    loss.backward()
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(loss)
    assert torch.isfinite(model.embed_tokens.weight.grad).all()


PADDING_CONFIGS = {
    "sum-ffn": dict(prlms=TWO_PRLMS),
    "gate-attn-both": dict(prlms=TWO_PRLMS, merge="gate", position="attn", side="both"),
    "add_norm2-target": dict(prlms=ONE_PRLM, position="add_norm2", side="target"),
    "ffn-target_flow": dict(prlms=TWO_PRLMS, position="ffn", side="target_flow"),
    "add_norm1-both_flow": dict(prlms=ONE_PRLM, position="add_norm1", side="both_flow"),
    "ffn-both_flow-preln": dict(prlms=ONE_PRLM, position="ffn", side="both_flow", pre_ln=True),
    "dwatt-preln": dict(prlms=[spec("a", 32, "dwatt")], pre_ln=True, side="both"),
    "dyn-concat": dict(prlms=[spec("a", 32, "dyn_aver"), spec("b", 16, "concat")], merge="average"),
    "direct-2prlms": dict(prlms=TWO_PRLMS, merge="direct"),
    "baseline": dict(),
}


@pytest.mark.parametrize("name", list(PADDING_CONFIGS))
def test_padding_does_not_change_outputs(name):
    config = tiny_config(**PADDING_CONFIGS[name])
    torch.manual_seed(0)
    model = FusedTransformer(config).eval()
    g = torch.Generator().manual_seed(1)
    src, tgt_in, _, feats = batch_for(config)
    with torch.no_grad():
        reference = model(src, tgt_in, feats)
        right_padded = torch.cat([src, torch.full((3, 4), PAD)], dim=1)
        out = model(right_padded, tgt_in, pad_features(feats, 5, g))
        assert torch.allclose(out, reference, atol=1e-5)
        # Left padding of the source too: positions count real tokens only.
        lengths = (src != PAD).sum(1)
        left_padded = torch.full_like(right_padded, PAD)
        for i, n in enumerate(lengths.tolist()):
            left_padded[i, right_padded.shape[1] - n :] = src[i, :n]
        out = model(left_padded, tgt_in, feats)
        assert torch.allclose(out, reference, atol=1e-5)
        # Each sentence alone (no padding at all) gives its row of the batch.
        for i in range(3):
            n_src, n_tgt = int(lengths[i]), int((tgt_in[i] != PAD).sum())
            alone_feats = [
                PrLMFeatures(
                    f.states[i : i + 1, :, : int(f.mask[i].sum())],
                    f.mask[i : i + 1, : int(f.mask[i].sum())],
                    f.pooled[i : i + 1],
                )
                for f in feats
            ]
            alone = model(src[i : i + 1, :n_src], tgt_in[i : i + 1, :n_tgt], alone_feats)
            assert torch.allclose(alone[0], reference[i, :n_tgt], atol=1e-5)


@pytest.mark.parametrize("name", ["sum-ffn", "gate-attn-both", "dwatt-preln", "ffn-target_flow",
                                  "add_norm1-both_flow", "ffn-both_flow-preln", "baseline"])
def test_incremental_decoding_equals_full_prefix(name):
    config = tiny_config(**PADDING_CONFIGS[name])
    torch.manual_seed(0)
    model = FusedTransformer(config).eval()
    g = torch.Generator().manual_seed(2)
    src, _, _, feats = batch_for(config)
    prefix = make_tokens([7, 7, 7], g, bos=True)
    with torch.no_grad():
        enc = model.encode(src, feats)
        full, _ = model.decode(prefix, enc)
        cache = None
        for t in range(prefix.shape[1]):
            step, cache = model.decode(prefix[:, t : t + 1], enc, cache)
            assert step.shape == (3, 1, VOCAB)
            assert torch.allclose(step[:, 0], full[:, t], atol=1e-5)
        assert cache[0][0].shape[2] == prefix.shape[1]
        # A cache built from a prefix can be continued by several tokens at once.
        _, cache = model.decode(prefix[:, :3], enc)
        chunk, _ = model.decode(prefix[:, 3:], enc, cache)
        assert torch.allclose(chunk, full[:, 3:], atol=1e-5)


def test_beam_reordering_of_encoder_out_and_cache():
    config = tiny_config(TWO_PRLMS, side="both")
    torch.manual_seed(0)
    model = FusedTransformer(config).eval()
    g = torch.Generator().manual_seed(3)
    src, _, _, feats = batch_for(config)
    prefix = make_tokens([5, 5, 5], g, bos=True)
    idx = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        enc = model.encode(src, feats)
        full, _ = model.decode(prefix, enc)
        _, cache = model.decode(prefix[:, :4], enc)
        step, _ = model.decode(prefix[idx, 4:], enc.index_select(idx), model.reorder_cache(cache, idx))
    assert torch.allclose(step[:, 0], full[idx, 4], atol=1e-5)


def test_dropnet_in_eval_is_average():
    torch.manual_seed(0)
    dropnet = FusedTransformer(tiny_config(TWO_PRLMS, merge="dropnet", side="both"))
    average = FusedTransformer(tiny_config(TWO_PRLMS, merge="average", side="both"))
    average.load_state_dict(dropnet.state_dict())
    src, tgt_in, _, feats = batch_for(dropnet.config)
    with torch.no_grad():
        a = dropnet.eval()(src, tgt_in, feats)
        b = average.eval()(src, tgt_in, feats)
    assert torch.equal(a, b)


def test_dropnet_training_draws_source_only_prlm_only_or_average():
    merge = FlowMerge("dropnet", d_model=4, num_prlms=2, dropnet_p=1.0).train()
    a, b1, b2 = torch.full((1, 4), 1.0), torch.full((1, 4), 3.0), torch.full((1, 4), 5.0)
    torch.manual_seed(0)
    seen = {float(merge([a, b1, b2])[0, 0]) for _ in range(200)}
    assert seen == {1.0, 4.0}  # p = 1: never the 3-way average
    merge.dropnet_p = 0.5
    seen = {float(merge([a, b1, b2])[0, 0]) for _ in range(200)}
    assert seen == {1.0, 4.0, 3.0}
    merge.eval()
    assert float(merge([a, b1, b2])[0, 0]) == 3.0


def test_gate_with_one_prlm_is_a_sigmoid_gate():
    torch.manual_seed(0)
    merge = FlowMerge("gate", d_model=8, num_prlms=1, dropnet_p=0.0)
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    logits = merge.gate_proj(torch.cat([a, b], dim=-1))
    g = torch.sigmoid(-logits)
    assert torch.allclose(merge([a, b]), g * a + (1 - g) * b, atol=1e-6)


def test_ffn_position_matches_the_papers_equation():
    """Post-LN, position ffn, sum: H' = LN2(x_S + FFN(x_S) + FFN_P(x_P)), x_* = LN1*(H + Attn_*)."""
    config = tiny_config([spec("p", 24)], dropout=0.0, position="ffn")
    torch.manual_seed(0)
    layer = EncoderLayer(config, [24]).eval()
    for p in layer.parameters():  # LayerNorm weights away from 1/0, so each norm is really tested
        torch.nn.init.normal_(p, std=0.3)
    h = torch.randn(2, 5, config.d_model)
    mask = torch.ones(2, 5, dtype=torch.bool)
    z = torch.randn(2, 7, 24)
    z_mask = torch.ones(2, 7, dtype=torch.bool)
    x_s = layer.self_attn_layer_norm(h + layer.self_attn(h, h, mask))
    x_p = layer.prlm_attn_layer_norm[0](h + layer.prlm_attn[0](h, z, z_mask))
    expected = layer.final_layer_norm(x_s + layer.ffn(x_s) + layer.prlm_ffn[0](x_p))
    assert torch.allclose(layer(h, mask, [(z, z_mask)]), expected, atol=1e-5)


def _decoder_layer_with_prlm(side: str, position: str) -> tuple[DecoderLayer, ModelConfig]:
    config = tiny_config([spec("p", 24)], dropout=0.0, side=side, position=position)
    torch.manual_seed(0)
    layer = DecoderLayer(config, [24]).eval()
    for p in layer.parameters():  # LayerNorm weights away from 1/0, so each norm is really tested
        torch.nn.init.normal_(p, std=0.3)
    return layer, config


def _run_decoder_layer(layer: DecoderLayer, x, enc_states, z):
    enc_mask = torch.ones(enc_states.shape[:2], dtype=torch.bool)
    z_mask = torch.ones(z.shape[:2], dtype=torch.bool)
    enc = EncoderOut(states=enc_states, mask=enc_mask, cross_kv=[layer.encoder_attn.project_kv(enc_states)],
                     prlm_kv=[[layer.prlm_attn[0].project_kv(z)]], prlm_masks=[z_mask])
    out, _ = layer(x, enc, 0, None)
    return out


def test_target_flow_follows_the_authors_decoder():
    """side target_flow, position ffn (the authors' fork): the PrLM attention reads the encoder attention's
    query x1 and has its own add&norm and FFN; the two FFN outputs are summed before the last add&norm."""
    layer, config = _decoder_layer_with_prlm("target_flow", "ffn")
    g = torch.Generator().manual_seed(5)
    x, enc_states, z = torch.randn(2, 4, config.d_model, generator=g), torch.randn(2, 6, config.d_model, generator=g), torch.randn(2, 7, 24, generator=g)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    with torch.no_grad():
        q, k, v = x, *layer.self_attn.project_kv(x)
        scores = (layer.self_attn._split_heads(layer.self_attn.q_proj(q)) @ k.transpose(-2, -1)) / (k.shape[-1] ** 0.5)
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        self_attn = layer.self_attn.out_proj((weights @ v).transpose(1, 2).reshape(2, 4, config.d_model))
        x1 = layer.self_attn_layer_norm(x + self_attn)
        x_e = layer.encoder_attn_layer_norm(x1 + layer.encoder_attn(x1, enc_states))
        x_p = layer.prlm_attn_layer_norm[0](x1 + layer.prlm_attn[0](x1, z))
        expected = layer.final_layer_norm(x_e + layer.ffn(x_e) + layer.prlm_ffn[0](x_p))
        assert torch.allclose(_run_decoder_layer(layer, x, enc_states, z), expected, atol=1e-5)
    # bert-nmt's target side has no PrLM add&norm or FFN of its own.
    plain, _ = _decoder_layer_with_prlm("target", "ffn")
    assert not any(n.startswith(("prlm_ffn", "prlm_attn_layer_norm")) for n, _ in plain.named_parameters())


def test_target_flow_at_attn_is_bert_nmts_target_side():
    """Merged where the encoder attention's output is, the authors' flow and bert-nmt's target side coincide."""
    flow, config = _decoder_layer_with_prlm("target_flow", "attn")
    plain, _ = _decoder_layer_with_prlm("target", "ffn")
    assert flow.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(flow.state_dict())
    g = torch.Generator().manual_seed(6)
    x, enc_states, z = torch.randn(2, 4, config.d_model, generator=g), torch.randn(2, 6, config.d_model, generator=g), torch.randn(2, 7, 24, generator=g)
    with torch.no_grad():
        assert torch.allclose(_run_decoder_layer(flow, x, enc_states, z), _run_decoder_layer(plain, x, enc_states, z), atol=1e-6)


def test_direct_ignores_source_tokens():
    config = tiny_config(TWO_PRLMS, merge="direct")
    torch.manual_seed(0)
    model = FusedTransformer(config).eval()
    src, tgt_in, _, feats = batch_for(config)
    other_src = make_tokens([9, 2, 1], torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = model(src, tgt_in, feats)
        b = model(other_src, tgt_in, feats)
        enc = model.encode(other_src, feats)
    assert torch.equal(a, b)
    assert torch.equal(enc.mask, torch.cat([f.mask for f in feats], dim=1))
    assert not any(".prlm_attn." in name for name in model.state_dict())


@pytest.mark.parametrize("side", ["source", "target"])
def test_feature_norm_makes_the_branch_blind_to_the_features_scale(side):
    """A causal LM's residual stream can be a thousand times a BERT's: with feature_norm the model
    reads it as if it were normalized; without, the scale changes everything."""
    scaled = lambda feats, c: [PrLMFeatures(f.states * c + 3.0 * c, f.mask, f.pooled) for f in feats]  # noqa: E731
    for norm in (True, False):
        prlms = [dataclasses.replace(s, feature_norm=norm) for s in TWO_PRLMS]
        config = tiny_config(prlms, side=side)
        torch.manual_seed(0)
        model = FusedTransformer(config).eval()
        src, tgt_in, _, feats = batch_for(config)
        with torch.no_grad():
            a, b = model(src, tgt_in, feats), model(src, tgt_in, scaled(feats, 1000.0))
        if norm:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            assert not torch.allclose(a, b, atol=1e-2)
    # Its parameters are two LayerNorms; without it the state dict has no new entries.
    names = set(FusedTransformer(tiny_config([dataclasses.replace(s, feature_norm=True) for s in TWO_PRLMS])).state_dict())
    assert {n for n in names if n.startswith("prlm_feature_norms.")} == {f"prlm_feature_norms.{i}.{w}" for i in (0, 1) for w in ("weight", "bias")}
    assert not any(n.startswith("prlm_feature_norms.") for n in FusedTransformer(tiny_config(TWO_PRLMS)).state_dict())


def test_dynamic_layer_weights_form_a_convex_combination():
    config = tiny_config([spec("a", 16, "dyn_cls", num_layers=3)])
    model = FusedTransformer(config)
    select = model.prlm_layers[0]
    g = torch.Generator().manual_seed(0)
    feats = make_features(config.prlms, [4, 2], g)[0]
    alpha = select.layer_weights(feats.pooled)
    assert alpha.shape == (2, 3) and torch.allclose(alpha.sum(-1), torch.ones(2))
    same = PrLMFeatures(feats.states[:, :1].expand(-1, 3, -1, -1), feats.mask, feats.pooled)
    assert torch.allclose(select(same), feats.states[:, 0], atol=1e-6)


def test_pooled_index_picks_the_pooled_rows_of_the_token_layers():
    # Token layers [4, 6] of a 6-layer PrLM; pooled rows for hidden_states 0..6.
    s = PrLMSpec("m", 16, num_layers=2, num_pooled=7, layer_mode="dyn_aver", pooled_index=[4, 6])
    model = FusedTransformer(tiny_config([s]))
    pooled = torch.zeros(1, 7, 2, 16)
    pooled[:, 4, 1] = torch.randn(16)
    pooled[:, 6, 1] = torch.randn(16)
    alpha = model.prlm_layers[0].layer_weights(pooled)
    # The authors' scoring: one Linear from the concatenated sentence vectors to one logit per layer.
    score = model.prlm_layers[0].score
    assert (score.in_features, score.out_features) == (2 * 16, 2)
    expected = torch.softmax(score.weight @ pooled[0, [4, 6], 1].flatten() + score.bias, dim=-1)
    assert torch.allclose(alpha[0], expected, atol=1e-6)
    with pytest.raises(UserError, match="pooled_index"):
        PrLMSpec("m", 16, num_layers=2, num_pooled=7, layer_mode="dyn_aver")


def copy_task_loss_drop(prlms: list[PrLMSpec]) -> tuple[float, float]:
    """Train a tiny model to copy its input; PrLM features are a fixed random embedding of the source."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    config = tiny_config(prlms, dropout=0.0)
    model = FusedTransformer(config).train()
    prlm_tables = [torch.randn(VOCAB, s.num_layers, s.width, generator=g) for s in prlms]
    lengths = [int(n) for n in torch.randint(3, 7, (48,), generator=g)]
    src = make_tokens(lengths, g)
    mask = src != PAD
    eos_col = torch.full((48, 1), PAD)
    tgt = torch.cat([src, eos_col], dim=1)
    tgt[torch.arange(48), torch.tensor(lengths)] = EOS
    tgt_in = torch.cat([torch.full((48, 1), BOS), tgt[:, :-1]], dim=1)
    tgt_in[tgt_in == EOS] = PAD
    feats = [PrLMFeatures(t[src].permute(0, 2, 1, 3), mask, None) for t in prlm_tables]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss, _ = label_smoothed_sums(model(src, tgt_in, feats), tgt, 0.0)
        loss = loss / int((tgt != PAD).sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-5:]) / 5


@pytest.mark.parametrize("prlms", [[], ONE_PRLM], ids=["baseline", "fused"])
def test_tiny_model_learns_to_copy(prlms):
    first, last = copy_task_loss_drop(prlms)
    assert first > 3.0  # about ln(VOCAB) at the start
    assert last < 0.25 * first


def test_state_dict_round_trips_through_safetensors(tmp_path):
    config = tiny_config([spec("a", 32, "dwatt"), spec("b", 16)], merge="gate", side="both")
    torch.manual_seed(0)
    model = FusedTransformer(config).eval()
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    torch.manual_seed(1)
    restored = FusedTransformer(ModelConfig.from_dict(config.to_dict())).eval()
    restored.load_state_dict(load_file(str(path)))
    src, tgt_in, _, feats = batch_for(config)
    with torch.no_grad():
        assert torch.equal(model(src, tgt_in, feats), restored(src, tgt_in, feats))


def test_label_smoothed_sums_over_real_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, VOCAB, generator=g)
    target = torch.tensor([[5, 6, EOS], [7, EOS, PAD]])
    loss, _ = label_smoothed_sums(logits, target, 0.1)
    lprobs = F.log_softmax(logits, -1)
    expected = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        expected += -(0.9 * lprobs[b, t, target[b, t]] + 0.1 * lprobs[b, t].mean())
    assert torch.allclose(loss, expected, atol=1e-4)


def test_scored_rows_give_the_same_loss_and_gradients_as_full_logits():
    """forward(..., scored=mask) computes only the non-pad rows; loss and gradients are unchanged."""
    config = tiny_config(ONE_PRLM, dropout=0.0)
    src, tgt_in, tgt, feats = batch_for(config)
    scored = tgt != PAD
    grads, losses = [], []
    for rows in (None, scored):
        torch.manual_seed(0)
        model = FusedTransformer(config).train()
        logits = model(src, tgt_in, feats, scored=rows)
        target = tgt if rows is None else tgt[rows]
        assert logits.shape[:-1] == target.shape
        loss, nll = label_smoothed_sums(logits, target, 0.1)
        loss.backward()
        losses.append((loss.detach(), nll))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert logits.shape == (int(scored.sum()), VOCAB)
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-5) and torch.allclose(losses[0][1], losses[1][1], atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_presets_and_overrides():
    assert set(PRESETS) == {"base", "summarization", "small", "tiny"}
    base = ModelConfig.from_preset("base", vocab_size=8000)
    assert (base.d_model, base.enc_layers, base.dec_layers, base.heads, base.ffn) == (512, 6, 6, 8, 2048)
    summ = ModelConfig.from_preset("summarization", vocab_size=8000)
    assert (summ.enc_layers, summ.dec_layers, summ.d_model) == (4, 4, 512)
    small = ModelConfig.from_preset("small", vocab_size=100, d_model=None, enc_layers=2)
    assert (small.d_model, small.enc_layers, small.heads, small.ffn) == (256, 2, 4, 1024)
    with pytest.raises(UserError, match="preset"):
        ModelConfig.from_preset("huge", vocab_size=10)
    with pytest.raises(UserError, match="unknown option"):
        ModelConfig.from_preset("tiny", vocab_size=10, widht=3)
    with pytest.raises(UserError, match="vocab_size"):
        ModelConfig.from_preset("tiny")
    config = tiny_config(TWO_PRLMS, merge="gate", side="both")
    assert ModelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(merge="concat"), "merge"),
        (dict(position="ffn2"), "position"),
        (dict(side="left"), "side"),
        (dict(heads=3), "multiple of heads"),
        (dict(merge="direct"), "at least one PrLM"),
        (dict(merge="direct", side="both", prlms=ONE_PRLM), "side must be 'source'"),
    ],
)
def test_bad_config_is_a_user_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        tiny_config(**kwargs)


def test_bad_prlm_spec_and_features_are_user_errors():
    with pytest.raises(UserError, match="exactly one layer"):
        PrLMSpec("x", 16, num_layers=3, num_pooled=3)
    with pytest.raises(UserError, match="layer_mode"):
        PrLMSpec("x", 16, num_layers=3, num_pooled=3, layer_mode="mean")
    config = tiny_config(TWO_PRLMS)
    model = FusedTransformer(config)
    src, tgt_in, _, feats = batch_for(config)
    with pytest.raises(UserError, match="2 PrLM branch"):
        model(src, tgt_in, feats[:1])
    wrong_width = [feats[1], feats[0]]
    with pytest.raises(UserError, match="expected"):
        model(src, tgt_in, wrong_width)
    dyn = FusedTransformer(tiny_config([spec("d", 48, "dyn_cls")]))
    no_pooled = [PrLMFeatures(torch.randn(3, 3, 4, 48), torch.ones(3, 4, dtype=torch.bool), None)]
    with pytest.raises(UserError, match="pooled"):
        dyn(src, tgt_in, no_pooled)


def test_rows_without_any_real_key_stay_finite():
    config = tiny_config(ONE_PRLM, side="both")
    model = FusedTransformer(config).eval()
    src, tgt_in, _, feats = batch_for(config)
    feats[0].mask[1] = False  # an empty PrLM sequence for sentence 1
    with torch.no_grad():
        assert torch.isfinite(model(src, tgt_in, feats)).all()


def test_training_dropout_follows_torchs_seed_and_eval_is_deterministic():
    """Dropout (torch's own) draws from torch's default generator: a seed reproduces a training
    step, another seed changes it, and eval mode drops nothing."""
    config = tiny_config(ONE_PRLM, side="both", dropout=0.3, attention_dropout=0.2)
    torch.manual_seed(0)
    model = FusedTransformer(config)
    src, tgt_in, _, feats = batch_for(config)

    def logits(seed):
        torch.manual_seed(seed)
        return model(src, tgt_in, feats)

    model.train()
    assert torch.equal(logits(3), logits(3))
    assert not torch.equal(logits(3), logits(4))
    model.eval()
    with torch.no_grad():
        assert torch.equal(logits(3), logits(4))


def test_activation_dropout_drops_the_ffns_hidden_activations():
    """activation_dropout sits between the FFN's activation and fc2, as fairseq's."""
    from prlmfuse.train_fused.blocks import FeedForward

    torch.manual_seed(0)
    ffn = FeedForward(16, 64, "relu", activation_dropout=0.3)
    x = torch.randn(4, 5, 16)
    torch.manual_seed(7)
    got = ffn(x)
    torch.manual_seed(7)
    expected = ffn.fc2(F.dropout(F.relu(ffn.fc1(x)), 0.3, training=True))
    assert torch.equal(got, expected)
    ffn.eval()
    assert torch.equal(ffn(x), ffn.fc2(F.relu(ffn.fc1(x))))
    config = tiny_config(ONE_PRLM, dropout=0.0, activation_dropout=0.2, side="source", position="ffn")
    model = FusedTransformer(config).train()
    assert all(m.activation_dropout.p == 0.2 for m in model.modules() if isinstance(m, FeedForward))
    assert sum(isinstance(m, FeedForward) for m in model.modules()) == config.enc_layers * 2 + config.dec_layers


def test_feature_dropout_reaches_what_the_branches_read():
    """feature_dropout drops elements of the selected PrLM features Z once per forward; every branch
    attention's key/value projections read the same dropped Z; eval reads them clean."""
    config = tiny_config(ONE_PRLM, side="both", dropout=0.0, feature_dropout=0.5)
    torch.manual_seed(0)
    model = FusedTransformer(config).train()
    src, tgt_in, _, feats = batch_for(config)
    seen = []
    hooks = [layer.prlm_attn[0].k_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
             for layer in [*model.encoder_layers, *model.decoder_layers]]
    model(src, tgt_in, feats)
    clean = feats[0].states[:, 0]
    assert len(seen) == config.enc_layers + config.dec_layers
    assert all(torch.equal(z, seen[0]) for z in seen[1:])
    kept = seen[0] != 0
    assert 0.35 < 1 - kept.float().mean().item() < 0.65
    assert torch.allclose(seen[0][kept], 2 * clean[kept])
    seen.clear()
    model.eval()
    with torch.no_grad():
        model(src, tgt_in, feats)
    assert torch.equal(seen[0], clean)
    for hook in hooks:
        hook.remove()
    # Off by default: a training step reads the clean features.
    assert ModelConfig(vocab_size=VOCAB).feature_dropout == 0.0


@pytest.mark.parametrize("name", ["activation_dropout", "feature_dropout"])
def test_new_dropouts_are_validated(name):
    with pytest.raises(UserError, match=rf"{name}: expected a number in \[0, 1\), got 1.0"):
        tiny_config([], **{name: 1.0})


def test_cpu_training_attention_equals_sdpa():
    """The written-out CPU training attention computes what SDPA does, masks and causality included."""
    from prlmfuse.train_fused.blocks import cpu_training_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for m in (None, mask, mask & causal):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(cpu_training_attention(q, k, v, m, 0.0), expected)
