"""Batch evaluation: decode every run on every test set from the feature cache, score, compare, plot.

`evaluate_runs` is what `prlmfuse evaluate` and the pipeline's last stage call. For each run
directory it averages the newest checkpoints, reads the test split's PrLM features from the
cache recorded in run.json (refusing a cache whose key does not match the one the run trained
on), decodes with beam search, detokenizes through the run's BPE and scores against the raw
target lines. Hypotheses are kept in `out/hyp.<run>.<test>.txt` next to a small JSON keyed on
the weights, the decode settings and the test cache, so evaluating again without changes
decodes nothing.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from prlmfuse.corpora import Corpus
from prlmfuse.batching import token_budget_batches
from prlmfuse.errors import UserError
from prlmfuse.evaluate.metrics import (
    DEFAULT_SEED,
    bootstrap_scores,
    confidence_interval,
    corpus_scores,
    paired_p_value,
    sentence_stats,
)
from prlmfuse.train_fused.config import recipe_without_seed
from prlmfuse.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json, read_lines, sha256_file

RUN_FILE = "run.json"
BPE_FILE = "bpe.json"
CHECKPOINT_DIR = "checkpoints"
BEST_FILE = "best.safetensors"
METRICS_FILE = "metrics.jsonl"
BOOTSTRAP_SAMPLES = 1000


# ---------------------------------------------------------------------------------------------
# What a run directory says about itself


@dataclass(frozen=True)
class RunView:
    """The parts of a run directory evaluation needs: run.json, its corpus, its checkpoints."""

    run_dir: Path
    name: str
    record: dict  # run.json as the trainer wrote it
    corpus: Corpus
    checkpoints: tuple[Path, ...]  # complete checkpoints/update-*.safetensors, oldest first

    @property
    def task(self) -> str:
        return self.corpus.task

    @property
    def tgt_lang(self) -> str:
        return self.corpus.tgt_lang

    @property
    def prlms(self) -> list[dict]:
        return list(self.record.get("prlms") or [])

    @property
    def model_config(self) -> dict:
        return dict(self.record.get("model") or {})

    def budget(self) -> dict:
        """What training cost: updates, target tokens seen and wall seconds (trainer_state.json)."""
        try:
            state = read_json(self.run_dir / "trainer_state.json", what="trainer state")
        except UserError:
            state = {}
        return {
            "updates": int(state.get("update", 0)),
            "train_tokens": int(state.get("tokens_seen", 0)),
            "train_seconds": float(state.get("wall_time", float("nan"))),
        }

    def describe(self) -> dict:
        """The columns of the paper's tables: PrLM, layer, merge, position, side."""
        if not self.prlms:
            return {"prlm": "-", "layer": "-", "merge": "-", "position": "-", "side": "-"}
        model = self.model_config
        # A local checkpoint directory is shown by its folder name; aliases and hub ids as written.
        names = [_short_checkpoint(str(p.get("checkpoint", "?"))) for p in self.prlms]
        layers = [str(p.get("layer", p.get("layer_mode", "?"))) for p in self.prlms]
        return {
            "prlm": " + ".join(names),
            "layer": " + ".join(layers),
            "merge": str(model.get("merge", "?")),
            "position": str(model.get("position", "?")),
            "side": str(model.get("side", "?")),
        }


