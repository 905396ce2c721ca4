"""The wheels of an offline bundle: what prlmfuse needs that the node's image lacks, for the node's Python
and platform, pinned to the versions installed here where the node can have them (prlmfuse.bundle uses it).

The node's image is taken to hold NODE_PACKAGES and their dependencies (as installed here); the
packages to bundle are the closure of prlmfuse's requirements over the wheels' own metadata.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from prlmfuse.errors import UserError

logger = logging.getLogger(__name__)

SOURCE_TREE = Path(__file__).resolve().parent.parent

# What a stock PyTorch/CUDA image with transformers holds; their dependencies count as present too.
NODE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "h5py", "numpy", "pyyaml", "click",
                 "tqdm", "matplotlib", "sacrebleu", "pytest")

# What the node loses without a package the bundle cannot carry; others get a generic line.
_MEANS = {
    "mecab-python3": "no Japanese BLEU (ja-mecab) on the node: its evaluate stage stops on a Japanese target; "
                     "score on a machine with mecab (docs/cluster.md: Offline GPU nodes)",
    "ipadic": "no Japanese BLEU (ja-mecab) on the node, as without mecab-python3",
    "zarr": "no zarr caches on the node: set `cache: backend: hdf5` in pipeline.yaml (or `cache build --backend hdf5`)",
    "rouge-score": "`evaluate` cannot be imported on the node; decode and score on another machine",
    "gguf": "smollm2-135m cannot be converted on the node (a bundled checkpoint needs no conversion)",
}

_PYTHON = re.compile(r"^3\.(\d{1,2})$")
_PLATFORM = re.compile(r"^(?:(manylinux|musllinux)_(\d+)_(\d+)|manylinux2014|linux)_(x86_64|aarch64|ppc64le|s390x)$")
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


def resolve_wheels(target: Target, downloads: Path, *, with_ja: bool = False,
                   leave_out: tuple[str, ...] = ()) -> tuple[list[Path], list[Path], list[Lacking]]:
    """(runtime wheels, build wheels, what the node lacks) for prlmfuse's requirements.

    sacrebleu's Japanese extras (MeCab and its IPA dictionary, about 14 MiB) come only `with_ja`: beside a
    checkpoint they would not fit the node's copy limit. `leave_out` names packages not to carry, with what
    only they need: ones the node's image holds beyond NODE_PACKAGES, or ones its steps do without.
    """
    project = _project()
    env = target.marker_env()
    downloads.mkdir(parents=True, exist_ok=True)
    left = {canonicalize_name(n) for n in leave_out}
    runtime = _Wheels(target, downloads, node_present(target) | left)
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
    left_out.update({name: "left out (--leave-out): the node's image holds it, or the node does without it"
                     for name in left})
    lacking = {**build.lacking, **runtime.lacking, **left_out}
    rows = []
    for name, why in sorted(lacking.items()):
        means = _MEANS.get(name) or next(
            (f"{dep} cannot be installed on the node" for dep, deps in runtime.deps.items() if name in deps and dep in _MEANS),
            "prlmfuse features that import it fail on the node")
        rows.append(Lacking(name, why, means))
    return runtime.closure(wanted), build.closure(build_ok), rows
