"""Typed configuration of one training run and of the model it builds: the one home of their rules.

`RunConfig` is a run as pipeline.yaml's `train.runs` and run.json's `train` state it; `ModelConfig`
is the model it builds (`RunConfig.model_config`), stored as run.json's `model`. A setting has one
name in all four. Every rule is checked here, by `RunConfig.check()` and the config dataclasses'
`__post_init__`, and raised as a `SettingError` naming the setting: `prlmfuse.config` builds the
same model configuration when it reads pipeline.yaml and points at the setting's line, and the
trainer applies the very same rules to a RunConfig made in Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from prlmfuse.errors import SettingError, UserError
from prlmfuse.train_fused.bpe import MIN_VOCAB

MERGES = ("sum", "average", "gate", "dropnet", "direct")
POSITIONS = ("attn", "add_norm1", "ffn", "add_norm2")
# target / both: bert-nmt's decoder (Zhu et al. 2020), the PrLM attention merged with the encoder
# attention; target_flow / both_flow: the authors' fork, a PrLM flow with its own add&norm and FFN
# merged at `position`, as in the encoder.
SIDES = ("source", "target", "both", "target_flow", "both_flow")
LAYER_MODES = ("fixed", "dyn_cls", "dyn_aver", "dwatt", "concat")
# A string `layer` names a learned combination of layers; "fixed" is what an integer index means.
STRING_LAYER_MODES = tuple(m for m in LAYER_MODES if m != "fixed")
ACTIVATIONS = ("relu", "gelu")
# A control replaces what a PrLM branch reads, to ask what its gain is made of. shuffled: each sentence
# reads the cached features of another sentence of its split (train_fused.branches.shuffled_rows).
CONTROLS = ("shuffled",)

PRESETS: dict[str, dict] = {
    # Transformer base (Vaswani et al. 2017), as in the paper's translation experiments.
    "base": dict(d_model=512, enc_layers=6, dec_layers=6, heads=8, ffn=2048),
    # The paper's summarization setting: base with 4 + 4 layers.
    "summarization": dict(d_model=512, enc_layers=4, dec_layers=4, heads=8, ffn=2048),
    # CPU-sized models for quick experiments and tests.
    "small": dict(d_model=256, enc_layers=3, dec_layers=3, heads=4, ffn=1024),
    "tiny": dict(d_model=64, enc_layers=2, dec_layers=2, heads=2, ffn=128),
}

# The least batch token budget (max_tokens) a run accepts: pipeline.yaml is held to it when read, not after caching.
MIN_BATCH_TOKENS = 16


def _one_of(key: str, value, choices) -> None:
    if value not in choices:
        raise SettingError(key, f"{value!r} is not one of {', '.join(map(str, choices))}")


# ----------------------------------------------------------------------------- the model


@dataclass
class PrLMSpec:
    """One PrLM branch as the model sees it: the shape of its cached features and how to combine its layers.

    The shape (width, num_layers, num_pooled) comes from the cache (`train_fused.branches.open_branch`);
    `before_caching` states a branch without it, which is all the model configuration's rules read.
    """

    name: str  # checkpoint name, for humans and run.json
    width: int | None  # its hidden size d_p
    num_layers: int | None  # token-feature layers in the cache (1 for a fixed layer)
    num_pooled: int | None  # pooled layers in the cache (for dyn_cls / dyn_aver)
    layer_mode: str = "fixed"  # fixed | dyn_cls | dyn_aver | dwatt | concat
    # dyn_cls / dyn_aver: pooled row of each token layer. A cache stores pooled vectors for its
    # stored layers (some caches for every layer up to the highest), so this is the identity (the
    # default when num_pooled == num_layers) unless the cache keeps more; then pass
    # [reader.pooled_layers.index(l) for l in reader.layers].
    pooled_index: list[int] | None = None
    feature_norm: bool = False  # LayerNorm over width on the selected features (see PrLMUse)

    @classmethod
    def before_caching(cls, use: PrLMUse) -> "PrLMSpec":
        """The branch `use` asks for, before a cache gives its feature shape."""
        mode = use.layer if isinstance(use.layer, str) else "fixed"
        return cls(name=use.checkpoint, width=None, num_layers=None, num_pooled=None, layer_mode=mode,
                   feature_norm=use.feature_norm)

    @property
    def shaped(self) -> bool:
        return self.width is not None

    def __post_init__(self):
        where = f"PrLM {self.name!r}"
        if self.layer_mode not in LAYER_MODES:
            raise UserError(f"{where}: unknown layer_mode {self.layer_mode!r}; use one of {', '.join(LAYER_MODES)}")
        if not self.shaped:
            return
        if self.width < 2 or self.num_layers < 1 or self.num_pooled < 0:
            raise UserError(
                f"{where}: width={self.width}, num_layers={self.num_layers}, num_pooled={self.num_pooled} "
                "are not a valid feature shape; take them from the cache manifest"
            )
        if self.layer_mode == "fixed" and self.num_layers != 1:
            raise UserError(
                f"{where}: layer_mode 'fixed' needs a cache of exactly one layer, this one has {self.num_layers}; "
                "pick one layer or use dyn_cls, dyn_aver, dwatt or concat"
            )
        if self.layer_mode in ("dyn_cls", "dyn_aver"):
            if self.pooled_index is None:
                if self.num_pooled != self.num_layers:
                    raise UserError(
                        f"{where}: {self.layer_mode} needs pooled_index (pooled row of each of the "
                        f"{self.num_layers} token layers, out of {self.num_pooled} pooled rows); "
                        "set it from CacheReader.layers and .pooled_layers"
                    )
                self.pooled_index = list(range(self.num_layers))
            self.pooled_index = [int(i) for i in self.pooled_index]
            if len(self.pooled_index) != self.num_layers or not all(
                0 <= i < self.num_pooled for i in self.pooled_index
            ):
                raise UserError(
                    f"{where}: pooled_index {self.pooled_index} must give one row in 0..{self.num_pooled - 1} "
                    f"for each of the {self.num_layers} token layers"
                )


@dataclass
class ModelConfig:
    """Sizes and fusion options of a FusedTransformer. Stored in run.json via to_dict()."""

    vocab_size: int
    d_model: int = 512
    enc_layers: int = 6
    dec_layers: int = 6
    heads: int = 8
    ffn: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0  # on the attention weights
    activation_dropout: float = 0.0  # after the FFN's activation, as fairseq's
    feature_dropout: float = 0.0  # on the selected PrLM features as the branches read them
    activation: str = "relu"
    pre_ln: bool = False
    max_positions: int = 1024  # decoding never goes beyond this many target positions
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    prlms: list[PrLMSpec] = field(default_factory=list)  # empty: the baseline Transformer
    # The defaults are the settings measured best on this code (docs/configuration.md's run settings name the paper's).
    merge: str = "sum"  # sum | average | gate | dropnet | direct
    # attn | add_norm1 | ffn | add_norm2 (encoder side). None: add_norm1, or ffn in pre-LN layers, which
    # have no add&norm to merge after.
    position: str | None = None
    # source | target | both | target_flow | both_flow. None: both, or source for merge direct, which
    # replaces the source input.
    side: str | None = None
    dropnet_p: float = 0.5  # merge dropnet: probability of keeping one side only

    def __post_init__(self):
        self.prlms = [p if isinstance(p, PrLMSpec) else PrLMSpec(**p) for p in self.prlms]
        if self.position is None:
            self.position = "ffn" if self.pre_ln else "add_norm1"
        if self.side is None:
            self.side = "source" if self.merge == "direct" else "both"
        if self.vocab_size <= max(self.pad_id, self.bos_id, self.eos_id):
            raise SettingError("vocab_size", f"{self.vocab_size} does not exceed the special token ids")
        if not (self.d_model > 0 and self.heads > 0 and self.d_model % self.heads == 0):
            raise SettingError("heads", f"d_model={self.d_model} must be a positive multiple of heads={self.heads}",
                               also=("d_model",))
        for key in ("enc_layers", "dec_layers", "ffn"):
            if getattr(self, key) < 1:
                raise SettingError(key, f"expected a positive integer, got {getattr(self, key)}")
        for key in ("dropout", "attention_dropout", "activation_dropout", "feature_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise SettingError(key, f"expected a number in [0, 1), got {getattr(self, key)}")
        if not 0.0 <= self.dropnet_p <= 1.0:
            raise SettingError("dropnet_p", f"expected a number in [0, 1], got {self.dropnet_p}")
        _one_of("activation", self.activation, ACTIVATIONS)
        _one_of("merge", self.merge, MERGES)
        _one_of("position", self.position, POSITIONS)
        _one_of("side", self.side, SIDES)
        if self.max_positions < 2:
            raise SettingError("max_positions", f"expected at least 2, got {self.max_positions}")
        if self.merge == "direct":
            if not self.prlms:
                raise SettingError("merge", "'direct' feeds PrLM features as the encoder input; add at least one PrLM to prlms")
            if self.side != "source":
                raise SettingError("side", f"merge 'direct' replaces the source input, so side must be 'source', not {self.side!r}")
        if self.pre_ln and (self.encoder_prlms or self.decoder_flow) and self.position in ("add_norm1", "add_norm2"):
            raise SettingError(
                "position", f"{self.position!r} merges after an add&norm, which pre-LN layers do not have; "
                "use position 'attn' or 'ffn', or pre_ln: false"
            )

    @property
    def encoder_prlms(self) -> bool:
        """Encoder layers carry PrLM branches."""
        return bool(self.prlms) and self.merge != "direct" and self.side in ("source", "both", "both_flow")

    @property
    def decoder_prlms(self) -> bool:
        """Decoder layers carry PrLM branches."""
        return bool(self.prlms) and self.side != "source"

    @property
    def decoder_flow(self) -> bool:
        """Decoder layers carry PrLM flows merged at `position` (the authors' fork), not at the encoder attention."""
        return self.decoder_prlms and self.side.endswith("_flow")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A preset's sizes with `overrides` on top (None values mean "not set"); vocab_size is required."""
        _one_of("preset", name, PRESETS)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UserError(f"model config: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = dict(PRESETS[name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "vocab_size" not in values:
            raise UserError(f"model preset {name!r}: vocab_size is required (the BPE vocabulary size)")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ----------------------------------------------------------------------------- the run


@dataclass
class PrLMUse:
    """One PrLM branch of a run: which cached checkpoint, and which of its layers."""

    checkpoint: str
    # An int is a hidden_states index (-1 last, -2 penultimate, -3 third-to-last);
    # a string picks a learned combination of every layer in the cache:
    # "dyn_cls" | "dyn_aver" | "dwatt" | "concat". The default, concat, reads every cached layer.
    layer: int | str = "concat"
    # Which cache of that checkpoint to read, when the pipeline builds several (e.g. float16 and int8).
    dtype: str | None = None
    # LayerNorm the features over d_p before the branch's key and value projections. For PrLMs whose
    # hidden states are not normalized, such as a causal LM's residual stream (`cache inspect`
    # shows their scale); a BERT-style encoder's states already are.
    feature_norm: bool = False
    # None: the sentence's own features. "shuffled": another sentence's (a control; see CONTROLS).
    control: str | None = None

    def check(self) -> None:
        """SettingError (key "layer", "dtype" or "control") for a setting no cache can give."""
        if self.control is not None:
            _one_of("control", self.control, CONTROLS)
        if isinstance(self.layer, str) and self.layer not in STRING_LAYER_MODES:
            raise SettingError("layer", f"{self.layer!r} is not a layer index or one of {', '.join(STRING_LAYER_MODES)}")
        if self.dtype is not None:
            # Imported here: cache_features brings torch, which the BPE child importing this module never needs.
            from prlmfuse.cache_features.codecs import STORAGE_DTYPES

            _one_of("dtype", self.dtype, STORAGE_DTYPES)


# How match_params grows a baseline (train_fused.matching).
MATCH_BY = ("ffn", "depth")

# The least value of each integer run setting that has one (None stays allowed where the field is optional).
LEAST_VALUES = {"update_freq": 1, "max_updates": 1, "max_epochs": 1, "save_every": 1, "log_every": 1, "patience": 1,
                "min_epochs": 0, "keep_last": 1, "keep_last_epochs": 0, "warmup": 0, "bpe_vocab": MIN_VOCAB,
                "max_tokens": MIN_BATCH_TOKENS, "read_window": 0, "max_source_tokens": 2}
# What a refusal of a setting below its least value says of it, in place of its typical value.
LEAST_VALUE_NOTES = {"max_source_tokens": "N keeps the source's first N - 1 BPE tokens and </s>; null keeps them all"}

# The range [least, most) of each number of the optimisation recipe (most None: no upper bound).
NUMBER_RANGES = {"lr": (0.0, None), "label_smoothing": (0.0, 1.0), "clip_norm": (0.0, None), "weight_decay": (0.0, None)}


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
    # attn | add_norm1 | ffn | add_norm2; None: the model's default (ModelConfig: add_norm1, ffn if pre_ln).
    position: str | None = None
    # source | target | both (bert-nmt's decoder) | target_flow | both_flow (the authors'); None: the
    # model's default (both, source for merge direct).
    side: str | None = None
    dropnet_p: float = 0.5  # merge dropnet only: probability that a layer keeps one side alone
    # A run without PrLMs grown to the trainable parameters of the run of this name, within 1%
    # (train_fused.matching); the pipeline resolves it to sizes before training.
    match_params: str | None = None
    # How match_params grows the run: ffn (None: widen the FFN) | depth (n more layers on each side,
    # the DWAtt paper's Base+n, then the FFN width that lands within 1%).
    match_by: str | None = None
    # Data.
    bpe_vocab: int = 8000
    max_tokens: int = 3500  # per batch, source or target side, whichever is longer
    # Batches per optimizer update (fairseq's gradient accumulation): the effective batch is
    # update_freq * max_tokens, on one device as on several.
    update_freq: int = 1
    max_train_pairs: int | None = None  # first N training pairs only (quick runs)
    # The model's source cut to its first N BPE tokens, the last of them </s> (fairseq's
    # --max-source-positions with --truncate-source): the first N - 1 ids and </s>, alike in training, at
    # the dev evaluation and in decoding (evaluate, translate). None: whole sources. The BPE still learns
    # from whole sources, and the PrLM branches read their caches, cut at the PrLM's own limit.
    max_source_tokens: int | None = None
    # 0: batches formed over the whole training split, a batch's sentences read wherever they are
    # stored. K >= 1: batches formed within windows of about K batches' worth of sentences neighbouring
    # in the (first) PrLM cache's stored order, each window read in a few large reads; for a cache
    # larger than memory on a disk slow at small random reads. A baseline (no cache) batches the whole
    # split either way.
    read_window: int = 0
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
    compile: bool = False  # torch.compile the step's forward and loss (on CUDA captured as CUDA graphs)
    # Batches of a few fixed shapes (train_fused.buckets), so a compiled step is captured once per shape.
    static_shapes: bool = False
    # DataLoader workers reading the features; "auto": loader_workers() (more on a GPU, 2 on a CPU).
    num_workers: int | str = "auto"
    in_memory_features: bool = False

    def model_config(self, vocab_size: int, prlms: list[PrLMSpec]) -> ModelConfig:
        """The run's model: its preset resolved to sizes, its explicit overrides, the BPE vocabulary and
        one PrLMSpec per entry of `prlms`."""
        return ModelConfig.from_preset(
            self.preset,
            vocab_size=vocab_size,
            **{key: getattr(self, key) for key in MODEL_SETTINGS},
            prlms=list(prlms),
        )

    def check(self) -> None:
        """Raise SettingError for the first setting that breaks a rule of the run or of its model.

        The model's rules are ModelConfig's own: the run builds its model configuration with each
        branch as stated (`PrLMSpec.before_caching`), since no rule reads a feature shape.
        """
        low = self.below_least_value()
        if low is not None:
            raise SettingError(*low)
        for key, (least, most) in NUMBER_RANGES.items():
            value = getattr(self, key)
            if not _in_range(value, least, most):
                wanted = f">= {least:g}" if most is None else f"in [{least:g}, {most:g})"
                raise SettingError(key, f"expected a number {wanted}, got {value!r}")
        if (not isinstance(self.adam_betas, (list, tuple)) or len(self.adam_betas) != 2
                or not all(_in_range(b, 0.0, 1.0) for b in self.adam_betas)):
            raise SettingError("adam_betas", f"expected two numbers in [0, 1), e.g. [0.9, 0.98], got {self.adam_betas!r}")
        if self.max_updates is None and self.max_epochs is None:
            raise SettingError("max_updates", "set max_updates or max_epochs (or both), or training never stops")
        if self.min_epochs is not None and self.max_epochs is not None and self.min_epochs > self.max_epochs:
            raise SettingError("min_epochs", f"min_epochs {self.min_epochs} exceeds max_epochs {self.max_epochs}; "
                               "lower it or raise max_epochs")
        if self.num_workers != "auto" and (not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool)
                                           or self.num_workers < 0):
            raise SettingError("num_workers", f"expected a number of worker processes (0 or more) or auto, "
                               f"got {self.num_workers!r}")
        if self.match_by is not None:
            _one_of("match_by", self.match_by, MATCH_BY)
        if self.static_shapes and self.read_window:
            raise SettingError("static_shapes", "static_shapes batches the whole split by length class; it cannot be "
                               "combined with read_window (set read_window: 0)")
        for i, use in enumerate(self.prlms):
            try:
                use.check()
            except SettingError as e:
                raise SettingError(("prlms", i, *e.key), e.detail) from None
        model = self.model_config(self.bpe_vocab, [PrLMSpec.before_caching(use) for use in self.prlms])
        if self.max_source_tokens is not None and self.max_source_tokens > model.max_positions:
            raise SettingError("max_source_tokens", f"expected at most {model.max_positions} (the model's positions), "
                               f"got {self.max_source_tokens}")

    def below_least_value(self) -> tuple[str, str] | None:
        """(setting, "expected ..., got ...") for the first integer setting below its least value, else None."""
        for key, least in LEAST_VALUES.items():
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < least):
                wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
                default = RunConfig.__dataclass_fields__[key].default
                typical = ""
                if key in LEAST_VALUE_NOTES:
                    typical = f" ({LEAST_VALUE_NOTES[key]})"
                elif least > 1 and default is not None:
                    typical = f" ({default} is typical)"
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


