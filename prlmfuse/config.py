"""pipeline.yaml, parsed once at the edge into typed config objects.

Every complaint about the file is one line naming where it is: `pipeline.yaml:12:5: train.runs.fused.merge:
'summ' is not one of sum, average, gate, dropnet, direct`. Unknown keys name the closest valid key.
The rules of a run and of its model are `train_fused.config`'s (`RunConfig.check`): each run is checked
by them here, and the `SettingError` they raise is placed at the setting's line.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prlmfuse.cache_features import BACKENDS, STORAGE_DTYPES
from prlmfuse.corpora import TASKS
from prlmfuse.corpora.bible import BIBLE_LANGS
from prlmfuse.errors import SettingError, UserError
from prlmfuse.precision import check_device_text, check_precision_text
from prlmfuse.evaluate.settings import AVERAGE, AVERAGE_CHOICES, AVERAGE_LAST, DEFAULTS as DECODE_DEFAULTS
from prlmfuse.train_fused.config import RunConfig
from prlmfuse.yaml_fields import Where, build, check_choice, coerce
from prlmfuse.launch import LauncherConfig, read_launcher
from prlmfuse.search_space import SearchConfig, read_search

CORPUS_KINDS = ("bible", "debian-descriptions", "debian-translations", "text", "hf")
CHECKPOINT_INITS = ("pretrained", "random")


@dataclass
class TextFiles:
    """The user's own corpus files (data.kind: text)."""

    train_src: Path
    train_tgt: Path
    dev_src: Path
    dev_tgt: Path
    test_src: Path
    test_tgt: Path


@dataclass
class DataConfig:
    kind: str = "bible"  # bible | debian-descriptions | debian-translations | text | hf
    src: str = "en"
    tgt: str = "ja"
    task: str = "translation"  # translation | summarization (text and hf corpora; the others know theirs)
    files: TextFiles | None = None
    # Where the debian-* builders keep (or find) apt's Translation and Packages lists (default: a private dir).
    lists_dir: Path | None = None
    # kind hf (prlmfuse.corpora.hf.build_hf): hub id, save_to_disk directory or data files, a local
    # path resolved against the pipeline file; which columns; which splits.
    dataset: str | None = None
    subset: str | None = None
    revision: str | None = None
    src_field: str | None = None
    tgt_field: str | None = None
    translation_field: str | None = None
    splits: dict[str, Any] | None = None


HF_KEYS = ("dataset", "subset", "revision", "src_field", "tgt_field", "translation_field", "splits")


@dataclass
class CheckpointEntry:
    """One frozen PrLM to cache: name (alias, hub id or local dir) and what to store."""

    name: str  # what runs' prlms call it; also the checkpoint itself unless `checkpoint` is set
    layers: list[int] | str = "all"  # indices, or "all": what the default layer choice (concat) reads
    dtype: str | None = None  # default: cache.dtype
    trust_remote_code: bool = False
    # The checkpoint (alias, hub id or local dir) when `name` is only a label, e.g. for init: random.
    checkpoint: str | None = None
    # pretrained: its trained weights. random: its architecture and tokenizer with the model class's own
    # initialisation under `seed` (a control: what the PrLM's training adds), saved once in the workdir.
    init: str = "pretrained"
    seed: int | None = None

    @property
    def source(self) -> str:
        """The checkpoint whose files (or, for init: random, architecture and tokenizer) this entry reads."""
        return self.checkpoint or self.name


@dataclass
class CacheConfig:
    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    backend: str = "zarr"
    dtype: str = "float16"
    max_tokens: int | None = None  # per forward pass; default 8192 on a CPU, 65536 on a GPU
    # Where caches live: a directory (relative to workdir) or an fsspec URL for the zarr backend.
    root: str = "cache"


@dataclass
class TrainConfig:
    defaults: dict[str, Any] = field(default_factory=dict)
    runs: list[RunConfig] = field(default_factory=list)
    # Runs trained at once, each in its own process with cores/jobs threads (the CLI's --jobs overrides it).
    jobs: int = 1
    # run name -> the key of train.runs it was written under (a grid's runs share their key)
    written_as: dict[str, str] = field(default_factory=dict)
    # The command line's --max-updates: every run's budget this time, passed on to each child that trains one.
    max_updates_override: int | None = None