def _short_checkpoint(name: str) -> str:
    if os.path.isabs(name) or name.startswith((".", "~")):
        return Path(name).name or name
    return name


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (weights, optimizer state and JSON all written) of a run, oldest first."""
    from prlmfuse.train_fused.checkpointing import complete_checkpoints, weights_path

    return [weights_path(Path(run_dir), u) for u in complete_checkpoints(run_dir)]


def open_run(run_dir: str | os.PathLike) -> RunView:
    """Read run.json and the corpus it trained on; refuse a directory that has nothing to decode with."""
    from prlmfuse.corpora import load_corpus

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}; pass a directory written by `prlmfuse train`")
    checkpoints = tuple(list_checkpoints(run_dir))
    if not checkpoints and not (run_dir / BEST_FILE).is_file():
        raise UserError(
            f"run directory {run_dir} has no checkpoints (no complete {CHECKPOINT_DIR}/update-*.safetensors, "
            f"no {BEST_FILE}); train it first (prlmfuse train, or prlmfuse run --only train)"
        )
    record = read_json(run_dir / RUN_FILE, what="run description")
    if not isinstance(record.get("model"), dict) or not isinstance(record.get("corpus"), dict):
        raise UserError(f"{run_dir / RUN_FILE} lacks its model or corpus section; it was not written by prlmfuse train")
    root = record["corpus"].get("root")
    if not root:
        raise UserError(f"{run_dir / RUN_FILE} records no corpus root; retrain the run with this prlmfuse version")
    corpus = load_corpus(root)
    return RunView(run_dir, str(record.get("name") or run_dir.name), record, corpus, checkpoints)


def select_weights(run: RunView, average_last: int) -> list[Path]:
    """The weight files a decode uses: the newest `average_last` complete checkpoints (fewer if
    fewer exist), or best.safetensors for average_last=0 (and when no checkpoint is complete)."""
    if average_last < 0:
        raise UserError(f"average_last must be >= 0 (0 = best checkpoint), got {average_last}")
    best = run.run_dir / BEST_FILE
    if average_last == 0 or not run.checkpoints:
        if not best.is_file():
            raise UserError(f"{best} not found; train the run first or choose average_last >= 1")
        return [best]
    return list(run.checkpoints[-average_last:])


def load_model(run: RunView, weights: Sequence[Path]):
    """(model in eval mode, BPE) with exactly the weights `select_weights` chose.

    Several checkpoints go through the trainer's average (kept as run_dir/average-last{K}.safetensors
    and rewritten only when the set changes).
    """
    from prlmfuse.train_fused import load_run

    if len(weights) == 1 and Path(weights[0]).name == BEST_FILE:
        model, bpe, _ = load_run(run.run_dir, "best")
    elif len(weights) == 1:
        from prlmfuse.train_fused.checkpointing import load_weights

        model, bpe, info = load_run(run.run_dir, "last")
        if Path(info["weights"]).resolve() != Path(weights[0]).resolve():
            load_weights(model, weights[0])
    else:
        model, bpe, _ = load_run(run.run_dir, "average", last=len(weights))
    return model.eval(), bpe


def weights_fingerprint(paths: Sequence[Path]) -> list[list]:
    """Identity of a checkpoint set without hashing gigabytes: name, size, mtime (ns)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


# ---------------------------------------------------------------------------------------------
# Model and features


@dataclass(frozen=True)
class BranchFeatures:
    """Where one PrLM branch's test features come from and which stored rows the model reads.

    `reader` is a CacheReader (of the test set's cache, or of a live run's private one).
    """

    reader: object
    layer_rows: tuple[int, ...]  # rows of reader.features(i), in the order the model was trained on
    pooled_rows: tuple[int, ...] | None  # rows of reader.pooled(i) for Dyn[CLS]/Dyn[Aver]; None if unused


def _branch_features(branch: BranchFeatures, indices: list[int]):
    from prlmfuse.train_fused.data import FeatureSource, batch_features

    # Same padding code the trainer feeds the model with.
    source = FeatureSource(path="", layer_rows=branch.layer_rows, with_pooled=branch.pooled_rows is not None)
    feats = batch_features(branch.reader, source, indices)
    if branch.pooled_rows is not None and feats.pooled is not None:
        rows = list(branch.pooled_rows)
        if rows != list(range(feats.pooled.shape[1])):
            feats.pooled = feats.pooled[:, rows]
    return feats


