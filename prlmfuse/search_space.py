"""pipeline.yaml's `search:` section, checked when the file is read: a finite grid of run settings over a
base run, the full and the least budget, and the pruner that stops the weak settings early.

    search:
      name: fusion                  # trials are runs/fusion-001, ...; the study is workdir/search/fusion/
      base: fused                   # a run of train.runs to vary (default: train.defaults)
      space:                        # every combination is one trial (a grid, trained once each)
        layer: [-2, concat, dwatt]  # of the base's PrLM branch; -2 is the penultimate layer
        side: [source, both]
        lr: [7e-4, 1e-3]
      max_updates: 3000             # the full budget (or max_epochs)
      min_updates: 250              # the least budget: the first rung (or min_epochs)
      pruner: successive_halving    # or hyperband
      reduction_factor: 3           # each rung keeps about 1/3 of the trials that reach it
      jobs: 2                       # trials trained at once (--jobs overrides it)

Rungs fall at min × factor^k updates (or epochs) below the full budget; a trial is evaluated on dev at
each (prlmfuse.search adds those evaluations) and reports its dev loss to the pruner there. Nothing
here imports optuna or torch: prlmfuse.search runs the study.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prlmfuse.errors import SettingError
from prlmfuse.train_fused.config import PrLMUse, RunConfig

# What a search may vary: the base's (one) PrLM branch's checkpoint and layer, the fusion settings, and two
# numbers of the recipe.
SPACE_TYPES: dict[str, Any] = {
    "checkpoint": str, "layer": int | str, "merge": str, "position": str, "side": str, "lr": float, "dropout": float,
}
SPACE_KEYS = tuple(SPACE_TYPES)
PRLM_KEYS = ("checkpoint", "layer")
PRUNERS = ("successive_halving", "hyperband")
# Trials are named NAME-001 ...: three digits.
MAX_SETTINGS = 999


@dataclass
class SearchConfig:
    name: str = "search"
    base: str | None = None  # a run of train.runs; None: train.defaults
    space: dict[str, Any] = field(default_factory=dict)
    max_updates: int | None = None  # the full budget, in updates...
    min_updates: int | None = None  # ...and the least (the first rung)
    max_epochs: int | None = None  # or in epochs
    min_epochs: int | None = None
    pruner: str = "successive_halving"
    reduction_factor: int = 3
    jobs: int = 1  # trials trained at once
    # Set when read: the grid's settings in order, one trial run each, and the base run they vary.
    settings: list[dict[str, Any]] = field(default_factory=list, init=False)
    trials: list[RunConfig] = field(default_factory=list, init=False)
    base_run: RunConfig | None = field(default=None, init=False)

    @property
    def unit(self) -> str:
        """What the budgets count: updates or epochs."""
        return "updates" if self.max_updates is not None else "epochs"

    @property
    def full(self) -> int:
        return self.max_updates if self.max_updates is not None else self.max_epochs

    @property
    def least(self) -> int:
        return self.min_updates if self.max_updates is not None else self.min_epochs

    @property
    def rungs(self) -> list[int]:
        """The budgets at which the pruner compares trials: least × factor^k below the full budget."""
        out, step = [], self.least
        while step < self.full:
            out.append(step)
            step *= self.reduction_factor
        return out

    def trial_name(self, index: int) -> str:
        return f"{self.name}-{index + 1:03d}"

    @property
    def confirm_names(self) -> tuple[str, str, str]:
        """The runs `search --confirm` trains: the winner, the plain baseline, the baseline matched to the winner."""
        return f"{self.name}-best", f"{self.name}-baseline", f"{self.name}-baseline-matched"

    def budget(self) -> dict[str, int | None]:
        """The RunConfig fields of a trial's (and a confirmed run's) full budget. The base run's patience (and its
        min_epochs) is cleared: a trial stopped early would be recorded finished below the full budget, its dev
        loss compared with trials trained to the end."""
        stop = {"patience": None, "min_epochs": None}
        if self.unit == "updates":
            return {"max_updates": self.max_updates, "max_epochs": None, **stop}
        return {"max_updates": None, "max_epochs": self.max_epochs, **stop}

    def trial_run(self, setting: dict[str, Any], name: str) -> RunConfig:
        """The base run with `setting` applied, named `name`, trained to the full budget."""
        return vary(self.base_run, setting, name, self.budget())

    def confirm_runs(self, setting: dict[str, Any]) -> list[RunConfig]:
        """The winner (`setting`), the plain baseline (the winner's recipe without PrLMs) and that baseline
        matched to the winner's trainable parameters, each trained to the full budget."""
        best_name, baseline_name, matched_name = self.confirm_names
        best = self.trial_run(setting, best_name)
        baseline = dataclasses.replace(best, name=baseline_name, prlms=[], match_params=None, match_by=None)
        matched = dataclasses.replace(baseline, name=matched_name, match_params=best_name, ffn=None,
                                      match_by=self.base_run.match_by)
        return [best, baseline, matched]

    def describe(self, setting: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in setting.items())

    def warnings(self) -> list[str]:
        """What makes this search's ranking say little, in words (the driver logs them, --dry-run prints them)."""
        out = []
        warmup = max((t.warmup for t in self.trials), default=0)
        if self.unit == "updates" and self.least < 2 * warmup:
            out.append(f"min_updates {self.least} is below twice the trials' warmup ({warmup} updates): the first rung "
                       "ranks the trials near the learning rate's peak, which says little about where they end; set "
                       f"min_updates to {2 * warmup} or more (or a shorter warmup)")
        return out


def vary(base: RunConfig, setting: dict[str, Any], name: str, budget: dict[str, int | None]) -> RunConfig:
    """`base` with the values of `setting`: checkpoint and layer go to its (one) PrLM branch."""
    prlms = [dataclasses.replace(use) for use in base.prlms]
    if "checkpoint" in setting:
        prlms = ([dataclasses.replace(prlms[0], checkpoint=setting["checkpoint"])] if prlms
                 else [PrLMUse(checkpoint=setting["checkpoint"])])
    if "layer" in setting:
        prlms[0] = dataclasses.replace(prlms[0], layer=setting["layer"])
    changes = {k: v for k, v in setting.items() if k not in PRLM_KEYS}
    return dataclasses.replace(base, name=name, prlms=prlms, **changes, **budget)


def read_search(raw: Any, where, base_dir: Path, *, cache, runs: list[RunConfig], defaults: dict) -> SearchConfig:
    """The search section, every value checked where it is written (file:line:col): unknown keys with the
    closest valid key, each value of the space by the rules of a run, the cached layers of each checkpoint."""
    from prlmfuse.yaml_fields import build, check_choice, coerce

    top = ("search",)
    if not isinstance(raw, dict):
        raise where.error(top, f"expected a mapping with keys {', '.join(_keys())}, got {raw!r}")
    raw = dict(raw)
    raw_space = raw.pop("space", None)
    search = build(SearchConfig, raw, top, where, base_dir)
    name = search.name
    if name in (".", "..") or "/" in name or not name.strip() or any(c.isspace() for c in name):
        raise where.error(top + ("name",), f"{name!r} cannot name run directories; use letters, digits, '-', '_' or '.'")
    check_choice(search.pruner, PRUNERS, top + ("pruner",), where)
    for key, least in (("reduction_factor", 2), ("jobs", 1)):
        if getattr(search, key) < least:
            raise where.error(top + (key,), f"expected an integer >= {least}, got {getattr(search, key)}")
    _check_budget(search, where)

    # The base run: a run of train.runs, or train.defaults.
    by_name = {r.name: r for r in runs}
    if search.base is not None:
        if search.base not in by_name:
            close = difflib.get_close_matches(search.base, list(by_name), n=1)
            raise where.error(top + ("base",), f"no run named {search.base!r} in train.runs"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        base = by_name[search.base]
        if base.match_params is not None:
            raise where.error(top + ("base",), f"{base.name!r} is matched to {base.match_params!r}; a search varies a "
                              "run with its own settings (--confirm trains the matched baseline of the winner)")
    else:
        base = build(RunConfig, dict(defaults), ("train", "defaults"), where, base_dir, {"name": name})
    base_at = top + ("base",) if search.base is not None else ("train", "defaults")

    # The space: each key a non-empty list of distinct values of the setting's type.
    if not isinstance(raw_space, dict) or not raw_space:
        raise where.error(top + ("space",), "expected a mapping of setting to a list of values, e.g. "
                          "{layer: [-2, concat], side: [source, both]}; settings: " + ", ".join(SPACE_KEYS))
    space: dict[str, list] = {}
    for key, values in raw_space.items():
        if key not in SPACE_TYPES:
            close = difflib.get_close_matches(str(key), SPACE_KEYS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; a search varies {', '.join(SPACE_KEYS)}"
            raise where.error(top + ("space", key), f"unknown setting{hint}", at_key=True)
        if not isinstance(values, list) or not values:
            raise where.error(top + ("space", key), f"expected a non-empty list of values, got {values!r}")
        typed = [coerce(v, SPACE_TYPES[key], top + ("space", key, i), where, base_dir) for i, v in enumerate(values)]
        dup = next((i for i, v in enumerate(typed) if typed.index(v) != i), None)
        if dup is not None:
            raise where.error(top + ("space", key, dup), f"{typed[dup]!r} appears twice; each value is one setting")
        space[key] = typed
    search.space = space

    varies_prlm = any(k in space for k in PRLM_KEYS)
    if len(base.prlms) > 1 and varies_prlm:
        key = next(k for k in PRLM_KEYS if k in space)
        raise where.error(top + ("space", key), f"the base run fuses {len(base.prlms)} PrLMs; a search varies the "
                          "checkpoint and layer of one: name a base run with one PrLM", at_key=True)
    if not base.prlms and "checkpoint" not in space:
        raise where.error(base_at, f"{'run ' + repr(base.name) if search.base else 'train.defaults'} has no PrLM; "
                          "add checkpoint to search.space or name a base run with prlms")

    keys = list(space)
    settings = [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]
    if len(settings) > MAX_SETTINGS:
        raise where.error(top + ("space",), f"{len(settings)} settings; a search trains each at least to its least "
                          f"budget, and names them NAME-001 to NAME-{MAX_SETTINGS}: vary fewer at once")
    search.base_run = base
    search.settings = settings
    search.trials = []
    for i, setting in enumerate(settings):
        trial = search.trial_run(setting, search.trial_name(i))
        try:
            trial.check()
        except SettingError as e:
            key = e.key[0] if e.key[0] in setting else ("layer" if e.key[0] == "prlms" and "layer" in setting else None)
            for other in (e.key[0], *e.also):
                if key is None and other in setting:
                    key = other
            at = top + ("space", key, search.space[key].index(setting[key])) if key is not None else base_at
            raise where.error(at, f"setting {i + 1} ({search.describe(setting)}): {e.detail}") from None
        _check_cached(trial, setting, i, search, cache, where, base_at)
        search.trials.append(trial)

    taken = {r.name for r in runs}
    mine = [t.name for t in search.trials] + list(search.confirm_names)
    clash = next((n for n in mine if n in taken), None)
    if clash is not None:
        raise where.error(top + ("name",), f"the search's run {clash!r} is also a run of train.runs; give the search "
                          "another name")
    return search


def _keys() -> list[str]:
    return [f.name for f in dataclasses.fields(SearchConfig) if f.init]


def _check_budget(search: SearchConfig, where) -> None:
    top = ("search",)
    if (search.max_updates is None) == (search.max_epochs is None):
        raise where.error(top, "set the full budget: max_updates (with min_updates) or max_epochs (with min_epochs)")
    unit = search.unit
    full_key, least_key = ("max_updates", "min_updates") if unit == "updates" else ("max_epochs", "min_epochs")
    other = "min_epochs" if unit == "updates" else "min_updates"
    if getattr(search, other) is not None:
        raise where.error(top + (other,), f"{other} goes with max_{other[4:]}; this search counts {unit} "
                          f"(set {least_key})", at_key=True)
    full, least = getattr(search, full_key), getattr(search, least_key)
    if full < 1:
        raise where.error(top + (full_key,), f"expected a positive integer, got {full}")
    if least is None:
        raise where.error(top, f"set {least_key}: the least budget, where the pruner first compares the trials")
    if not 1 <= least < full:
        raise where.error(top + (least_key,), f"expected an integer from 1 to {full - 1} (below {full_key} {full}), "
                          f"got {least}")


def _check_cached(trial: RunConfig, setting: dict, index: int, search: SearchConfig, cache, where, base_at) -> None:
    """The trial's PrLM branch reads a cached checkpoint, and a layer the cache stores (a learned combination:
    more than one stored layer), as pipeline.yaml's runs are held to."""
    top = ("search", "space")
    for use in trial.prlms:
        entries = [(j, ck) for j, ck in enumerate(cache.checkpoints) if ck.name == use.checkpoint
                   and (use.dtype is None or (ck.dtype or cache.dtype) == use.dtype)]
        if not entries:
            names = sorted({ck.name for ck in cache.checkpoints})
            close = difflib.get_close_matches(use.checkpoint, names, n=1)
            at = (top + ("checkpoint", search.space["checkpoint"].index(use.checkpoint)) if "checkpoint" in setting
                  else base_at)
            raise where.error(at, f"{use.checkpoint!r} is not in cache.checkpoints"
                              + (f"; did you mean {close[0]!r}?" if close else "; add it to cache.checkpoints"))
        layer_at = top + ("layer", search.space["layer"].index(use.layer)) if "layer" in setting else base_at
        stored = [ck.layers for _, ck in entries]
        if isinstance(use.layer, str) and all(layers != "all" and len(layers) < 2 for layers in stored):
            j, ck = entries[0]
            raise where.error(layer_at, f"{use.layer!r} combines the cached layers, but cache.checkpoints.{j} "
                              f"({ck.name}) stores only {ck.layers}; set its layers: all")
        if (isinstance(use.layer, int) and all(layers != "all" for layers in stored)
                and not any(use.layer in layers for layers in stored)
                and all((i < 0) == (use.layer < 0) for layers in stored for i in layers)):
            j, ck = entries[0]
            raise where.error(layer_at, f"layer {use.layer} is not cached: cache.checkpoints.{j} ({ck.name}) stores "
                              f"{ck.layers}; add it there or set layers: all")
