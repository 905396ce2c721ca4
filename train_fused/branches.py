"""A PrLM branch resolved against a cache: the one form in which a branch travels from config to batch.

`PrLMUse` (config) says what the user asks for; `open_branch` opens the cache of one split,
checks it with cache_features' rules and returns a `PrLMBranch`: the reader, the rows of it the
model reads, the model's `PrLMSpec`, and the branch's run.json record. The trainer opens one per
split, the evaluator one per test set, live translation one over its private cache; batches read
features through `train_fused.data.batch_features(branch, ...)` into `PrLMFeatures`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prlmfuse.cache_features import CacheReader, choose_layers, layer_rows, open_cache
from prlmfuse.cache_features.compat import POOLED_MODES
from prlmfuse.errors import UserError
from prlmfuse.fileio import read_lines
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
    # control "shuffled": the cache row each sentence of the split reads (shuffled_rows); None: its own.
    rows: np.ndarray | None = None


def branch_spec(use: PrLMUse, hidden_size: int, layers: list[int], pooled: list[int], mode: str,
                name: str | None = None) -> PrLMSpec:
    """The model's view of a branch that reads these hidden_states indices (`compat.choose_layers`);
    `name` is the checkpoint as its cache records it (default: as the run names it)."""
    return PrLMSpec(
        name=name or use.checkpoint,
        width=int(hidden_size),
        num_layers=len(layers),
        num_pooled=len(pooled),
        layer_mode=mode,
        feature_norm=use.feature_norm,
        # The cache's pooled layers may be more than its token layers: each token layer's own row.
        pooled_index=[pooled.index(x) for x in layers] if mode in POOLED_MODES else None,
    )


# Mixed into the run's seed, so the permutation is not the batch order's or the initialisation's stream.
_SHUFFLE_STREAM = 0x5348_5546


def shuffled_rows(lines: list[str], seed: int, *, where: str) -> np.ndarray:
    """rows[i]: the sentence whose features sentence i reads under control "shuffled".

    One permutation of the split drawn from `seed`, repaired so that no sentence reads its own
    features nor those of a sentence with the same source text. It depends only on the split's lines
    and the seed: every epoch, the dev evaluation, test decoding, a resumed run and every PrLM of the
    run read the same one.
    """
    n = len(lines)
    _, text = np.unique(np.asarray(lines, dtype=object), return_inverse=True)
    if n == 0 or np.bincount(text).max() * 2 > n:
        raise UserError(f"{where}: control 'shuffled' needs a split where no source text fills more than half the "
                        f"lines ({n} lines here); remove the control or use a larger split")
    rng = np.random.default_rng([int(seed), _SHUFFLE_STREAM])
    rows = rng.permutation(n)
    for i in np.flatnonzero(text[rows] == text):
        # Swap with a random j where both sentences then read another text: a swap never undoes an earlier fix.
        while True:
            j = int(rng.integers(n))
            if text[rows[j]] != text[i] and text[rows[i]] != text[j]:
                rows[i], rows[j] = rows[j], rows[i]
                break
    return rows


def open_branch(
    use: PrLMUse,
    path: str,
    *,
    trained: dict | None,
    source: str,
    source_name: str,
    source_sha256: str,
    source_lines: int,
    seed: int,
    verify: bool = False,
    in_memory: bool = False,
) -> PrLMBranch:
    """Open the cache at `path` for the branch `use`, checked against the file `source` it must encode
    (`source_name` says which, for messages: "train source").

    trained: the branch's run.json record when the run's layers and training cache are known
    (dev and test caches, evaluation, live features): the cache must match its key fields and hold
    its layers. None for the training cache itself, which decides them from `use.layer`.
    seed: the run's, from which control "shuffled" draws the split's permutation.
    in_memory: hold the layers the branch reads in memory, not the rest of the cache.
    """
    reader = open_cache(
        path, expected_fields=None if trained is None else trained["key_fields"], source=source,
        source_name=source_name, source_sha256=source_sha256, source_lines=source_lines, verify=verify,
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
    if in_memory:
        reader.hold_in_memory(layers, pooled=bool(pooled))
    spec = branch_spec(use, int(fields["hidden_size"]), layers, pooled, mode, name=str(fields["checkpoint"]))
    sentence_rows = None
    if use.control == "shuffled":
        sentence_rows = shuffled_rows(read_lines(source), seed, where=source_name)
    return PrLMBranch(reader=reader, layer_rows=rows, pooled_rows=pooled_rows, spec=spec, record=record,
                      rows=sentence_rows)