@dataclass
class EvaluateConfig:
    """Decoding settings take their defaults from prlmfuse.evaluate.settings."""

    baseline: str | None = None
    beam: int = DECODE_DEFAULTS.beam
    lenpen: float = DECODE_DEFAULTS.lenpen
    average_last: int = AVERAGE_LAST
    average: str = AVERAGE  # saves | epochs: which checkpoints average_last counts
    no_repeat_ngram_size: int | None = None  # default: 3 for summarization, 0 otherwise
    max_len_a: float = DECODE_DEFAULTS.max_len_a
    max_len_b: int = DECODE_DEFAULTS.max_len_b
    min_len: int = DECODE_DEFAULTS.min_len
    out: str = "results"


@dataclass
class PipelineConfig:
    path: Path
    workdir: Path
    data: DataConfig
    cache: CacheConfig
    train: TrainConfig
    evaluate: EvaluateConfig
    # Runtime, not recipe: where every stage computes (auto | cpu | cuda | cuda:N) and at which
    # autocast precision (auto | bf16 | fp16 | fp32); the CLI's --device / --precision override them.
    device: str = "auto"
    precision: str = "auto"
    # Where runs and search workers run (prlmfuse.launch; the CLI's --launcher overrides its kind), and the
    # search over fusion settings (prlmfuse.search_space), if the file has one.
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    search: SearchConfig | None = None

    def run(self, name: str) -> RunConfig:
        for r in self.train.runs:
            if r.name == name:
                return r
        raise UserError(f"{self.path}: no run named {name!r}; runs are {', '.join(r.name for r in self.train.runs)}")


