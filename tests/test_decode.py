"""Beam search and greedy decoding: exact on tiny models, batch-invariant, constraint-respecting."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from prlmfuse.errors import UserError
from prlmfuse.evaluate.decode import beam_search, greedy, hypothesis_score
from prlmfuse.train_fused.modeling import FusedTransformer, ModelConfig, PrLMFeatures, PrLMSpec
from prlmfuse.train_fused.update_step import label_smoothed_sums

torch.set_num_threads(1)

PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 3  # ids from 3 on (including <unk>) are ordinary output tokens


def random_model(vocab: int, seed: int, prlm_width: int | None = None, weight_std: float = 1.0, **overrides):
    """A tiny model with large random weights, so its next-token distributions depend on the context."""
    torch.manual_seed(seed)
    prlms = [PrLMSpec("p", prlm_width, 1, 1)] if prlm_width else []
    config = ModelConfig.from_preset("tiny", vocab_size=vocab, prlms=prlms, dropout=0.0, **overrides)
    model = FusedTransformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, weight_std)
    return model


def random_batch(model, lengths: list[int], seed: int):
    """Right-padded sources of the given lengths, and PrLM features (M = length + 1) if the model has a PrLM."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    src = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(FIRST_WORD, vocab, (n,), generator=g)
    feats = []
    for spec in model.config.prlms:
        m = max(lengths) + 1
        mask = torch.arange(m)[None] < torch.tensor(lengths)[:, None] + 1
        states = torch.randn(len(lengths), 1, m, spec.width, generator=g) * mask[:, None, :, None]
        feats.append(PrLMFeatures(states, mask, None))
    return src, feats


def select_rows(src: torch.Tensor, feats: list[PrLMFeatures], rows: list[int]):
    """Rows of a batch with their padding trimmed, as if batched on their own."""
    sub_src = src[rows]
    sub_src = sub_src[:, : int((sub_src != PAD).sum(1).max())]
    sub_feats = []
    for f in feats:
        mask = f.mask[rows]
        m = int(mask.sum(1).max())
        sub_feats.append(PrLMFeatures(f.states[rows][:, :, :m], mask[:, :m], None))
    return sub_src, sub_feats


def exhaustive_best(model, src, feats, *, max_len: int, min_len: int, lenpen: float) -> float:
    """Best length-normalised score over every hypothesis of min_len..max_len ordinary tokens."""
    vocab = model.config.vocab_size
    words = list(range(FIRST_WORD, vocab))
    best = float("-inf")
    with torch.no_grad():
        enc = model.encode(src, feats)
        for length in range(min_len, max_len + 1):
            hyps = torch.tensor(list(itertools.product(words, repeat=length)), dtype=torch.long).view(-1, length)
            prev = torch.cat([torch.full((len(hyps), 1), BOS), hyps], dim=1)
            target = torch.cat([hyps, torch.full((len(hyps), 1), EOS)], dim=1)
            logits, _ = model.decode(prev, enc.index_select(torch.zeros(len(hyps), dtype=torch.long)))
            lprobs = F.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None]).squeeze(-1)
            best = max(best, (lprobs.sum(1) / (length + 1) ** lenpen).max().item())
    return best


