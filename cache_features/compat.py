"""Whether a cache can feed a run: its status, open-and-validate, and which stored rows a layer choice reads.

The trainer (train, dev and test caches), the evaluator (test caches) and live translation (a
private cache built from the input) all go through these functions, so a cache is accepted or
refused by the same rules wherever it is read:

- its key fields equal the ones the run trained on (checkpoint identity, dtype, truncation, ...),
  except the corpus and the compute precision, and its stored layers may be a superset;
- it was built from the source file as it is now (corpus_sha256) and holds one entry per line;
- it stores every layer (and pooled layer) the run reads;
- its shards still match their checksums (manifest.check_cache, or a full verify_cache on request).
"""

from __future__ import annotations

import json
import logging

from prlmfuse.errors import UserError

from .manifest import MANIFEST, check_cache, load_manifest, verify_cache
from .reader import CacheReader
from .location import Location

logger = logging.getLogger(__name__)

BUILT, MISSING, DAMAGED = "built", "missing", "damaged"
# A layer choice is a hidden_states index or one of these learned combinations of every cached layer.
LAYER_MODES = ("dyn_cls", "dyn_aver", "dwatt", "concat")
POOLED_MODES = ("dyn_cls", "dyn_aver")  # they also read the pooled (first token, mean) vectors

# The key field that depends on which text was encoded; the stored layers may grow; all else must match.
_CORPUS_FIELD = "corpus_sha256"
_SUPERSET_FIELDS = frozenset({"layers"})
# Which layers' pooled vectors a cache holds: the stored layers, or in some caches every layer up to the
# highest. Either serves a run that reads the same features; layer_rows checks the pooled layers it reads.
_POOLED_FIELD = "pooled_layers"
# How the features were computed (bf16 / fp16 / fp32 autocast), not what they are: caches that differ
# only in it are interchangeable within rounding.
_PRECISION_FIELD = "precision"


def precision_of(fields: dict) -> str:
    """The compute precision a cache's key fields record: bf16, fp16 or fp32."""
    return str(fields.get(_PRECISION_FIELD))


def stored_fields(location, fields: dict, *, adopt_precision: bool = True) -> dict | None:
    """The key fields of the cache at `location` that a build of `fields` takes instead of its own; None
    if there is none.

    adopt_precision (a build that did not ask for a precision): a cache, complete or a build under way,
    that differs only in its precision is reused (or resumed), so a workdir built on one machine serves
    another without --force. A complete cache that keeps the pooled vectors of more layers than
    `fields` (a cache may keep those of every layer up to its highest) holds everything the build would
    write, and is reused as it is.
    """
    from .manifest import BUILD_RECORD

    for name in (MANIFEST, BUILD_RECORD):
        try:
            found = json.loads(location.read_bytes(name)).get("key_fields")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(found, dict):
            continue
        ignored = {_PRECISION_FIELD} if adopt_precision else set()
        if name == MANIFEST and _keeps_pooled(found, fields) and _is_complete(location):
            ignored.add(_POOLED_FIELD)
        strip = lambda f: {k: v for k, v in f.items() if k not in ignored}  # noqa: E731
        if strip(found) == strip(fields):
            return found
    return None


def _keeps_pooled(found: dict, fields: dict) -> bool:
    """Whether key fields `found` list the pooled layers of `fields`, and maybe more."""
    try:
        return set(fields[_POOLED_FIELD]) <= set(found.get(_POOLED_FIELD) or [])
    except TypeError:  # a hand-edited manifest: not a cache to reuse
        return False


def _is_complete(location) -> bool:
    """A manifest that load_manifest accepts: complete, with a sound shard list."""
    try:
        load_manifest(location)
    except UserError:
        return False
    return True


def cache_status(path: str) -> tuple[str, str]:
    """(BUILT | MISSING | DAMAGED, why) of the cache at `path` (a directory or fsspec URL), by its manifest.

    No manifest, or one not marked complete, is a cache not built yet; a manifest that is there
    but truncated or not JSON is damaged, and `why` says how.
    """
    try:
        data = Location(path).read_bytes(MANIFEST)
    except (FileNotFoundError, IsADirectoryError):
        return MISSING, ""
    try:
        manifest = json.loads(data)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        return DAMAGED, getattr(e, "msg", None) or str(e)
    if not isinstance(manifest, dict):
        return DAMAGED, "not a JSON object"
    return (BUILT if manifest.get("complete", False) else MISSING), ""


def check_key_fields(found: dict, expected: dict, *, where: str) -> None:
    """Refuse a cache whose key fields differ from `expected` (the training cache's) other than in its corpus."""
    if precision_of(found) != precision_of(expected):
        logger.warning("cache %s was computed at %s, the run's training cache at %s: features differ by rounding",
                       where, precision_of(found), precision_of(expected))
    for name in sorted((set(expected) | set(found)) - {_CORPUS_FIELD, _PRECISION_FIELD, _POOLED_FIELD}):
        want, have = expected.get(name), found.get(name)
        if name in _SUPERSET_FIELDS:
            if not set(want or []) <= set(have or []):
                raise UserError(
                    f"cache {where} stores {name} {have} but the run trained on {want}; "
                    "rebuild the cache with the run's layers"
                )
        elif want != have:
            raise UserError(
                f"cache {where} does not match the run's training cache: key field {name!r} is "
                f"{have!r}, the run trained with {want!r}; rebuild the cache to match"
            )


