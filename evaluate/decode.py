"""Batched beam search and greedy decoding over FusedTransformer's incremental API.

Both encode once, then feed one new token per hypothesis per step through `model.decode` with
the self-attention cache, so a step costs O(t) and a sentence O(T^2) attention work in total
(no prefix recomputation). Beams are rows of the batch; `EncoderOut.index_select` and
`model.reorder_cache` follow them, and finished sentences are dropped from the batch.

Scoring is fairseq's: a hypothesis' score is the sum of its token log-probabilities
(including the final </s>), divided by len^lenpen where len counts its tokens including </s>.

Length limits per sentence: at least `min_len` tokens before </s>; at most
max_len = int(max_len_a * src_len + max_len_b) tokens before </s> (src_len = non-pad source
tokens; capped so the target fits in model.config.max_positions), after which </s> is forced.

`no_repeat_ngram_size = n > 0` forbids any token that would complete an n-gram already present
in the hypothesis (</s> is never blocked: it ends the hypothesis and is not part of the output).

A sentence is done when it reached max_len, or it has `beam` finished hypotheses and no live
one can still beat the worst of them: a live hypothesis with score s after t tokens is
credited with s / t^lenpen, what it would score if it ended now (log-probabilities are <= 0,
so this is an upper bound for lenpen <= 0 and fairseq's/Hugging Face's heuristic for
lenpen > 0). With this rule beam 1 is exactly greedy decoding.

The outputs are token id lists without <s> and </s>, one per source row, in input order.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from prlmfuse.errors import UserError
from prlmfuse.evaluate.settings import DEFAULTS

NEG_INF = float("-inf")


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    # Decoding with dropout on would be silently wrong; restore the caller's mode afterwards.
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _check_options(beam: int, max_len_a: float, max_len_b: int, min_len: int, no_repeat_ngram_size: int) -> None:
    if beam < 1:
        raise UserError(f"decoding: beam={beam} must be at least 1")
    if max_len_a < 0 or max_len_b < 0:
        raise UserError(f"decoding: max_len_a={max_len_a} and max_len_b={max_len_b} must not be negative")
    if min_len < 0:
        raise UserError(f"decoding: min_len={min_len} must not be negative")
    if no_repeat_ngram_size < 0:
        raise UserError(f"decoding: no_repeat_ngram_size={no_repeat_ngram_size} must be 0 (off) or positive")


def _max_lengths(src_tokens: Tensor, config, max_len_a: float, max_len_b: int) -> Tensor:
    """Per sentence: the most tokens before </s> (positions 0..max_len hold <s> and them)."""
    src_lengths = (src_tokens != config.pad_id).sum(dim=1).tolist()
    cap = config.max_positions - 1
    return torch.tensor([min(int(max_len_a * n + max_len_b), cap) for n in src_lengths], dtype=torch.long)


def _block_repeated_ngrams(lprobs: Tensor, generated: Tensor, n: int) -> None:
    """Set to -inf every token that would complete an n-gram already in `generated` [N, t]."""
    if generated.shape[1] < n:
        return
    ngrams = generated.unfold(1, n, 1)  # [N, t - n + 1, n]
    last = generated[:, generated.shape[1] - (n - 1) :]  # the n-1 tokens the next one extends
    matches = (ngrams[:, :, :-1] == last[:, None, :]).all(dim=-1)
    rows, starts = matches.nonzero(as_tuple=True)
    lprobs[rows, ngrams[rows, starts, -1]] = NEG_INF


def _next_token_lprobs(
    model, logits: Tensor, tokens: Tensor, step: int, max_lens: Tensor, min_len: int, no_repeat_ngram_size: int
) -> Tensor:
    """Log-probabilities [N, V] of the next token under the length and n-gram constraints.

    tokens [N, step + 1] are <s> and the step tokens generated so far; max_lens [N] per row.
    """
    config = model.config
    lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
    eos_lprobs = lprobs[:, config.eos_id].clone()
    lprobs[:, config.pad_id] = NEG_INF
    lprobs[:, config.bos_id] = NEG_INF
    if step < min_len:
        lprobs[:, config.eos_id] = NEG_INF
    if no_repeat_ngram_size:
        _block_repeated_ngrams(lprobs, tokens[:, 1:], no_repeat_ngram_size)
    forced = step >= max_lens
    if bool(forced.any()):
        lprobs[forced] = NEG_INF
        lprobs[forced, config.eos_id] = eos_lprobs[forced]
    return lprobs


def _add_finished(finished: list[tuple[float, list[int]]], score: float, hyp: list[int], beam: int) -> None:
    """Keep the `beam` best finished hypotheses of a sentence, best first."""
    finished.append((score, hyp))
    finished.sort(key=lambda item: item[0], reverse=True)
    del finished[beam:]


@torch.inference_mode()
def beam_search(
    model,
    src_tokens: Tensor,
    prlm,
    *,
    beam: int = DEFAULTS.beam,
    lenpen: float = DEFAULTS.lenpen,
    max_len_a: float = DEFAULTS.max_len_a,
    max_len_b: int = DEFAULTS.max_len_b,
    min_len: int = DEFAULTS.min_len,
    no_repeat_ngram_size: int = DEFAULTS.no_repeat_ngram_size,
) -> list[list[int]]:
    """The best hypothesis for each row of src_tokens [B, S], as token ids without <s>/</s>."""
    _check_options(beam, max_len_a, max_len_b, min_len, no_repeat_ngram_size)
    config = model.config
    device = src_tokens.device
    batch = src_tokens.shape[0]
    if batch == 0:
        return []
    with _eval_mode(model):
        max_lens = _max_lengths(src_tokens, config, max_len_a, max_len_b).to(device)
        enc = model.encode(src_tokens, prlm)
        # Sentence i owns rows i*beam .. i*beam + beam - 1 of every per-hypothesis tensor.
        enc = enc.index_select(torch.arange(batch, device=device).repeat_interleave(beam))
        sent_ids = list(range(batch))  # original index of each sentence still being decoded
        tokens = torch.full((batch * beam, 1), config.bos_id, dtype=torch.long, device=device)
        # Only the first beam is live at the start, so the first step does not pick duplicates.
        scores = torch.full((batch, beam), NEG_INF, device=device)
        scores[:, 0] = 0.0
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
        cache = None

        for step in itertools.count():
            num_sents = scores.shape[0]
            logits, cache = model.decode(tokens[:, -1:], enc, cache)
            lprobs = _next_token_lprobs(
                model, logits, tokens, step, max_lens.repeat_interleave(beam), min_len, no_repeat_ngram_size
            )
            vocab = lprobs.shape[-1]
            candidates = (scores.unsqueeze(-1) + lprobs.view(num_sents, beam, vocab)).view(num_sents, beam * vocab)
            # 2*beam candidates: at most beam of them end in </s>, so beam continuations remain.
            cand_scores, cand_idx = candidates.topk(2 * beam, dim=1)
            cand_tokens = cand_idx % vocab
            cand_rows = cand_idx // vocab + torch.arange(num_sents, device=device)[:, None] * beam
            cand_eos = cand_tokens == config.eos_id

            # </s> among the top `beam` candidates finishes that hypothesis.
            length_norm = (step + 1) ** lenpen
            newly_finished = cand_eos[:, :beam] & torch.isfinite(cand_scores[:, :beam])
            for s, c in newly_finished.nonzero().tolist():
                hyp = tokens[cand_rows[s, c], 1:].tolist()
                _add_finished(finished[sent_ids[s]], cand_scores[s, c].item() / length_norm, hyp, beam)

            # The live beams: the best `beam` candidates that do not end in </s> (stable order).
            keep_cols = torch.sort(cand_eos.to(torch.int8), dim=1, stable=True).indices[:, :beam]
            scores = cand_scores.gather(1, keep_cols)
            parent_rows = cand_rows.gather(1, keep_cols)
            next_tokens = cand_tokens.gather(1, keep_cols)

            best_live = (scores.max(dim=1).values / length_norm).tolist()
            keep_sents = []
            for s, sent in enumerate(sent_ids):
                done = step >= int(max_lens[s]) or best_live[s] == NEG_INF
                if not done and len(finished[sent]) >= beam:
                    done = finished[sent][-1][0] >= best_live[s]
                if done and not finished[sent]:
                    # Every continuation was forbidden (only possible with tiny vocabularies and
                    # strict constraints): return what the best hypothesis had so far.
                    finished[sent].append((NEG_INF, tokens[parent_rows[s, 0], 1:].tolist()))
                if not done:
                    keep_sents.append(s)
            if not keep_sents:
                break

            if len(keep_sents) < num_sents:
                keep = torch.tensor(keep_sents, device=device)
                scores, parent_rows, next_tokens = scores[keep], parent_rows[keep], next_tokens[keep]
                max_lens = max_lens[keep]
                sent_ids = [sent_ids[s] for s in keep_sents]
                enc = enc.index_select((keep[:, None] * beam + torch.arange(beam, device=device)).view(-1))
            rows = parent_rows.view(-1)
            tokens = torch.cat([tokens.index_select(0, rows), next_tokens.view(-1, 1)], dim=1)
            cache = model.reorder_cache(cache, rows)

    return [hyps[0][1] for hyps in finished]


@torch.inference_mode()
def greedy(
    model,
    src_tokens: Tensor,
    prlm,
    *,
    max_len_a: float = DEFAULTS.max_len_a,
    max_len_b: int = DEFAULTS.max_len_b,
    min_len: int = DEFAULTS.min_len,
    no_repeat_ngram_size: int = DEFAULTS.no_repeat_ngram_size,
) -> list[list[int]]:
    """The most probable next token at every step, for each row of src_tokens [B, S]; ids without <s>/</s>."""
    _check_options(1, max_len_a, max_len_b, min_len, no_repeat_ngram_size)
    config = model.config
    device = src_tokens.device
    batch = src_tokens.shape[0]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    if batch == 0:
        return outputs
    with _eval_mode(model):
        max_lens = _max_lengths(src_tokens, config, max_len_a, max_len_b).to(device)
        enc = model.encode(src_tokens, prlm)
        sent_ids = list(range(batch))
        tokens = torch.full((batch, 1), config.bos_id, dtype=torch.long, device=device)
        cache = None
        for step in itertools.count():
            logits, cache = model.decode(tokens[:, -1:], enc, cache)
            lprobs = _next_token_lprobs(model, logits, tokens, step, max_lens, min_len, no_repeat_ngram_size)
            best, next_tokens = lprobs.max(dim=-1)
            ended = (next_tokens == config.eos_id) | (best == NEG_INF)
            for r in ended.nonzero().view(-1).tolist():
                outputs[sent_ids[r]] = tokens[r, 1:].tolist()
            if bool(ended.all()):
                break
            if bool(ended.any()):
                keep = (~ended).nonzero().view(-1)
                tokens, next_tokens, max_lens = tokens[keep], next_tokens[keep], max_lens[keep]
                sent_ids = [sent_ids[r] for r in keep.tolist()]
                enc = enc.index_select(keep)
                cache = model.reorder_cache(cache, keep)
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
    return outputs


def hypothesis_score(model, src_tokens: Tensor, prlm, hyp: list[int], *, lenpen: float = DEFAULTS.lenpen) -> float:
    """Length-normalised score (as beam search ranks it) of `hyp` + </s> for a single source row."""
    config = model.config
    device = src_tokens.device
    target = torch.tensor([*hyp, config.eos_id], dtype=torch.long, device=device)[None]
    prev = torch.tensor([config.bos_id, *hyp], dtype=torch.long, device=device)[None]
    with torch.inference_mode(), _eval_mode(model):
        logits, _ = model.decode(prev, model.encode(src_tokens, prlm))
        lprobs = F.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None])
    return lprobs.sum().item() / target.shape[1] ** lenpen


__all__ = ["beam_search", "greedy", "hypothesis_score"]