@pytest.mark.parametrize("lenpen", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_large_beam_equals_exhaustive_search(seed, lenpen):
    # Vocabulary: pad, bos, eos + 4 ordinary tokens; hypotheses of 1..3 tokens: 4 + 16 + 64.
    model = random_model(7, seed, prlm_width=12 if seed % 2 else None, side="both")
    src, feats = random_batch(model, [5], seed)
    [hyp] = beam_search(model, src, feats, beam=128, lenpen=lenpen, max_len_a=0.0, max_len_b=3, min_len=1)
    assert 1 <= len(hyp) <= 3
    best = exhaustive_best(model, src, feats, max_len=3, min_len=1, lenpen=lenpen)
    # The two score the same hypothesis by different paths (incremental against full prefix): float32 noise.
    assert hypothesis_score(model, src, feats, hyp, lenpen=lenpen) == pytest.approx(best, abs=1e-4)
    # A normal-sized beam can only do as well or worse.
    [small] = beam_search(model, src, feats, beam=2, lenpen=lenpen, max_len_a=0.0, max_len_b=3, min_len=1)
    assert hypothesis_score(model, src, feats, small, lenpen=lenpen) <= best + 1e-4


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    ngrams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(ngrams) != len(set(ngrams))


@pytest.mark.parametrize("n", [2, 3])
def test_ngram_blocking_never_repeats_an_ngram(n):
    repeats_without_blocking = 0
    for seed in range(6):
        model = random_model(10, seed, prlm_width=8 if seed % 2 else None, pre_ln=seed % 3 == 0)
        src, feats = random_batch(model, [3, 9, 6, 12], seed)
        for beam in (1, 4):
            options = dict(beam=beam, max_len_a=1.0, max_len_b=10, min_len=seed)
            blocked = beam_search(model, src, feats, no_repeat_ngram_size=n, **options)
            assert not any(has_repeated_ngram(h, n) for h in blocked), blocked
            repeats_without_blocking += sum(has_repeated_ngram(h, n) for h in beam_search(model, src, feats, **options))
        blocked = greedy(model, src, feats, no_repeat_ngram_size=n, max_len_a=1.0, max_len_b=10)
        assert not any(has_repeated_ngram(h, n) for h in blocked)
    # The property is not vacuous: these models do repeat themselves when allowed to.
    assert repeats_without_blocking > 0


@pytest.fixture(scope="module")
def copy_model():
    """A tiny fused model (PrLM on both sides) trained to copy its source; and its training batch."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, batch = 24, 48
    config = ModelConfig.from_preset(
        "tiny", vocab_size=vocab, prlms=[PrLMSpec("p", 16, 1, 1)], side="both", dropout=0.0
    )
    model = FusedTransformer(config).train()
    lengths = [int(n) for n in torch.randint(2, 9, (batch,), generator=g)]
    src = torch.full((batch, max(lengths)), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(FIRST_WORD + 1, vocab, (n,), generator=g)
    prlm_table = torch.randn(vocab, 1, 16, generator=g)
    mask = src != PAD
    feats = [PrLMFeatures(prlm_table[src].permute(0, 2, 1, 3) * mask[:, None, :, None], mask, None)]
    tgt = torch.cat([src, torch.full((batch, 1), PAD)], dim=1)
    tgt[torch.arange(batch), torch.tensor(lengths)] = EOS
    tgt_in = torch.cat([torch.full((batch, 1), BOS), tgt[:, :-1]], dim=1)
    tgt_in[tgt_in == EOS] = PAD
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _ = label_smoothed_sums(model(src, tgt_in, feats), tgt, 0.0)
        optimizer.zero_grad()
        (loss / int((tgt != PAD).sum())).backward()
        optimizer.step()
    return model.eval(), src, feats, lengths


def test_trained_copy_model_copies(copy_model):
    model, src, feats, lengths = copy_model
    expected = [src[i, :n].tolist() for i, n in enumerate(lengths)]
    for hyps in (beam_search(model, src, feats), greedy(model, src, feats)):
        exact = sum(h == e for h, e in zip(hyps, expected))
        assert exact >= 0.9 * len(expected)


def test_hypotheses_do_not_depend_on_batch_size(copy_model):
    model, src, feats, _ = copy_model
    rows = [3, 17, 0, 41, 8, 25, 30, 12]
    batch_src, batch_feats = select_rows(src, feats, rows)
    batched = beam_search(model, batch_src, batch_feats, beam=5)
    batched_greedy = greedy(model, batch_src, batch_feats)
    for k, row in enumerate(rows):
        one_src, one_feats = select_rows(src, feats, [row])
        assert beam_search(model, one_src, one_feats, beam=5) == [batched[k]]
        assert greedy(model, one_src, one_feats) == [batched_greedy[k]]


@pytest.mark.parametrize("seed", range(4))
def test_random_model_hypotheses_do_not_depend_on_batch_size(seed):
    model = random_model(16, seed, prlm_width=8, side="both" if seed % 2 else "source")
    lengths = [5, 2, 9, 7, 1, 4, 8, 3]
    src, feats = random_batch(model, lengths, seed)
    options = dict(beam=4, lenpen=1.0, max_len_b=6, no_repeat_ngram_size=3 * (seed % 2))
    batched = beam_search(model, src, feats, **options)
    ties = 0
    for k in range(len(lengths)):
        one_src, one_feats = select_rows(src, feats, [k])
        [alone] = beam_search(model, one_src, one_feats, **options)
        if alone != batched[k]:
            # Padding changes fp32 rounding by ~1e-6; only a true tie may flip the choice.
            score = lambda h: hypothesis_score(model, one_src, one_feats, h, lenpen=1.0)  # noqa: E731
            assert score(alone) == pytest.approx(score(batched[k]), abs=1e-5)
            ties += 1
    assert ties <= 1


def test_greedy_equals_beam_one(copy_model):
    model, src, feats, _ = copy_model
    assert greedy(model, src, feats) == beam_search(model, src, feats, beam=1)
    for seed in range(4):
        model = random_model(12, seed, prlm_width=8 if seed % 2 else None)
        src, feats = random_batch(model, [4, 7, 2, 6], seed)
        for lenpen, ngram, min_len in [(1.0, 0, 1), (0.5, 2, 3), (2.0, 3, 0)]:
            options = dict(max_len_a=1.5, max_len_b=4, min_len=min_len, no_repeat_ngram_size=ngram)
            assert greedy(model, src, feats, **options) == beam_search(model, src, feats, beam=1, lenpen=lenpen, **options)


def test_length_limits_and_special_tokens():
    for seed in range(4):
        model = random_model(10, seed, prlm_width=8)
        lengths = [1, 4, 7]
        src, feats = random_batch(model, lengths, seed)
        for decode in (lambda **o: beam_search(model, src, feats, beam=3, **o), lambda **o: greedy(model, src, feats, **o)):
            hyps = decode(max_len_a=0.5, max_len_b=2, min_len=2)
            for hyp, n in zip(hyps, lengths):
                assert 2 <= len(hyp) <= int(0.5 * n + 2)
                assert not {PAD, BOS, EOS} & set(hyp)
            # max_len below min_len: the hard cap wins.
            assert all(len(h) == 0 for h in decode(max_len_a=0.0, max_len_b=0, min_len=2))


def test_decoding_feeds_one_new_token_per_step():
    model = random_model(10, 0, prlm_width=8, side="both")
    src, feats = random_batch(model, [3, 6], 0)
    widths, cache_lengths = [], []
    decode = model.decode

    def recording_decode(prev_tokens, enc, cache=None):
        widths.append(prev_tokens.shape[1])
        cache_lengths.append(0 if cache is None else cache[0][0].shape[2])
        return decode(prev_tokens, enc, cache)

    model.decode = recording_decode
    hyps = beam_search(model, src, feats, beam=3, max_len_a=0.0, max_len_b=6)
    assert set(widths) == {1}
    assert cache_lengths == list(range(len(cache_lengths)))
    assert len(cache_lengths) <= 7  # <s> plus at most 6 tokens (the last step only emits </s>)
    assert len(hyps) == 2


def test_decoding_restores_training_mode_and_runs_under_bf16():
    model = random_model(10, 0, prlm_width=8).train()
    src, feats = random_batch(model, [3, 5], 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hyps = beam_search(model, src, feats, beam=3)
        greedy_hyps = greedy(model, src, feats)
    assert model.training
    assert len(hyps) == len(greedy_hyps) == 2
    assert all(FIRST_WORD <= t < 10 for h in hyps + greedy_hyps for t in h)


@pytest.mark.parametrize(
    "options,message",
    [(dict(beam=0), "beam"), (dict(min_len=-1), "min_len"), (dict(no_repeat_ngram_size=-2), "no_repeat"), (dict(max_len_b=-1), "max_len")],
)
def test_bad_options_are_user_errors(options, message):
    model = random_model(10, 0)
    src, feats = random_batch(model, [3], 0)
    with pytest.raises(UserError, match=message):
        beam_search(model, src, feats, **options)