def _in_range(value, least: float, most: float | None) -> bool:
    """Whether `value` is a finite number (not a bool) in [least, most) (most None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= least and (most is None or value < most)


# Settings a run hands to its ModelConfig under the same name (prlms and the preset are resolved apart).
MODEL_SETTINGS = ("d_model", "enc_layers", "dec_layers", "heads", "ffn", "dropout", "attention_dropout",
                  "activation_dropout", "feature_dropout", "pre_ln", "merge", "position", "side", "dropnet_p")


# Settings that shape only the PrLM branches: a run without PrLMs builds the same model whatever they say.
FUSION_SETTINGS = ("merge", "position", "side", "dropnet_p")


def defining_settings(settings: dict, has_prlms: bool) -> dict:
    """run.json's `train` or `model` section without the fusion settings when the run has no PrLMs, so a
    baseline is the same run whatever those say (and whatever their defaults were when it trained)."""
    return settings if has_prlms else {k: v for k, v in settings.items() if k not in FUSION_SETTINGS}


# Settings of how a run is fed, compiled and logged, never of what it trains.
FEEDING_FIELDS = frozenset({"num_workers", "in_memory_features", "compile", "tensorboard", "log_every"})


def recipe_without_seed(train: dict) -> dict:
    """A run's settings (RunConfig.to_dict(), as run.json stores them) minus name, seed and how it is fed:
    equal for the runs of one `grid: {seed: [...]}`, whichever loader or logging each had."""
    return {k: v for k, v in defining_settings(train, bool(train.get("prlms"))).items()
            if k not in ("name", "seed") and k not in FEEDING_FIELDS}


def is_baseline_seed(train: dict, baseline_train: dict) -> bool:
    """Whether a run (its `train` settings, as run.json stores them) is the baseline's recipe at some seed:
    no PrLMs and every other defining setting equal. Such runs are the baseline's family, each compared
    with the named baseline; every other run is compared with the family member of its own seed."""
    return not train.get("prlms") and recipe_without_seed(train) == recipe_without_seed(baseline_train)
