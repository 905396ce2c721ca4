"""Typed configuration of one training run, as the trainer consumes it.

`prlmfuse.config` parses pipeline.yaml into these objects (validated once at the edge);
the trainer and the evaluation jobs read them back from `run.json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from prlmfuse.train_fused.bpe import MIN_VOCAB

# The least batch token budget (max_tokens) a run accepts: pipeline.yaml is held to it when read, not after caching.
MIN_BATCH_TOKENS = 16


@dataclass
class PrLMUse:
    """One PrLM branch of a run: which cached checkpoint, and which of its layers."""

    checkpoint: str
    # An int is a hidden_states index (-1 last, -2 penultimate, -3 third-to-last);
    # a string picks a learned combination of every layer in the cache:
    # "dyn_cls" | "dyn_aver" | "dwatt" | "concat".
    layer: int | str = -2
    # Which cache of that checkpoint to read, when the pipeline builds several (e.g. float16 and int8).
    dtype: str | None = None
    # LayerNorm the features over d_p before the branch's key and value projections. For PrLMs whose
    # hidden states are not normalized, such as a causal LM's residual stream (`cache inspect`
    # shows their scale); a BERT-style encoder's states already are.
    feature_norm: bool = False


# The least value of each integer run setting that has one (None stays allowed where the field is optional).
LEAST_VALUES = {"update_freq": 1, "max_updates": 1, "max_epochs": 1, "save_every": 1, "log_every": 1, "patience": 1,
                "min_epochs": 0, "keep_last_epochs": 0, "bpe_vocab": MIN_VOCAB, "max_tokens": MIN_BATCH_TOKENS}


@dataclass
class RunConfig:
    """One training run: the model, the PrLM branches and the optimisation recipe."""

    name: str
    # Model. preset: base | summarization | small | tiny; explicit sizes override it.
    preset: str = "base"
    d_model: int | None = None
    enc_layers: int | None = None
    dec_layers: int | None = None
    heads: int | None = None
    ffn: int | None = None
    dropout: float = 0.1
    attention_dropout: float = 0.0  # on the attention weights
    activation_dropout: float = 0.0  # after the FFN's activation, as fairseq's
    feature_dropout: float = 0.0  # on the cached PrLM features as the branches read them
    pre_ln: bool = False
    prlms: list[PrLMUse] = field(default_factory=list)  # empty: the baseline
    merge: str = "sum"  # sum | average | gate | dropnet | direct
    position: str = "ffn"  # attn | add_norm1 | ffn | add_norm2
    side: str = "source"  # source | target | both (bert-nmt's decoder) | target_flow | both_flow (the authors')
    # Data.
    bpe_vocab: int = 8000
    max_tokens: int = 3500  # per batch, source or target side, whichever is longer
    # Batches per optimizer update (fairseq's gradient accumulation): the effective batch is
    # update_freq * max_tokens, on one device as on several.
    update_freq: int = 1
    max_train_pairs: int | None = None  # first N training pairs only (quick runs)
    # Optimisation (Appendix A of the paper).
    lr: float = 7e-4
    adam_betas: tuple[float, float] = (0.9, 0.98)
    warmup: int = 4000
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # 0: no clipping
    weight_decay: float = 0.0
    # Stopping: whichever comes first; at least one of max_updates / max_epochs must be set.
    max_updates: int | None = None
    max_epochs: int | None = 50
    # Epochs whose end-of-epoch dev loss did not beat the best one before stopping (the paper's recipe
    # stops after 3), never before min_epochs epochs.
    patience: int | None = None
    min_epochs: int | None = None
    # Checkpoints and logging.
    save_every: int = 1000  # updates; also at every epoch end
    keep_last: int = 5
    # Epoch-end checkpoints kept beside the newest keep_last, for an average over epochs (the paper averages 5).
    keep_last_epochs: int = 5
    log_every: int = 50
    tensorboard: bool = False
    # Runtime.
    seed: int = 1
    compile: bool = False  # torch.compile the model (pays on GPUs; first steps are slow while it compiles)
    num_workers: int = 2
    in_memory_features: bool = False

    def below_least_value(self) -> tuple[str, str] | None:
        """(setting, "expected ..., got ...") for the first integer setting below its least value, else None."""
        for key, least in LEAST_VALUES.items():
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < least):
                wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
                typical = f" ({RunConfig.__dataclass_fields__[key].default} is typical)" if least > 1 else ""
                return key, f"expected {wanted}, got {value!r}{typical}"
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["prlms"] = [p if isinstance(p, PrLMUse) else PrLMUse(**p) for p in d.get("prlms", [])]
        if "adam_betas" in d:
            d["adam_betas"] = tuple(d["adam_betas"])
        return cls(**d)


def recipe_without_seed(train: dict) -> dict:
    """A run's settings (RunConfig.to_dict(), as run.json stores them) minus name and seed:
    equal for the runs of one `grid: {seed: [...]}`."""
    return {k: v for k, v in train.items() if k not in ("name", "seed")}
