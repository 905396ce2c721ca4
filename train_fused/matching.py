"""Trainable parameter counts, and the baseline grown to another run's count (`match_params`).

A fused run trains more parameters than its baseline (each PrLM branch adds attentions, and with
some layer modes a projection of every cached layer), so "is it the PrLM, or just a bigger model?"
needs a baseline of the same size. `matched_ffn` widens a baseline's FFN, the smallest change to the
architecture, until its trainable parameters are within MATCH_TOLERANCE of the other run's;
`matched_depth` first adds layers, as the DWAtt paper's deeper baseline (Base+n) does, since a wider
FFN is not the only way a bigger model could spend the parameters. Counts come from the model built
on the meta device, so they are the model's own and cost no memory.
"""

from __future__ import annotations

import torch

from prlmfuse.errors import UserError
from prlmfuse.train_fused.config import ModelConfig, PrLMSpec, RunConfig

# The matched count lands within this fraction of the target's.
MATCH_TOLERANCE = 0.01
# FFN widths are rounded to a multiple of this, which matrix kernels handle at full speed.
FFN_MULTIPLE = 8


def trainable_parameters(config: ModelConfig) -> int:
    """Trainable parameters of the FusedTransformer that `config` builds (every PrLM branch shaped)."""
    from prlmfuse.train_fused.modeling import FusedTransformer

    with torch.device("meta"):
        model = FusedTransformer(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_parameters(run: RunConfig, vocab_size: int, specs: list[PrLMSpec]) -> int:
    """Trainable parameters of `run` with this BPE vocabulary and these shaped PrLM branches."""
    return trainable_parameters(run.model_config(vocab_size, specs))


def matched_ffn(run: RunConfig, target: int, vocab_size: int) -> int:
    """The FFN width (a multiple of FFN_MULTIPLE) that brings the PrLM-free `run` nearest to `target`
    trainable parameters; UserError if even that misses by more than MATCH_TOLERANCE."""
    if run.prlms:
        raise UserError(f"run {run.name}: match_params widens a run without PrLMs; this one fuses "
                        f"{len(run.prlms)}")
    # The count is linear in the FFN width: two widths give its slope and intercept.
    low, high = (run_parameters(_with_sizes(run, ffn=width), vocab_size, [])
                 for width in (FFN_MULTIPLE, 2 * FFN_MULTIPLE))
    per_width = (high - low) / FFN_MULTIPLE
    exact = FFN_MULTIPLE + (target - low) / per_width
    width = max(FFN_MULTIPLE, FFN_MULTIPLE * round(exact / FFN_MULTIPLE))
    got = run_parameters(_with_sizes(run, ffn=width), vocab_size, [])
    if abs(got - target) > MATCH_TOLERANCE * target:
        raise UserError(
            f"run {run.name}: no FFN width brings its {got:,} trainable parameters within "
            f"{MATCH_TOLERANCE:.0%} of {target:,} (nearest: ffn {width}); match a larger run or change its preset"
        )
    return width


def matched_depth(run: RunConfig, target: int, vocab_size: int) -> dict[str, int]:
    """The sizes of the PrLM-free `run` grown by n >= 1 layers on each side (encoder and decoder), n the
    depth whose count at the run's own FFN lies nearest `target`, then the FFN width that brings it
    within MATCH_TOLERANCE: {"enc_layers", "dec_layers", "ffn"}."""
    model = run.model_config(vocab_size, [])

    def grown(n: int) -> RunConfig:
        return _with_sizes(run, enc_layers=model.enc_layers + n, dec_layers=model.dec_layers + n, ffn=model.ffn)

    # The count is linear in n: two depths give its slope and intercept.
    one, two = (run_parameters(grown(n), vocab_size, []) for n in (1, 2))
    n = max(1, 1 + round((target - one) / (two - one)))
    deeper = grown(n)
    try:
        width = matched_ffn(deeper, target, vocab_size)
    except UserError:
        raise UserError(
            f"run {run.name}: match_by depth adds at least one layer on each side ({deeper.enc_layers}+"
            f"{deeper.dec_layers} layers), and then no FFN width lands within {MATCH_TOLERANCE:.0%} of {target:,} "
            "trainable parameters; use match_by ffn, or match a larger run"
        ) from None
    return {"enc_layers": deeper.enc_layers, "dec_layers": deeper.dec_layers, "ffn": width}


def matched_sizes(run: RunConfig, target: int, vocab_size: int) -> dict[str, int]:
    """The model sizes `run` trains at to match `target` trainable parameters, as its match_by says."""
    if run.match_by == "depth":
        return matched_depth(run, target, vocab_size)
    return {"ffn": matched_ffn(run, target, vocab_size)}


def _with_sizes(run: RunConfig, **sizes: int) -> RunConfig:
    return RunConfig.from_dict({**run.to_dict(), **sizes, "match_params": None, "match_by": None})