def run_layer_rows(
    prlm_record: dict, num_pooled: int, reader_layers: Sequence[int], reader_pooled: Sequence[int], *, where: str
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Rows of a cache's stored layers (and pooled layers) holding exactly what the run trained on.

    A test cache may store more layers than the train cache did; the rows pick the trained ones
    in the trained order. Pooled vectors cover layers 0..highest, so the run's first `num_pooled`.
    """
    trained_layers = [int(x) for x in prlm_record.get("layers") or []]
    missing = [layer for layer in trained_layers if layer not in reader_layers]
    if missing or not trained_layers:
        raise UserError(
            f"cache {where} stores layers {list(reader_layers)} but the run was trained on {trained_layers}; "
            f"rebuild the test cache with the run's layers"
        )
    layer_rows = tuple(list(reader_layers).index(layer) for layer in trained_layers)
    pooled_rows = None
    if prlm_record.get("layer_mode") in ("dyn_cls", "dyn_aver"):
        wanted = list(range(num_pooled))
        if any(layer not in reader_pooled for layer in wanted):
            raise UserError(f"cache {where} has pooled layers {list(reader_pooled)}, the run needs {wanted}; rebuild it")
        pooled_rows = tuple(list(reader_pooled).index(layer) for layer in wanted)
    return layer_rows, pooled_rows


# The one key field that depends on which text was encoded; layers may grow; all else must match.
_CORPUS_KEY_FIELDS = frozenset({"corpus_sha256"})
_SUPERSET_KEY_FIELDS = frozenset({"layers", "pooled_layers"})


def check_cache_key(
    test_manifest: dict, train_key_fields: dict | None, prlm_record: dict, *, where: str, src_sha256: str | None = None
) -> None:
    """Refuse test features that were not made the way the run's training features were.

    The test cache's key_fields must equal the train cache's in checkpoint identity, dtype,
    truncation and everything else; its layers may be a superset; only the corpus differs, and
    it must be the test file as it is now. Without the train cache's manifest (deleted after
    training), the run.json record of the branch is checked instead.
    """
    test_fields = dict(test_manifest.get("key_fields") or {})
    if src_sha256 is not None and test_fields.get("corpus_sha256") not in (None, src_sha256):
        raise UserError(
            f"cache {where} was built from another version of the test source file; rebuild it "
            f"(prlmfuse run --only cache)"
        )
    if train_key_fields:
        for name in sorted((set(train_key_fields) | set(test_fields)) - _CORPUS_KEY_FIELDS):
            train_value, test_value = train_key_fields.get(name), test_fields.get(name)
            if name in _SUPERSET_KEY_FIELDS:
                if not set(_as_list(train_value)) <= set(_as_list(test_value)):
                    raise UserError(
                        f"cache {where} stores {name} {test_value} but the run trained on {train_value}; "
                        f"rebuild the test cache with the run's layers"
                    )
            elif train_value != test_value:
                raise UserError(
                    f"cache {where} does not match the run's training cache: key field {name!r} is "
                    f"{test_value!r}, the run trained with {train_value!r}; rebuild the test cache to match"
                )
        return
    expected = {
        "checkpoint_identity": prlm_record.get("identity"),
        "dtype": prlm_record.get("dtype"),
        "max_length": prlm_record.get("max_length"),
    }
    found = {
        "checkpoint_identity": test_fields.get("checkpoint_identity"),
        "dtype": test_fields.get("dtype", test_manifest.get("dtype")),
        "max_length": (test_fields.get("truncation") or {}).get("max_length"),
    }
    for name, value in expected.items():
        if value is not None and found[name] != value:
            raise UserError(
                f"cache {where} does not match the run: {name} is {found[name]!r}, the run trained with "
                f"{value!r}; rebuild the test cache to match"
            )


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]


def _read_manifest(path: str) -> dict | None:
    """manifest.json of a cache (local dir or fsspec URL); None if it cannot be read."""
    try:
        if "://" in path:
            import fsspec

            fs, p = fsspec.core.url_to_fs(path)
            return json.loads(fs.cat_file(f"{p.rstrip('/')}/manifest.json"))
        return json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def open_test_features(
    run: RunView, split: str, num_lines: int, src_sha256: str | None = None
) -> tuple[list[BranchFeatures], list[str]]:
    """One BranchFeatures per PrLM branch of the run for `split`, checked against the run's train cache."""
    from prlmfuse.cache_features import CacheReader

    branches: list[BranchFeatures] = []
    keys: list[str] = []
    specs = run.model_config.get("prlms") or []
    if len(specs) != len(run.prlms):
        raise UserError(f"{run.run_dir / RUN_FILE} lists {len(run.prlms)} PrLMs but its model has {len(specs)}; the file is inconsistent")
    for prlm, spec in zip(run.prlms, specs):
        caches = prlm.get("caches") or {}
        entry = caches.get(split)
        label = prlm.get("checkpoint", "?")
        if not entry or not entry.get("path"):
            raise UserError(
                f"run {run.name} records no {split!r} cache for PrLM {label}; build it "
                f"(prlmfuse run --only cache) and retrain or pass a run whose run.json lists it"
            )
        path = str(entry["path"])
        manifest = _read_manifest(path)
        if manifest is None:
            raise UserError(f"cache {path} ({label}, {split}) is missing or has no readable manifest.json; rebuild it")
        train_entry = caches.get("train") or {}
        train_manifest = _read_manifest(str(train_entry.get("path", ""))) if train_entry.get("path") else None
        train_fields = None
        # Only the very cache the run trained on counts: one rebuilt in place since has another key.
        if train_manifest is not None and train_manifest.get("key") == train_entry.get("key"):
            train_fields = train_manifest.get("key_fields")
        check_cache_key(manifest, train_fields, prlm, where=path, src_sha256=src_sha256)
        # Test sets are small; per-sentence reads from zarr/HDF5 cost milliseconds each, which
        # would show up as a slower fused model in sentences/s. One bulk read instead.
        reader = CacheReader(path, in_memory=True)
        if reader.num_sentences != num_lines:
            raise UserError(
                f"cache {path} holds {reader.num_sentences} sentences but the {split} source has {num_lines} lines; "
                f"the corpus changed since the cache was built: rebuild the cache"
            )
        layer_rows, pooled_rows = run_layer_rows(
            prlm, int(spec.get("num_pooled", 0)), list(reader.layers), list(reader.pooled_layers), where=path)
        branches.append(BranchFeatures(reader, layer_rows, pooled_rows))
        keys.append(str(reader.key))
    return branches, keys


