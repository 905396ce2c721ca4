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

import hashlib
import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import torch

from prlmfuse.errors import UserError
from prlmfuse.evaluate.bootstrap import BOOTSTRAP_SAMPLES, add_bootstrap, matched_baselines
from prlmfuse.evaluate.corpus_decode import decode_corpus, encode_sources, note_truncated
from prlmfuse.evaluate.metrics import DEFAULT_SEED, comparison_stats, corpus_scores
from prlmfuse.evaluate.plots import plot_dev_loss, plot_scores
from prlmfuse.evaluate.results import EvaluationResults, RunResult, hypothesis_figures, stable_order, write_results
from prlmfuse.evaluate.runs import RunView, load_model, open_run, select_weights, weights_fingerprint
from prlmfuse.evaluate.settings import AVERAGE, AVERAGE_LAST, BATCH_TOKENS, DEFAULTS, DecodeSettings
from prlmfuse.fileio import atomic_write_json, atomic_write_text, read_lines, sha256_file
from prlmfuse.precision import Runtime, machine_line, resolve_runtime
from prlmfuse.train_fused import run_dir as rundir

logger = logging.getLogger(__name__)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def _decode_key(run: RunView, weights: list[Path], settings: DecodeSettings, split: str, src_sha: str, cache_keys: list[str]) -> str:
    payload = {
        "weights": weights_fingerprint(weights),
        "bpe": sha256_file(run.run_dir / rundir.BPE_JSON),
        "decode": settings.to_dict(),
        "test": {"split": split, "src_sha256": src_sha, "caches": cache_keys},
        # the sources as the model reads them; only where the run cuts them, so other runs keep their keys
        **({"max_source_tokens": run.max_source_tokens} if run.max_source_tokens is not None else {}),
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
    hyps = read_lines(hyp_path, check_text=False) if num_lines else []  # our own output, any text
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
    beam: int = DEFAULTS.beam,
    average_last: int = AVERAGE_LAST,
    average: str = AVERAGE,
    lenpen: float = DEFAULTS.lenpen,
    no_repeat_ngram_size: int | None = None,
    max_len_a: float = DEFAULTS.max_len_a,
    max_len_b: int = DEFAULTS.max_len_b,
    min_len: int = DEFAULTS.min_len,
    batch_tokens: int = BATCH_TOKENS,
    bf16: bool = DEFAULTS.bf16,
    device: str = "auto",
    bleu_tokenize: str | None = None,
    bootstrap_samples: int = BOOTSTRAP_SAMPLES,
    seed: int = DEFAULT_SEED,
    progress: bool = True,
    score: bool = True,
    at_update: int | None = None,
) -> EvaluationResults:
    """Decode and score every run on every test set; write results.md/csv/json, hypotheses and plots.

    test_sets: split names of each run's corpus (default: ["test"]); features come from the
    caches recorded in run.json for that split. baseline: a run name (or its directory name);
    default the one run without PrLM branches, if there is exactly one. no_repeat_ngram_size:
    default 3 for summarization corpora, 0 otherwise. bleu_tokenize: sacrebleu tokenizer for
    every run (e.g. 'intl'); default by target language ('zh', 'ja-mecab', 'ko-mecab', '13a').
    score False: decode only, for a machine without the metric's tokenizer (a GPU node without MeCab);
    results.json records no scores, and `score_evaluation` (`prlmfuse score`) scores it where one is.
    at_update: every run as it was at that update, a budget it reached and trained on past (a step of a
    budget curve): the average of its saves up to there, and its row's cost and dev losses up to there.
    """
    out = Path(out)
    runtime = Runtime(resolve_runtime(device, "auto").device, torch.bfloat16 if bf16 else torch.float32)
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
    logger.info("evaluate: %d run(s) -> %s (%s)", len(runs), out, runtime.describe())
    splits = list(test_sets) if test_sets else ["test"]

    rows: list[RunResult] = []
    sentence_level: dict[tuple[str, str], dict] = {}  # (run, split) -> {metric: SentenceStats}
    refs_sha: dict[tuple[str, str], str] = {}
    out.mkdir(parents=True, exist_ok=True)

    for run in runs:
        weights = select_weights(run, average_last, average, at_update)
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
            branches = run.open_branches(run.test_cache_paths(split), source=str(src_path),
                                         source_name=f"{split} source", source_sha256=src_sha,
                                         source_lines=len(src_lines))
            cache_keys = [b.reader.key for b in branches]
            key = _decode_key(run, weights, settings, split, src_sha, cache_keys)
            stem = f"hyp.{_safe_name(run.name)}.{_safe_name(split)}"
            hyp_path, meta_path = out / f"{stem}.txt", out / f"{stem}.json"
            reused = _reuse_hypotheses(hyp_path, meta_path, key, len(src_lines))
            if reused is not None:
                hyps, meta = reused
            else:
                if model is None:
                    model, bpe = load_model(run, weights, average, at_update)
                    model.to(runtime.device)
                cut: dict = {}
                src_ids = encode_sources(bpe, src_lines, int(run.model_config.get("max_positions", 1024)),
                                         max_source_tokens=run.max_source_tokens, stats=cut)
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
                    "capped_sources": cut["capped"],  # cut to the run's max_source_tokens, as in training
                }
                atomic_write_json(meta_path, meta)
            if score:
                scores, stats = score_hypotheses(hyps, refs, tgt_lang=run.tgt_lang, task=run.task,
                                                 bleu_tokenize=bleu_tokenize)
            else:
                scores, stats = dict(UNSCORED), {}
            main_metric = "rougeL" if run.task == "summarization" else "bleu"
            sentence_level[(run.name, split)] = stats
            refs_sha[(run.name, split)] = sha256_file(tgt_path)
            ref_file = _keep_references(out, split, tgt_path, refs_sha[(run.name, split)])
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
                    **hypothesis_figures(hyps, src_lines, task=run.task),
                    main_metric=main_metric, **run.budget(at_update),
                    seed=(run.record.get("train") or {}).get("seed"), tgt_lang=run.tgt_lang,
                    trainable_parameters=run.record.get("trainable_parameters"),
                    hyp_sha256=meta["hyp_sha256"], ref_file=ref_file, ref_sha256=refs_sha[(run.name, split)],
                    corpus_sha256=run.corpus_digest(),
                )
            )
        del model

    baseline_of = matched_baselines(runs, baseline_name)
    if score:
        add_bootstrap(rows, sentence_level, refs_sha, baseline_of, n_samples=bootstrap_samples, seed=seed)
    else:  # `prlmfuse score` compares them once scored
        for row in rows:
            row.compared_with = baseline_of.get(row.run)
    # Reports list runs in one order whatever order the directories were given in.
    order = {name: i for i, name in enumerate(stable_order(names, baseline_name))}
    rows.sort(key=lambda r: (splits.index(r.test_set), order[r.run]))
    runs.sort(key=lambda r: order[r.name])
    settings_record = {
        "beam": beam, "lenpen": lenpen, "average_last": average_last, "average": average, "max_len_a": max_len_a,
        "max_len_b": max_len_b, "min_len": min_len, "no_repeat_ngram_size": no_repeat_ngram_size, "bf16": bf16,
        "bleu_tokenize": bleu_tokenize,
        "bootstrap_samples": bootstrap_samples, "seed": seed, "test_sets": splits,
        "machine": machine_line(runtime.device), "scored": score,
    }
    if at_update is not None:  # absent otherwise, as in results.json files written before it existed
        settings_record["at_update"] = at_update
    results = EvaluationResults(out=out, baseline=baseline_name, rows=rows, settings=settings_record)
    write_results(results)
    if score:
        plot_scores(results, out / "scores.png")
    else:  # a plot of an earlier evaluation in this folder is not of these hypotheses
        (out / "scores.png").unlink(missing_ok=True)
    def dev_curve(run, key: str = "dev_loss") -> list[tuple[int, float]]:
        # Under at_update, the run as it was there: its dev evaluations up to that update.
        return [(u, loss) for u, loss in rundir.read_dev_curve(run.run_dir, key) if at_update is None or u <= at_update]

    curves = {run.name: dev_curve(run) for run in runs}
    plot_dev_loss(runs, curves, out / "dev_loss.png", baseline_name)
    # The plotted curves as numbers too, for tables that quote them.
    atomic_write_json(out / "dev_loss.json", {
        "what": "each run's dev loss (runs: label-smoothed, as trained and plotted; nll: its NLL, comparable "
                "across label smoothing) at every dev evaluation, [update, loss], from its metrics.jsonl",
        "runs": {name: [list(point) for point in curve] for name, curve in curves.items()},
        "nll": {run.name: [list(point) for point in dev_curve(run, "dev_nll_loss")] for run in runs},
    })
    return results