def open_cache(
    path: str,
    *,
    expected_fields: dict | None,
    source: str,
    source_name: str,
    source_sha256: str,
    source_lines: int,
    verify: bool = False,
) -> CacheReader:
    """The cache at `path`, checked to hold features of the file `source` (its sha256 and line count).

    source_name: what the file is, for messages ("train source").
    expected_fields: key fields the cache must match (those of the cache the run trained on);
    None for the training cache itself. Every shard is checked against its checksum first
    (`check_cache`: a stat per file when nothing changed since the cache last passed);
    verify=True re-hashes every shard whatever was remembered.
    """
    # The path is parsed and the manifest read once, here, and the reader opened on what was checked.
    location, manifest = verify_cache(path) if verify else check_cache(path)
    reader = CacheReader(location, manifest=manifest)
    fields = dict(reader.manifest["key_fields"])
    if fields.get(_CORPUS_FIELD) != source_sha256:
        raise UserError(
            f"cache {path} was built from a different {source_name} (cache corpus_sha256 "
            f"{str(fields.get(_CORPUS_FIELD))[:16]}, {source} sha256 {source_sha256[:16]}); rebuild the cache "
            "for this corpus (prlmfuse run --only cache)"
        )
    if reader.num_sentences != source_lines:
        raise UserError(
            f"cache {path} holds {reader.num_sentences} sentences but {source} has {source_lines} lines; "
            "rebuild the cache for this corpus"
        )
    if expected_fields is not None:
        check_key_fields(fields, expected_fields, where=path)
    return reader


def choose_layers(layer: int | str, key_fields: dict, *, checkpoint: str, where: str) -> tuple[list[int], list[int], str]:
    """What a run's layer choice reads from a cache with these key fields.

    Returns (hidden_states indices of the token features, in the order the model reads them;
    pooled layers it reads, empty unless Dyn[CLS]/Dyn[Aver], which read the token layers' own pooled rows
    and never layer 0; layer mode: "fixed" or one of LAYER_MODES).
    """
    cache_layers = [int(x) for x in key_fields["layers"]]
    pooled = [int(x) for x in key_fields["pooled_layers"]]
    num_layers = int(key_fields["num_layers"])
    if isinstance(layer, str):
        if layer not in LAYER_MODES:
            raise UserError(f"PrLM {checkpoint}: layer {layer!r} is not a layer index or one of {', '.join(LAYER_MODES)}")
        if layer not in POOLED_MODES:
            return cache_layers, [], layer
        if not pooled:
            raise UserError(f"cache {where} has no pooled vectors, which layer {layer} needs; rebuild it")
        # Park & Zhao weigh the transformer layers 1..L, not the embedding layer: the cache keeps
        # storing hidden_states 0 (DWAtt and Concat read it), this choice reads the rows after it.
        transformer = [x for x in cache_layers if x != 0]
        if not transformer:
            raise UserError(f"PrLM {checkpoint}: layer {layer} weighs the transformer layers 1..{num_layers}, but cache "
                            f"{where} holds only layers {cache_layers}; cache it with layers: all")
        return transformer, transformer, layer
    if not -(num_layers + 1) <= layer <= num_layers:
        # Rebuilding the cache cannot help here, so say which indices exist rather than "not in cache".
        raise UserError(
            f"PrLM {checkpoint}: layer {layer} is outside its hidden states; valid range is {-(num_layers + 1)}.."
            f"{num_layers} (0 = embeddings, {num_layers} = last of {num_layers} layers, negative counts from the end)"
        )
    absolute = layer if layer >= 0 else num_layers + 1 + layer
    if absolute not in cache_layers:
        raise UserError(
            f"PrLM {checkpoint}: layer {layer} (hidden_states index {absolute} of {num_layers} layers) is "
            f"not in cache {where}, which holds layers {cache_layers}; rebuild the cache with that layer"
        )
    return [absolute], [], "fixed"


def layer_rows(
    reader: CacheReader, layers: list[int], pooled_layers: list[int], *, where: str
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Rows of `reader.features(i)` (and of `reader.pooled(i)`, None if no pooled layer is read) that hold
    exactly `layers` (and `pooled_layers`), in that order: a cache may store more than the run reads."""
    missing = [x for x in layers if x not in reader.layers]
    if missing or not layers:
        raise UserError(
            f"cache {where} stores layers {list(reader.layers)} but the run was trained on {list(layers)}; "
            "rebuild the cache with the run's layers"
        )
    rows = tuple(reader.layers.index(x) for x in layers)
    if not pooled_layers:
        return rows, None
    if any(x not in reader.pooled_layers for x in pooled_layers):
        raise UserError(f"cache {where} has pooled layers {list(reader.pooled_layers)}, the run needs "
                        f"{list(pooled_layers)}; rebuild it")
    return rows, tuple(reader.pooled_layers.index(x) for x in pooled_layers)
