"""Stage one: run a frozen pretrained LM once over a corpus and cache its hidden states.

    from prlmfuse.cache_features import build_cache, CacheReader
    result = build_cache("minilm-l6", "corpus/train.src", "caches/minilm-train", layers="-2")
    reader = CacheReader(result.path)
    reader.features(0)   # float32 [n_layers, T_0, d]
    reader.pooled(0)     # float32 [n_pooled_layers, 2, d]  (first token, mean) of the stored layers

Modules: extract (tokenize, middle cut, plan, forward through a truncated model view), codecs
(storage dtypes), location (local path or fsspec URL), shards (HDF5 / Zarr v3 shard files,
checksums), manifest (cache key, manifest, check/verify/inspect), build_directory (lock, reuse/resume),
background_writer, builder (build_cache, torchrun), reader (CacheReader, feature_scale),
compat (cache status, open-and-validate against a run, layer rows).
"""

from .builder import CacheResult, build_cache
from .compat import cache_status, check_key_fields, choose_layers, layer_rows, open_cache
from .extract import parse_layers
from .manifest import cache_key, check_cache, inspect_cache, verify_cache
from .reader import CacheReader, feature_scale, in_memory_bytes
from .codecs import STORAGE_DTYPES
from .shards import BACKENDS

__all__ = [
    "BACKENDS",
    "STORAGE_DTYPES",
    "CacheReader",
    "CacheResult",
    "build_cache",
    "cache_key",
    "cache_status",
    "check_cache",
    "check_key_fields",
    "choose_layers",
    "feature_scale",
    "in_memory_bytes",
    "inspect_cache",
    "layer_rows",
    "open_cache",
    "parse_layers",
    "verify_cache",
]