# ---------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True)
class DecodeSettings:
    beam: int = 5
    lenpen: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    min_len: int = 1
    no_repeat_ngram_size: int = 0
    bf16: bool = False  # autocast the decoder's matmuls to bf16 (fast on AMX CPUs, not bit-identical)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_run(cls, run: RunView, no_repeat_ngram_size: int | None, **options) -> DecodeSettings:
        """The settings for one run: n-gram blocking defaults to 3 for summarization, as in the paper."""
        if no_repeat_ngram_size is None:
            no_repeat_ngram_size = 3 if run.task == "summarization" else 0
        return cls(no_repeat_ngram_size=int(no_repeat_ngram_size), **options)


@dataclass
class DecodeOutput:
    hyps: list[str]
    hyp_tokens: int  # generated subword tokens, without </s>
    seconds: float

    @property
    def sentences_per_s(self) -> float:
        return len(self.hyps) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.hyp_tokens / self.seconds if self.seconds > 0 else float("nan")


def encode_sources(bpe, lines: Sequence[str], max_positions: int, *, stats: dict | None = None) -> list[np.ndarray]:
    """BPE ids of each source line, cut so that ids + </s> fit the model's positions.

    Over-long lines are cut, not refused; `stats`, if given, receives how many were cut ("truncated").
    """
    limit = max(1, int(max_positions) - 1)
    encoded = bpe.encode_batch(list(lines))
    if stats is not None:
        stats["truncated"] = sum(1 for ids in encoded if len(ids) > limit)
        stats["limit"] = limit
    return [np.asarray(ids[:limit], dtype=np.int64) for ids in encoded]


def note_truncated(stats: dict, what: str) -> None:
    if stats.get("truncated"):
        print(f"{what}: {stats['truncated']} source line(s) longer than {stats['limit']} BPE tokens were cut",
              file=sys.stderr, flush=True)


def decode_corpus(
    model,
    bpe,
    src_ids: list[np.ndarray],
    branches: list[BranchFeatures],
    settings: DecodeSettings,
    *,
    batch_tokens: int = 4096,
    progress: bool = False,
    desc: str = "decode",
) -> DecodeOutput:
    """Beam-search every sentence in token-budget batches and return detokenized text in corpus order.

    The clock covers feature reading, padding, search and detokenization: what a user waits for.
    """
    from prlmfuse.evaluate.decode import beam_search
    from prlmfuse.train_fused.bpe import EOS_ID, PAD_ID

    n = len(src_ids)
    lengths = np.fromiter((len(s) + 1 for s in src_ids), dtype=np.int64, count=n)
    # Longest first: the first batch shows the memory peak, later ones only get shorter.
    order = np.argsort(-lengths, kind="stable")
    batches = [b.tolist() for b in token_budget_batches(order, lengths, batch_tokens)]

    hyps: list[str] = [""] * n
    hyp_tokens = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=desc, unit="sent", leave=False)
    start = time.perf_counter()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
        for batch in batches:
            width = int(lengths[batch[0]])
            src_tokens = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
            for row, i in enumerate(batch):
                ids = torch.from_numpy(src_ids[i])
                src_tokens[row, : len(ids)] = ids
                src_tokens[row, len(ids)] = EOS_ID
            prlm = [_branch_features(b, batch) for b in branches]
            out_ids = beam_search(
                model,
                src_tokens,
                prlm,
                beam=settings.beam,
                lenpen=settings.lenpen,
                max_len_a=settings.max_len_a,
                max_len_b=settings.max_len_b,
                min_len=settings.min_len,
                no_repeat_ngram_size=settings.no_repeat_ngram_size,
            )
            for i, ids in zip(batch, out_ids):
                ids = [int(t) for t in ids]
                if EOS_ID in ids:
                    ids = ids[: ids.index(EOS_ID)]
                hyp_tokens += len(ids)
                hyps[i] = bpe.decode(ids)
            if bar is not None:
                bar.update(len(batch))
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return DecodeOutput(hyps=hyps, hyp_tokens=hyp_tokens, seconds=seconds)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class RunResult:
    """One run on one test set: the row of results.md / results.csv."""

    run: str
    test_set: str
    run_dir: str
    task: str
    prlm: str
    layer: str
    merge: str
    position: str
    side: str
    num_sentences: int
    bleu: float
    chrf: float
    rouge1: float
    rouge2: float
    rougeL: float
    sentences_per_s: float
    tokens_per_s: float
    decode_seconds: float
    checkpoints: list[str]
    hyp_file: str
    reused: bool  # hypotheses came from the previous evaluation (unchanged key)
    signature: dict
    # Bootstrap: 95% interval of the main metric, and the comparison with the baseline.
    main_metric: str = "bleu"
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    delta: dict = field(default_factory=dict)  # metric -> score minus baseline
    p_value: dict = field(default_factory=dict)  # metric -> paired bootstrap p
    compared_with: str | None = None  # the baseline run behind delta and p_value
    # Training budget of the decoded run (trainer_state.json).
    updates: int = 0
    train_tokens: int = 0
    train_seconds: float = float("nan")

    def to_dict(self) -> dict:
        # `reused` says how this call got the hypotheses, not what they score: it stays out of the
        # results files so that re-running a finished evaluation rewrites nothing.
        d = asdict(self)
        del d["reused"]
        return d