# What an unscored row records in place of scores (`evaluate_runs(score=False)`).
UNSCORED = {"bleu": float("nan"), "chrf": float("nan"), "rouge1": float("nan"), "rouge2": float("nan"),
            "rougeL": float("nan"), "signature": {}}


def score_hypotheses(hyps: list[str], refs: list[str], *, tgt_lang: str, task: str,
                     bleu_tokenize: str | None) -> tuple[dict, dict]:
    """Corpus scores of a run's hypotheses, and the per-sentence statistics its bootstrap resamples."""
    scores = corpus_scores(hyps, refs, tgt_lang=tgt_lang, task=task, bleu_tokenize=bleu_tokenize)
    return scores, comparison_stats(hyps, refs, task=task, tgt_lang=tgt_lang, bleu_tokenize=bleu_tokenize)


def _keep_references(out: Path, split: str, tgt_path: Path, sha256: str) -> str:
    """Copy a test set's references beside the results, so that the results, hypotheses and references
    travel together and `prlmfuse report` can score them elsewhere. Named ref.<split>.txt, or
    ref.<split>-N.txt when the folder already keeps other references of that split (results.json
    records each file's sha256)."""
    stem = f"ref.{_safe_name(split)}"
    for n in itertools.count(1):
        name = f"{stem}.txt" if n == 1 else f"{stem}-{n}.txt"
        if not (out / name).is_file():
            atomic_write_text(out / name, Path(tgt_path).read_text(encoding="utf-8"))
            return name
        if sha256_file(out / name) == sha256:
            return name
    raise AssertionError("unreachable")


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
