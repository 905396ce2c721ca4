"""Typed objects from parsed YAML: each value checked against a dataclass field's annotation, each
complaint one line naming the file, line and column of the value (`Where`), as pipeline.yaml's reader
(`prlmfuse.config`) states every error."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from prlmfuse.errors import UserError


class Where:
    """Maps a key path to the (line, column) where it stands in the YAML file."""

    def __init__(self, path: Path, root: yaml.Node | None):
        self.path = path
        self.marks: dict[tuple, tuple[int, int]] = {}
        # Each plain (unquoted) scalar's text as written: YAML 1.1 reads some (1:00:00) as numbers.
        self.plain: dict[tuple, str] = {}
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, keypath: tuple) -> None:
        self.marks[keypath] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.ScalarNode) and not node.style:
            self.plain[keypath] = node.value
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                sub = keypath + (k.value,)
                self._walk(v, sub)
                self.marks[sub + ("<key>",)] = (k.start_mark.line + 1, k.start_mark.column + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, keypath + (i,))

    def error(self, keypath: tuple, message: str, at_key: bool = False) -> UserError:
        mark = None
        if at_key:
            mark = self.marks.get(keypath + ("<key>",))
        probe = keypath
        while mark is None and probe is not None:
            mark = self.marks.get(probe)
            probe = probe[:-1] if probe else None
        where = f"{self.path}:{mark[0]}:{mark[1]}" if mark else str(self.path)
        dotted = ".".join(str(p) for p in keypath if p != "<key>") or "(top level)"
        return UserError(f"{where}: {dotted}: {message}")


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is Path:
        return "a path"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def coerce(value: Any, tp: Any, keypath: tuple, where: Where, base_dir: Path) -> Any:
    """Check `value` against the type annotation `tp` and convert it; errors name the key path."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        last: UserError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, keypath, where, base_dir)
            except UserError as e:
                last = e
        if dataclasses.is_dataclass(next((a for a in args if a is not type(None)), None)) and last:
            raise last
        raise where.error(keypath, f"expected {type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise where.error(keypath, f"expected {type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [coerce(v, item, keypath + (i,), where, base_dir) for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list) or len(value) != len(args):
            raise where.error(keypath, f"expected a list of {len(args)} numbers, got {value!r}")
        return tuple(coerce(v, a, keypath + (i,), where, base_dir) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise where.error(keypath, f"expected a mapping, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, keypath, where, base_dir)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 7e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, str) and value:
            p = Path(value).expanduser()
            return p if p.is_absolute() else (base_dir / p)
    elif tp is Any:
        return value
    raise where.error(keypath, f"expected {type_name(tp)}, got {value!r}")


def build(cls: type, value: Any, keypath: tuple, where: Where, base_dir: Path, extra: dict | None = None):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise where.error(keypath, f"expected a mapping, got {value!r}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "path"]
    kwargs: dict[str, Any] = dict(extra or {})
    for key, v in value.items():
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
            raise where.error(keypath + (key,), f"unknown key{hint}", at_key=True)
        kwargs[key] = coerce(v, hints[key], keypath + (key,), where, base_dir)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.name not in kwargs
        and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise where.error(keypath, f"missing required key {missing[0]!r}")
    return cls(**kwargs)


def check_choice(value: Any, choices: tuple, keypath: tuple, where: Where) -> None:
    if value not in choices:
        raise where.error(keypath, f"{value!r} is not one of {', '.join(map(str, choices))}")
