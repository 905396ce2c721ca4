"""A PrLM branch resolved against a cache: the one form in which a branch travels from config to batch.

`PrLMUse` (config) says what the user asks for; `open_branch` opens the cache of one split,
checks it with cache_features' rules and returns a `PrLMBranch`: the reader, the rows of it the
model reads, the model's `PrLMSpec`, and the branch's run.json record. The trainer opens one per
split, the evaluator one per test set, live translation one over its private cache; batches read
features through `train_fused.data.batch_features(branch, ...)` into `PrLMFeatures`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prlmfuse.cache_features import CacheReader, choose_layers, layer_rows, open_cache
from prlmfuse.cache_features.compat import POOLED_MODES
from prlmfuse.errors import UserError
from prlmfuse.train_fused.config import PrLMSpec, PrLMUse


@dataclass(frozen=True)
class PrLMBranch:
    """One PrLM branch of a run over the cache of one split."""

    reader: CacheReader
    layer_rows: tuple[int, ...]  # rows of reader.features(i) fed to the model, in its order
    pooled_rows: tuple[int, ...] | None  # rows of reader.pooled(i) for Dyn[CLS]/Dyn[Aver]; None if unused
    # The model's view of the branch, and run.json's record of it: checkpoint, layer, layers and
    # pooled_layers read (hidden_states indices), layer_mode, the key_fields of the training cache.
    # open_branch fills both; a branch over a hand-made reader (a bench's) may go without.
    spec: PrLMSpec | None = None
    record: dict = field(default_factory=dict)


def open_branch(
    use: PrLMUse,
    path: str,
    *,
    trained: dict | None,
    source: str,
    source_name: str,
    source_sha256: str,
    source_lines: int,
    verify: bool = False,
    in_memory: bool = False,
) -> PrLMBranch:
    """Open the cache at `path` for the branch `use`, checked against the file `source` it must encode
    (`source_name` says which, for messages: "train source").

    trained: the branch's run.json record when the run's layers and training cache are known
    (dev and test caches, evaluation, live features): the cache must match its key fields and hold
    its layers. None for the training cache itself, which decides them from `use.layer`.
    """
    reader = open_cache(
        path, expected_fields=None if trained is None else trained["key_fields"], source=source,
        source_name=source_name, source_sha256=source_sha256, source_lines=source_lines, verify=verify, in_memory=in_memory,
    )
    fields = dict(reader.manifest["key_fields"])
    if trained is None:
        if use.dtype is not None and fields["dtype"] != use.dtype:
            raise UserError(
                f"cache {path} stores {fields['dtype']} features but the run asks for dtype {use.dtype}; "
                "pass the matching cache or change the run's dtype"
            )
        layers, pooled, mode = choose_layers(use.layer, fields, checkpoint=use.checkpoint, where=path)
        record = {"checkpoint": use.checkpoint, "layer": use.layer, "layers": layers, "pooled_layers": pooled,
                  "layer_mode": mode, "key_fields": fields}
    else:
        record = trained
        layers, pooled, mode = list(trained["layers"]), list(trained["pooled_layers"]), trained["layer_mode"]
    rows, pooled_rows = layer_rows(reader, layers, pooled, where=path)
    spec = PrLMSpec(
        name=str(fields["checkpoint"]),
        width=int(fields["hidden_size"]),
        num_layers=len(layers),
        num_pooled=len(pooled),
        layer_mode=mode,
        feature_norm=use.feature_norm,
        # The cache's pooled layers may be more than its token layers: each token layer's own row.
        pooled_index=[pooled.index(x) for x in layers] if mode in POOLED_MODES else None,
    )
    return PrLMBranch(reader=reader, layer_rows=rows, pooled_rows=pooled_rows, spec=spec, record=record)