def _expand_runs(raw_runs: Any, defaults: dict, where: Where,
                 base_dir: Path) -> tuple[list[RunConfig], dict[str, str]]:
    """`runs` maps a name to overrides of the defaults; an optional `grid` multiplies a run.

    grid: {merge: [sum, gate], position: [attn, ffn]} gives fused.merge-sum.position-attn, ... — one run
    per combination, all reading the same cache. Returns the runs and each run's key (its written name).
    """
    if raw_runs is None:
        raw_runs = {}
    if not isinstance(raw_runs, dict):
        raise where.error(("train", "runs"), "expected a mapping of run name to settings")
    runs: list[RunConfig] = []
    written_as: dict[str, str] = {}
    for name, overrides in raw_runs.items():
        keypath = ("train", "runs", name)
        if str(name) in (".", "..") or "/" in str(name) or not str(name).strip():
            # A run's name is its directory under runs/: "." or ".." would be the workdir itself.
            raise where.error(keypath, f"{name!r} cannot name a run directory; use letters, digits, '-', '_' or '.'",
                              at_key=True)
        if overrides is not None and not isinstance(overrides, dict):
            raise where.error(keypath, f"expected a mapping of run settings (e.g. `{name}: {{}}`), got {overrides!r}")
        overrides = dict(overrides or {})
        grid = overrides.pop("grid", None)
        combos: list[dict] = [{}]
        if grid is not None:
            if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
                raise where.error(keypath + ("grid",), "expected a mapping of setting to a non-empty list of values")
            keys = list(grid)
            combos = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
        for combo in combos:
            merged = {**defaults, **overrides, **combo}
            run_name = str(name) + "".join(f".{k}-{v}" for k, v in combo.items())
            run = build(RunConfig, {k: v for k, v in merged.items()}, keypath, where, base_dir, {"name": run_name})
            written = {**overrides, **combo}
            try:
                run.check()
            except SettingError as e:
                key = next((k for k in (e.key[0], *e.also) if k in written or k in defaults), e.key[0])
                raise where.error(_run_keypath(keypath, defaults, written, key) + e.key[1:], e.detail) from None
            runs.append(run)
            written_as[run_name] = str(name)
    names = [r.name for r in runs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise where.error(("train", "runs"), f"run name {dup!r} appears twice")
    return runs, written_as


def _run_keypath(keypath: tuple, defaults: dict, written: dict, key: str) -> tuple:
    """Where a run's setting is written: a value the run inherits is pointed out in train.defaults."""
    return ("train", "defaults", key) if key in defaults and key not in written else keypath + (key,)


def load_pipeline(path: str | Path) -> PipelineConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"pipeline file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not valid UTF-8 ({e.reason}); save it as UTF-8") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UserError(f"{where}: YAML syntax error: {problem}") from None
    where = Where(path, node)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise where.error((), "expected a mapping with keys workdir, device, precision, data, cache, train, evaluate, "
                          "launcher, search")
    base_dir = path.resolve().parent
    top_keys = ["workdir", "device", "precision", "data", "cache", "train", "evaluate", "launcher", "search"]
    for key in raw:
        if key not in top_keys:
            close = difflib.get_close_matches(str(key), top_keys, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(top_keys)}"
            raise where.error((key,), f"unknown key{hint}", at_key=True)

    workdir = coerce(raw.get("workdir", "work"), Path, ("workdir",), where, base_dir)
    device = _runtime_text(raw, "device", check_device_text, where)
    precision = _runtime_text(raw, "precision", check_precision_text, where)
    data = build(DataConfig, raw.get("data"), ("data",), where, base_dir)
    check_choice(data.kind, CORPUS_KINDS, ("data", "kind"), where)
    check_choice(data.task, TASKS, ("data", "task"), where)
    if data.kind == "text":
        if data.files is None:
            raise where.error(("data",), "kind 'text' needs files: {train_src, train_tgt, dev_src, dev_tgt, test_src, test_tgt}")
        for f in dataclasses.fields(TextFiles):
            p = getattr(data.files, f.name)
            if not p.is_file():
                raise where.error(("data", "files", f.name), f"file not found: {p}")

    if data.kind == "bible":
        for side in ("src", "tgt"):
            check_choice(getattr(data, side), BIBLE_LANGS, ("data", side), where)
        if data.src == data.tgt:
            raise where.error(("data", "tgt"), f"src and tgt are both {data.src!r}; the Bible pairs en with ja")
    if data.kind == "debian-translations":
        from prlmfuse.corpora.debian import check_translation_languages

        problem = check_translation_languages(data.src, data.tgt)
        if problem is not None:
            raise where.error(("data", "tgt" if data.src == "en" else "src"), problem)
    if data.kind == "hf":
        _check_hf(data, where, base_dir)
    else:
        stray = next((k for k in HF_KEYS if getattr(data, k) is not None), None)
        if stray:
            raise where.error(("data", stray), f"only kind 'hf' reads {stray}; remove it or set kind: hf", at_key=True)

    cache = build(CacheConfig, raw.get("cache"), ("cache",), where, base_dir)
    check_choice(cache.backend, BACKENDS, ("cache", "backend"), where)
    check_choice(cache.dtype, STORAGE_DTYPES, ("cache", "dtype"), where)
    if cache.max_tokens is not None and cache.max_tokens < 1:
        raise where.error(("cache", "max_tokens"), f"expected a positive number of tokens per forward pass, got "
                          f"{cache.max_tokens}; leave it out for the device's default")
    for i, ck in enumerate(cache.checkpoints):
        if isinstance(ck.layers, str) and ck.layers != "all":
            raise where.error(("cache", "checkpoints", i, "layers"), f"expected a list of layer indices or 'all', got {ck.layers!r}")
        if ck.dtype is not None:
            check_choice(ck.dtype, STORAGE_DTYPES, ("cache", "checkpoints", i, "dtype"), where)
        check_choice(ck.init, CHECKPOINT_INITS, ("cache", "checkpoints", i, "init"), where)
        if ck.init == "random" and (ck.checkpoint is None or ck.checkpoint == ck.name):
            raise where.error(("cache", "checkpoints", i), "init: random needs a name of its own and `checkpoint`: the "
                              f"checkpoint whose architecture it takes, e.g. {{name: {ck.name}-untrained, "
                              f"checkpoint: {ck.name}, init: random, seed: 1}}")
        if ck.seed is not None and ck.init != "random":
            raise where.error(("cache", "checkpoints", i, "seed"), "only init: random reads seed; remove it or set "
                              "init: random", at_key=True)
        if ck.init == "random" and ck.seed is None:
            ck.seed = 1
    names = [ck.name for ck in cache.checkpoints]
    for i, ck in enumerate(cache.checkpoints):
        other = next((o for o in cache.checkpoints[:i] if o.name == ck.name), None)
        if other is not None and (other.source, other.init, other.seed) != (ck.source, ck.init, ck.seed):
            raise where.error(("cache", "checkpoints", i, "name"), f"{ck.name!r} names another checkpoint in an "
                              f"earlier entry; give this one a name of its own (names: {', '.join(names)})")

    raw_train = raw.get("train") or {}
    if not isinstance(raw_train, dict):
        raise where.error(("train",), "expected a mapping with keys defaults, runs, jobs")
    for key in raw_train:
        if key not in ("defaults", "runs", "jobs"):
            close = difflib.get_close_matches(str(key), ["defaults", "runs", "jobs"], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else "; valid keys: defaults, runs, jobs"
            raise where.error(("train", key), f"unknown key{hint}", at_key=True)
    jobs = raw_train.get("jobs", 1)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise where.error(("train", "jobs"), f"expected a positive integer (runs trained at once), got {jobs!r}")
    defaults = raw_train.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise where.error(("train", "defaults"), "expected a mapping of run settings")
    # Defaults are checked key by key here so that a typo points at train.defaults, not at every run.
    run_fields = [f.name for f in dataclasses.fields(RunConfig) if f.name != "name"]
    for key in defaults:
        if key not in run_fields:
            close = difflib.get_close_matches(str(key), run_fields, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise where.error(("train", "defaults", key), f"unknown key{hint}", at_key=True)
        coerce(defaults[key], typing.get_type_hints(RunConfig)[key], ("train", "defaults", key), where, base_dir)
    runs, written_as = _expand_runs(raw_train.get("runs"), defaults, where, base_dir)
    train = TrainConfig(defaults=defaults, runs=runs, jobs=jobs, written_as=written_as)

    evaluate = build(EvaluateConfig, raw.get("evaluate"), ("evaluate",), where, base_dir)
    check_choice(evaluate.average, AVERAGE_CHOICES, ("evaluate", "average"), where)
    if evaluate.average == "epochs":
        # Training would delete epoch-end checkpoints the average is to read.
        short = next((r for r in runs if r.keep_last_epochs < evaluate.average_last), None)
        if short is not None:
            raise where.error(("evaluate", "average_last"), f"averages {evaluate.average_last} epoch-end checkpoints "
                              f"but run {short.name!r} keeps only keep_last_epochs {short.keep_last_epochs}; "
                              "raise keep_last_epochs or lower average_last")
    # The same bounds as the CLI's decode options.
    for key, least in (("beam", 1), ("average_last", 0), ("min_len", 0), ("max_len_b", 0), ("max_len_a", 0)):
        if getattr(evaluate, key) < least:
            raise where.error(("evaluate", key), f"expected a number >= {least}, got {getattr(evaluate, key)}")
    if evaluate.no_repeat_ngram_size is not None and evaluate.no_repeat_ngram_size < 0:
        raise where.error(("evaluate", "no_repeat_ngram_size"),
                          f"expected a number >= 0, got {evaluate.no_repeat_ngram_size}")
    if evaluate.baseline is not None and evaluate.baseline not in {r.name for r in runs}:
        close = difflib.get_close_matches(evaluate.baseline, [r.name for r in runs], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise where.error(("evaluate", "baseline"), f"no run named {evaluate.baseline!r}{hint}")

    _check_matched_runs(runs, raw_train.get("runs") or {}, written_as, defaults, where)
    cached = {ck.name for ck in cache.checkpoints}
    for r_i, run in enumerate(runs):
        for i, use in enumerate(run.prlms):
            if use.checkpoint not in cached:
                close = difflib.get_close_matches(use.checkpoint, sorted(cached), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else "; add it to cache.checkpoints"
                raise where.error(
                    ("train", "runs", written_as[run.name], "prlms", i, "checkpoint"),
                    f"{use.checkpoint!r} is not in cache.checkpoints{hint}",
                )
            entries = [(j, ck) for j, ck in enumerate(cache.checkpoints) if ck.name == use.checkpoint
                       and (use.dtype is None or (ck.dtype or cache.dtype) == use.dtype)]
            if isinstance(use.layer, str) and entries and all(ck.layers != "all" and len(ck.layers) < 2
                                                              for _, ck in entries):
                # A learned combination of one cached layer would train as that layer alone, silently.
                j, ck = entries[0]
                raise where.error(
                    ("train", "runs", written_as[run.name], "prlms", i, "layer"),
                    f"{use.layer!r} combines the cached layers, but cache.checkpoints.{j} ({ck.name}) stores only "
                    f"{ck.layers}; set its layers: all",
                )
    launcher = read_launcher(raw.get("launcher"), where, base_dir)
    search = None
    if raw.get("search") is not None:
        search = read_search(raw["search"], where, base_dir, cache=cache, runs=runs, defaults=defaults)
    return PipelineConfig(path=path, workdir=workdir, data=data, cache=cache, train=train, evaluate=evaluate,
                          device=device, precision=precision, launcher=launcher, search=search)


def _check_matched_runs(runs: list[RunConfig], raw_runs: dict, written_as: dict[str, str], defaults: dict,
                        where: Where) -> None:
    """match_params names another run of the file, with PrLMs or not, that is itself not matched; the
    matched run has no PrLMs and no ffn (with match_by depth, no layer counts) of its own: the match
    chooses them. match_by written in a run needs its match_params; one inherited from train.defaults
    reaches only the matched runs. match_by is settled to None wherever it changes nothing (no match,
    or ffn), so run.json records one value for one model."""
    by_name = {r.name: r for r in runs}
    for run in runs:
        name = written_as[run.name]
        written = raw_runs.get(name) or {}
        written = written if isinstance(written, dict) else {}

        def located(key: str) -> tuple:
            return _run_keypath(("train", "runs", name), defaults, written, key)

        if run.match_params is None and "match_by" in written:
            raise where.error(located("match_by"), "says how match_params grows a run, and this run has no "
                              "match_params; add match_params or remove match_by")
        if run.match_params is None or run.match_by == "ffn":
            run.match_by = None
        if run.match_params is None:
            continue
        target = by_name.get(run.match_params)
        explicit_layers = [key for key in ("enc_layers", "dec_layers") if getattr(run, key) is not None]
        keypath, problem = located("match_params"), None
        if run.prlms:
            problem = "widens a run without PrLMs to another run's size; remove prlms or match_params"
        elif run.ffn is not None:
            keypath = located("ffn")
            problem = (f"is chosen by match_params ({run.match_params!r}), so an explicit ffn cannot stand beside it; "
                       "remove one")
        elif run.match_by == "depth" and explicit_layers:
            keypath = located(explicit_layers[0])
            problem = (f"is chosen by match_params ({run.match_params!r}) with match_by depth, so an explicit "
                       f"{explicit_layers[0]} cannot stand beside it; remove one")
        elif run.match_params == run.name:
            problem = "names this run itself; name the run whose trainable parameters to match"
        elif target is None:
            close = difflib.get_close_matches(run.match_params, list(by_name), n=1)
            problem = f"no run named {run.match_params!r}" + (f"; did you mean {close[0]!r}?" if close else "")
        elif target.match_params is not None:
            problem = (f"{target.name!r} is itself matched (to {target.match_params!r}); "
                       f"match {target.match_params!r} directly")
        if problem:
            raise where.error(keypath, problem)


def _check_hf(data: DataConfig, where: Where, base_dir: Path) -> None:
    """Located errors for kind hf; a local dataset path becomes absolute (relative to the pipeline file)."""
    from prlmfuse.corpora.hf import check_fields, check_splits, looks_like_path

    if not data.dataset:
        raise where.error(("data",), "kind 'hf' needs dataset: a hub id, a save_to_disk directory or parquet/json/csv files")
    local = Path(data.dataset).expanduser()
    local = local if local.is_absolute() else base_dir / local
    if local.exists():
        data.dataset = str(local)
    elif looks_like_path(data.dataset):
        raise where.error(("data", "dataset"), f"no such file or directory: {local}")
    bad = check_splits(data.splits)
    if bad is not None:
        keypath, message = bad
        raise where.error(("data", "splits", *keypath), message, at_key=bool(keypath))
    conflict = check_fields(data.src_field, data.tgt_field, data.translation_field)
    if conflict is not None:
        raise where.error(("data",), conflict)


def data_yaml(data: DataConfig) -> str:
    """The `data:` section of a pipeline.yaml that builds this corpus, as lines to paste (paths absolute)."""
    lines = ["data:", f"  kind: {data.kind}", f"  src: {_yaml_scalar(data.src)}", f"  tgt: {_yaml_scalar(data.tgt)}"]
    if data.kind in ("text", "hf"):
        lines.append(f"  task: {data.task}")
    if data.files is not None:
        lines.append("  files:")
        lines += [f"    {f.name}: {_yaml_scalar(str(Path(getattr(data.files, f.name)).resolve()))}"
                  for f in dataclasses.fields(TextFiles)]
    if data.lists_dir is not None:
        lines.append(f"  lists_dir: {_yaml_scalar(str(Path(data.lists_dir).resolve()))}")
    for key in HF_KEYS:
        value = getattr(data, key)
        if value is None:
            continue
        if key == "splits":
            lines.append("  splits: {" + ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in value.items()) + "}")
        else:
            lines.append(f"  {key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    """One scalar as YAML writes it in flow style (quoted only where plain text would read differently)."""
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6).strip().removesuffix("\n...").strip()


def _runtime_text(raw: dict, key: str, check, where: Where) -> str:
    """A top-level runtime setting (device, precision), spell-checked here; availability is checked where it is used."""
    try:
        return check(raw.get(key, "auto"))
    except UserError as e:
        raise where.error((key,), str(e)) from None