@dataclass
class EvaluationResults:
    out: Path
    baseline: str | None
    rows: list[RunResult]
    settings: dict

    def row(self, run: str, test_set: str = "test") -> RunResult:
        for r in self.rows:
            if r.run == run and r.test_set == test_set:
                return r
        raise KeyError((run, test_set))

    @property
    def files(self) -> dict[str, Path]:
        return {
            "results.md": self.out / "results.md",
            "results.csv": self.out / "results.csv",
            "results.json": self.out / "results.json",
            "scores.png": self.out / "scores.png",
            "dev_loss.png": self.out / "dev_loss.png",
        }


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def _decode_key(run: RunView, weights: list[Path], settings: DecodeSettings, split: str, src_sha: str, cache_keys: list[str]) -> str:
    payload = {
        "weights": weights_fingerprint(weights),
        "bpe": sha256_file(run.run_dir / BPE_FILE),
        "decode": settings.to_dict(),
        "test": {"split": split, "src_sha256": src_sha, "caches": cache_keys},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _reuse_hypotheses(hyp_path: Path, meta_path: Path, key: str, num_lines: int) -> tuple[list[str], dict] | None:
    if not (hyp_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("hyp_sha256") != sha256_file(hyp_path):
        return None
    hyps = read_lines(hyp_path) if num_lines else []
    if len(hyps) != num_lines:
        return None
    return hyps, meta


def _one_line(text: str) -> str:
    # A hypothesis file is line-aligned with the test set: a newline inside a hypothesis would shift it.
    return " ".join(text.replace("\r", " ").replace("\n", " ").split()) if ("\n" in text or "\r" in text) else text


def evaluate_runs(
    run_dirs: Iterable[str | os.PathLike],
    *,
    out: str | os.PathLike,
    test_sets: Sequence[str] | None = None,
    baseline: str | None = None,
    beam: int = 5,
    average_last: int = 5,
    lenpen: float = 1.0,
    no_repeat_ngram_size: int | None = None,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    min_len: int = 1,
    batch_tokens: int = 4096,
    bf16: bool = False,
    bleu_tokenize: str | None = None,
    bootstrap_samples: int = BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_SEED,
    progress: bool = True,
) -> EvaluationResults:
    """Decode and score every run on every test set; write results.md/csv/json, hypotheses and plots.

    test_sets: split names of each run's corpus (default: ["test"]); features come from the
    caches recorded in run.json for that split. baseline: a run name (or its directory name);
    default the one run without PrLM branches, if there is exactly one. no_repeat_ngram_size:
    default 3 for summarization corpora, 0 otherwise. bleu_tokenize: sacrebleu tokenizer for
    every run (e.g. 'intl'); default by target language ('zh', 'ja-mecab', 'ko-mecab', '13a').
    """
    out = Path(out)
    runs = [open_run(d) for d in run_dirs]
    if not runs:
        raise UserError("no run directories given; pass at least one trained run")
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"run name {dupes[0]!r} appears twice among the run directories; evaluate each run once")
    safe = [_safe_name(n) for n in names]
    clash = sorted({n for n, sn in zip(names, safe) if safe.count(sn) > 1})
    if clash:
        raise UserError(
            f"runs {', '.join(repr(n) for n in clash)} would share hypothesis file names in {out}; rename one of them"
        )
    if beam < 1:
        raise UserError(f"beam must be >= 1, got {beam}")
    if batch_tokens < 1:
        raise UserError(f"batch_tokens must be >= 1, got {batch_tokens}")
    baseline_name = _resolve_baseline(runs, baseline)
    splits = list(test_sets) if test_sets else ["test"]

    rows: list[RunResult] = []
    sentence_level: dict[tuple[str, str], dict] = {}  # (run, split) -> {metric: SentenceStats}
    refs_sha: dict[tuple[str, str], str] = {}
    out.mkdir(parents=True, exist_ok=True)

    for run in runs:
        weights = select_weights(run, average_last)
        settings = DecodeSettings.for_run(
            run, no_repeat_ngram_size, beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
            min_len=min_len, bf16=bf16,
        )
        bpe = None
        model = None
        for split in splits:
            src_path, tgt_path = run.corpus.src_path(split), run.corpus.tgt_path(split)
            src_lines, refs = read_lines(src_path), read_lines(tgt_path)
            if len(src_lines) != len(refs):
                raise UserError(f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(refs)}; realign the corpus")
            src_sha = sha256_file(src_path)
            branches, cache_keys = open_test_features(run, split, len(src_lines), src_sha)
            key = _decode_key(run, weights, settings, split, src_sha, cache_keys)
            stem = f"hyp.{_safe_name(run.name)}.{_safe_name(split)}"
            hyp_path, meta_path = out / f"{stem}.txt", out / f"{stem}.json"
            reused = _reuse_hypotheses(hyp_path, meta_path, key, len(src_lines))
            if reused is not None:
                hyps, meta = reused
            else:
                if model is None:
                    model, bpe = load_model(run, weights)
                cut: dict = {}
                src_ids = encode_sources(bpe, src_lines, int(run.model_config.get("max_positions", 1024)), stats=cut)
                if progress:
                    note_truncated(cut, f"{run.name}/{split}")
                decoded = decode_corpus(
                    model, bpe, src_ids, branches, settings, batch_tokens=batch_tokens,
                    progress=progress, desc=f"{run.name}/{split}",
                )
                hyps = [_one_line(h) for h in decoded.hyps]
                text = "".join(h + "\n" for h in hyps)
                atomic_write_text(hyp_path, text)
                meta = {
                    "key": key,
                    "hyp_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                    "run": run.name,
                    "test_set": split,
                    "checkpoints": [str(p) for p in weights],
                    "decode": settings.to_dict(),
                    "cache_keys": cache_keys,
                    "seconds": decoded.seconds,
                    "sentences_per_s": decoded.sentences_per_s,
                    "tokens_per_s": decoded.tokens_per_s,
                    "hyp_tokens": decoded.hyp_tokens,
                    "truncated_sources": cut["truncated"],
                }
                atomic_write_json(meta_path, meta)
            scores = corpus_scores(hyps, refs, tgt_lang=run.tgt_lang, task=run.task, bleu_tokenize=bleu_tokenize)
            main_metric = "rougeL" if run.task == "summarization" else "bleu"
            tested = ("bleu", "rougeL") if run.task == "summarization" else ("bleu",)
            stats = {
                m: sentence_stats(hyps, refs, metric=m, tgt_lang=run.tgt_lang, bleu_tokenize=bleu_tokenize)
                for m in tested
            } if hyps else {}
            sentence_level[(run.name, split)] = stats
            refs_sha[(run.name, split)] = sha256_file(tgt_path)
            desc = run.describe()
            rows.append(
                RunResult(
                    run=run.name, test_set=split, run_dir=str(run.run_dir), task=run.task,
                    prlm=desc["prlm"], layer=desc["layer"], merge=desc["merge"], position=desc["position"],
                    side=desc["side"], num_sentences=len(hyps),
                    bleu=scores["bleu"], chrf=scores["chrf"], rouge1=scores["rouge1"], rouge2=scores["rouge2"],
                    rougeL=scores["rougeL"],
                    sentences_per_s=float(meta.get("sentences_per_s", float("nan"))),
                    tokens_per_s=float(meta.get("tokens_per_s", float("nan"))),
                    decode_seconds=float(meta.get("seconds", float("nan"))),
                    checkpoints=[Path(p).name for p in meta.get("checkpoints", [])],
                    hyp_file=hyp_path.name, reused=reused is not None, signature=scores["signature"],
                    main_metric=main_metric, **run.budget(),
                )
            )
        del model

    _bootstrap(rows, sentence_level, refs_sha, matched_baselines(runs, baseline_name),
               n_samples=bootstrap_samples, seed=seed)
    settings_record = {
        "beam": beam, "lenpen": lenpen, "average_last": average_last, "max_len_a": max_len_a,
        "max_len_b": max_len_b, "min_len": min_len, "no_repeat_ngram_size": no_repeat_ngram_size, "bf16": bf16,
        "bleu_tokenize": bleu_tokenize,
        "bootstrap_samples": bootstrap_samples, "seed": seed, "test_sets": splits,
    }
    results = EvaluationResults(out=out, baseline=baseline_name, rows=rows, settings=settings_record)
    write_results(results)
    plot_scores(results, out / "scores.png")
    plot_dev_loss(runs, out / "dev_loss.png")
    return results


def _resolve_baseline(runs: list[RunView], baseline: str | None) -> str | None:
    if baseline is None:
        plain = [r.name for r in runs if not r.prlms]
        return plain[0] if len(plain) == 1 else None
    for r in runs:
        if baseline in (r.name, r.run_dir.name, str(r.run_dir)):
            return r.name
    raise UserError(
        f"baseline {baseline!r} is not among the evaluated runs ({', '.join(r.name for r in runs)}); "
        f"pass one of those names"
    )


def matched_baselines(runs: list[RunView], baseline: str | None) -> dict[str, str]:
    """Run name -> the baseline run it is compared with.

    Normally the named baseline. When the baseline was trained with several seeds (a `grid: {seed:
    [...]}` over it), a fused run is compared with the baseline run of its own seed, so that
    seed-to-seed noise is not counted as the PrLM's effect; the baseline's other seeds are
    compared with the named one, which shows that noise.
    """
    if baseline is None:
        return {}
    by_name = {r.name: r for r in runs}
    base = by_name[baseline]

    def recipe(run: RunView) -> dict:
        return recipe_without_seed(run.record.get("train") or {})

    base_by_seed = {
        (r.record.get("train") or {}).get("seed"): r.name
        for r in runs if not r.prlms and recipe(r) == recipe(base)
    }
    base_by_seed[(base.record.get("train") or {}).get("seed")] = baseline
    out = {}
    for r in runs:
        if r.name == baseline:
            continue
        seed = (r.record.get("train") or {}).get("seed")
        out[r.name] = base_by_seed.get(seed, baseline) if r.prlms else baseline
    return out


def _bootstrap(rows, sentence_level, refs_sha, baseline_of: dict[str, str], *, n_samples: int, seed: int) -> None:
    """Confidence intervals for every row, and paired p-values against its baseline on the same references.

    Every system is resampled with the same seed over the same number of sentences, so the i-th
    sample of two systems is the same resampled test set (the pairing).
    """
    samples: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for row in rows:
        stats = sentence_level.get((row.run, row.test_set)) or {}
        samples[(row.run, row.test_set)] = {
            m: bootstrap_scores(s, n_samples=n_samples, seed=seed) for m, s in stats.items()
        }
        main = samples[(row.run, row.test_set)].get(row.main_metric)
        if main is not None:
            row.ci_low, row.ci_high = confidence_interval(main)
    by_key = {(r.run, r.test_set): r for r in rows}
    for row in rows:
        baseline = baseline_of.get(row.run)
        base = by_key.get((baseline, row.test_set))
        if base is None:
            continue
        if refs_sha.get((row.run, row.test_set)) != refs_sha.get((baseline, row.test_set)):
            continue  # different corpora: no paired comparison
        base_samples = samples[(baseline, row.test_set)]
        for metric, system_samples in samples[(row.run, row.test_set)].items():
            if metric not in base_samples:
                continue
            row.delta[metric] = getattr(row, metric) - getattr(base, metric)
            row.p_value[metric] = paired_p_value(base_samples[metric], system_samples)
            row.compared_with = baseline


# ---------------------------------------------------------------------------------------------
# Files


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _with_delta(row: RunResult, metric: str, baseline: str | None) -> str:
    score = _fmt(getattr(row, metric))
    if row.run == baseline:
        return f"{score} (-)"
    if metric in row.delta:
        versus = f" vs {row.compared_with}" if row.compared_with not in (None, baseline) else ""
        return f"{score} ({row.delta[metric]:+.2f}, p={row.p_value[metric]:.3f}{versus})"
    return score


def results_markdown(results: EvaluationResults) -> str:
    """Tables in the style of the paper's Tables 1-5, one per test set, plus metric signatures."""
    lines = ["# prlmfuse evaluation", ""]
    s = results.settings
    lines.append(
        f"beam {s['beam']}, length penalty {s['lenpen']}, average of the last {s['average_last']} checkpoints "
        f"(0 = best), paired bootstrap {s['bootstrap_samples']} samples (seed {s['seed']}); "
        f"baseline: {results.baseline or 'none'}. Δ and p are against the baseline (two-sided paired bootstrap), "
        f"or against the baseline run of the same seed where it names one."
    )
    for split in dict.fromkeys(r.test_set for r in results.rows):
        rows = [r for r in results.rows if r.test_set == split]
        summarization = any(r.task == "summarization" for r in rows)
        lines += ["", f"## {split} ({rows[0].num_sentences} sentences)", ""]
        header = ["run", "PrLM", "layer", "merge", "position", "side", "BLEU (Δ, p)", "chrF"]
        if summarization:
            header += ["R-1", "R-2", "R-L (Δ, p)"]
        header += ["sentences/s", "tokens/s", "95% CI", "updates", "train tokens", "train min"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            cells = [r.run, r.prlm, r.layer, r.merge, r.position, r.side, _with_delta(r, "bleu", results.baseline), _fmt(r.chrf)]
            if summarization:
                cells += [_fmt(r.rouge1), _fmt(r.rouge2), _with_delta(r, "rougeL", results.baseline)]
            ci = f"{r.main_metric} [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
            cells += [_fmt(r.sentences_per_s, 1), _fmt(r.tokens_per_s, 0), ci, str(r.updates),
                      f"{r.train_tokens / 1e6:.2f}M", _fmt(r.train_seconds / 60, 1)]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        signatures = dict.fromkeys(f"{k}: {v}" for r in rows for k, v in sorted(r.signature.items()))
        lines += ["", "Signatures:", ""] + [f"- `{sig}`" for sig in signatures]
    return "\n".join(lines) + "\n"


_CSV_COLUMNS = [
    "test_set", "run", "prlm", "layer", "merge", "position", "side", "num_sentences", "bleu", "bleu_delta",
    "bleu_p", "chrf", "rouge1", "rouge2", "rougeL", "rougeL_delta", "rougeL_p", "compared_with", "main_metric", "ci_low",
    "ci_high", "sentences_per_s", "tokens_per_s", "decode_seconds", "updates", "train_tokens", "train_seconds", "checkpoints", "hyp_file", "run_dir",
]


def results_csv(results: EvaluationResults) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in results.rows:
        d = r.to_dict()
        row = {k: d.get(k) for k in _CSV_COLUMNS}
        for metric in ("bleu", "rougeL"):
            row[f"{metric}_delta"] = r.delta.get(metric, "")
            row[f"{metric}_p"] = r.p_value.get(metric, "")
        row["checkpoints"] = " ".join(r.checkpoints)
        writer.writerow(row)
    return buf.getvalue()


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def write_results(results: EvaluationResults) -> None:
    out = results.out
    atomic_write_text(out / "results.md", results_markdown(results))
    atomic_write_text(out / "results.csv", results_csv(results))
    atomic_write_json(
        out / "results.json",
        _json_safe({"baseline": results.baseline, "settings": results.settings, "rows": [r.to_dict() for r in results.rows]}),
    )


def plot_scores(results: EvaluationResults, path: Path) -> None:
    """Bar chart of the main metric per run and test set, with 95% bootstrap intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r.test_set for r in results.rows))
    fig, axes = plt.subplots(1, len(splits), figsize=(max(5.0, 1.1 * len(results.rows) / len(splits) + 2.5) * len(splits), 4.2), squeeze=False)
    for ax, split in zip(axes[0], splits):
        rows = [r for r in results.rows if r.test_set == split]
        metric = rows[0].main_metric
        scores = [getattr(r, metric) for r in rows]
        low = [max(0.0, s - r.ci_low) if math.isfinite(r.ci_low) else 0.0 for s, r in zip(scores, rows)]
        high = [max(0.0, r.ci_high - s) if math.isfinite(r.ci_high) else 0.0 for s, r in zip(scores, rows)]
        colors = ["#7f7f7f" if r.run == results.baseline else "#1f77b4" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x, scores, yerr=[low, high], capsize=4, color=colors)
        for xi, s, h, r in zip(x, scores, high, rows):
            p = r.p_value.get(metric)
            label = f"{s:.2f}" + (f"\np={p:.3f}" if p is not None else "")
            # Above the interval's top, so the label never sits on the error bar.
            ax.annotate(label, (xi, s + h), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [r.run for r in rows], rotation=30, ha="right")
        ax.set_ylabel({"bleu": "BLEU", "rougeL": "ROUGE-L F1"}.get(metric, metric))
        ax.set_title(f"{split}: {metric} with 95% bootstrap CI")
        top = max([s + h for s, h in zip(scores, high)] + [1.0])
        ax.set_ylim(0, top * 1.3)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def read_dev_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(update, dev loss) pairs from a run's metrics.jsonl; torn or foreign lines are skipped."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    points: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash mid-write
        if not isinstance(row, dict):
            continue
        update = row.get("update", row.get("updates", row.get("step")))
        loss = row.get("dev_loss")
        if loss is None and row.get("split") == "dev":
            loss = row.get("loss")
        if update is None or loss is None:
            continue
        try:
            points[int(update)] = float(loss)
        except (TypeError, ValueError):
            continue
    return sorted(points.items())


def plot_dev_loss(runs: list[RunView], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    plotted = 0
    for run in runs:
        curve = read_dev_curve(run.run_dir)
        if curve:
            xs, ys = zip(*curve)
            ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
            plotted += 1
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no dev evaluations in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("updates")
    ax.set_ylabel("dev loss (label-smoothed, per token)")
    ax.set_title("dev loss against updates")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def _save_figure(fig, path: Path) -> None:
    # Rendered in memory first so that an unchanged figure leaves the file untouched.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    atomic_write_bytes(path, buf.getvalue())
