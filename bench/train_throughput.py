"""Training-step cost of fusing a PrLM from the cache, against the alternatives, in ONE process.

Same batches (token budget over the Bible English->Japanese corpus), same model size, same
optimizer step (the trainer's own `Trainer.train_step`) for four systems:

  (a) baseline   the plain Transformer, batches through DataLoader workers
  (b) cached     fused, PrLM features read from the cache on disk by DataLoader workers
  (c) in-memory  fused, the cache loaded into RAM, read in-process
  (d) live PrLM  fused, the frozen PrLM tokenizes and runs inside every training step (bert-nmt)

and, for what README's setting choices cost, two more fused settings read from an every-layer cache
held in memory, as `prlmfuse train` opens it:

  (e) headline   the penultimate layer after the FFN, read by the encoder and the decoder
  (f) default    the shipped default: Concat of every cached layer after the first add&norm, both sides

The systems take turns step by step: every system keeps one DataLoader (workers alive) for the whole
run, and a cycle runs one update of each system on the same batch, in reverse order every other
cycle (a-b-c-d, d-c-b-a, ...). A round is `--steps` timed cycles; there are `--rounds` of them,
after `--warmup` untimed cycles. Why step by step: on a shared machine the speed of a window of
seconds drifts while the code does not change, and updates a second apart see the same machine.
Taking a batch hands its workers the next one to read, so (b) reads during the update, as in real
training; the workers' CPU time per batch is printed beside it. A reported ratio is the median,
over the cycles with at most 5% of the vCPU time stolen (`_steal.py`; all cycles if none was), of
each cycle's ratio, with its quartiles; per-round ratios of summed step times are shown beside it,
and step times are medians over rounds. Data wait = time the loop spent waiting for the next batch,
as a fraction of the step time. The last line is `RESULT {json}`.

    python bench/train_throughput.py [--checkpoint minilm-l6] [--preset small] [--rounds 8]
    python bench/train_throughput.py --systems aef --max-tokens 1200 --threads 1 --workers 0

`--compare nll|rows` instead measures one of prlmfuse's speed settings, without and with it, on
systems (a) and (b), and prints the median of the step-time ratios. `nll` can change between two
updates: one run times both variants, each system's two updates on the same batch back to back, and
the ratio is the median over quiet cycles as above (default 8 rounds). The others take effect at
process start: child processes, the variants alternating, each child one round of 16 timed cycles
(default 5 rounds); the ratio is the median over quiet rounds, printed with the peak-memory ratio.
  nll     the NLL logged beside the loss as a separate logsumexp over the logits vs derived from
          the smoothed loss (train_fused.update_step.label_smoothed_sums)
  rows    output logits and loss over every padded target position vs the real ones only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _steal import QUIET_STEAL, quiet_median, steal_mark, steal_since, worst_steal


def _corpus(home: Path, train_pairs: int):
    """The first `train_pairs` Bible verses (and short dev/test) as a corpus of their own."""
    from prlmfuse.corpora import build_bible, load_corpus, register_text

    full = build_bible(home / "corpora" / "bible-en-ja")
    out = home / "bench" / f"bible-en-ja-first{train_pairs}"
    if (out / "corpus.json").is_file():
        return load_corpus(out)
    files = {}
    raw = Path(tempfile.mkdtemp(prefix="train-bench-"))
    for split, n in (("train", train_pairs), ("dev", 64), ("test", 64)):
        for side in ("src", "tgt"):
            lines = (full.root / f"{split}.{side}").read_text(encoding="utf-8").splitlines()[:n]
            path = raw / f"{split}.{side}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            files[f"{split}_{side}"] = path
    return register_text(out, **files, src_lang="en", tgt_lang="ja", name=f"bible-en-ja-first{train_pairs}")


class _LivePrLM:
    """bert-nmt's way: tokenize the raw source and run the frozen PrLM inside the training step."""

    def __init__(self, info, layer: int, runtime):
        from prlmfuse.prlms import load_prlm

        self.model, self.tokenizer = load_prlm(info)
        self.model.to(runtime.device)
        self.layer = layer
        self.max_length = int(info.max_length)
        self.runtime = runtime

    @torch.no_grad()
    def features(self, lines: list[str]):
        from prlmfuse.train_fused.modeling import PrLMFeatures

        enc = self.tokenizer(lines, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        enc = {k: v.to(self.runtime.device) for k, v in enc.items()}
        with self.runtime.autocast():
            hidden = self.model(**enc, output_hidden_states=True).hidden_states[self.layer]
        return PrLMFeatures(states=hidden.float()[:, None], mask=enc["attention_mask"].bool(), pooled=None)


def _logsumexp_nll_sums(logits, target, smoothing):
    """The NLL as a separate logsumexp over the logits beside the smoothed loss (the "without" of --compare nll)."""
    import torch.nn.functional as F

    from prlmfuse.train_fused.bpe import PAD_ID

    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum")
    with torch.no_grad():
        keep = flat_target != PAD_ID
        target_logit = flat_logits.gather(1, flat_target.unsqueeze(1)).squeeze(1)
        nll = ((torch.logsumexp(flat_logits, dim=-1) - target_logit) * keep).sum()
    return loss, nll


def _step(trainer, batches, live: _LivePrLM | None, src_lines) -> tuple[float, float, int]:
    """One update on the next batch of `batches`: (seconds waiting for it, seconds in all, target tokens)."""
    t0 = time.perf_counter()
    batch = next(batches)
    t1 = time.perf_counter()
    if live is not None:
        batch.prlm = [live.features([src_lines[j] for j in batch.ids.tolist()])]
    trainer.train_step(batch)
    if trainer.device.type == "cuda":  # the step's kernels run asynchronously: time them to the end
        torch.cuda.synchronize(trainer.device)
    return t1 - t0, time.perf_counter() - t0, batch.ntokens


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes `pids` so far (from /proc; 0 where unreadable)."""
    import os

    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


def _median(values: list[float]) -> float:
    return float(np.median(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="minilm-l6", help="checkpoint alias or local dir (default minilm-l6)")
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--layer", type=int, default=-2)
    parser.add_argument("--max-tokens", type=int, default=3500)
    parser.add_argument("--steps", type=int, default=None, help="timed cycles (one update of each system) per round (default 8; 16 in --compare)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed cycles before the first round (default 2; 4 in --compare)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of --steps cycles (default 8; in --compare, child processes per variant, default 5)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-pairs", type=int, default=6000)
    parser.add_argument("--bpe-vocab", type=int, default=8000)
    parser.add_argument("--home", default=None, help="where corpus and caches go (default $PRLMFUSE_HOME)")
    parser.add_argument("--systems", default="abcd", help="which of a, b, c, d, e, f to time (default abcd)")
    parser.add_argument("--logit-rows", choices=["scored", "all"], default="scored",
                        help="loss over the real target positions only (prlmfuse's) or over every padded one")
    parser.add_argument("--compare", choices=sorted([*COMPARISONS, *SWITCH_NAMES]),
                        help="time (a) and (b) without and with one of prlmfuse's speed settings")
    args = parser.parse_args(argv)
    if args.compare and args.compare not in SWITCH_NAMES:
        return _compare(args.compare, argv if argv is not None else sys.argv[1:], args.rounds or 5, args.steps, args.warmup)
    if args.compare:
        args.systems = "ab"
    args.steps = args.steps or 8
    args.warmup = 2 if args.warmup is None else args.warmup
    args.rounds = args.rounds or 8
    unknown = set(args.systems) - set("abcdef")
    if unknown or not args.systems:
        raise SystemExit(f"--systems takes letters from abcdef, got {args.systems!r}")

    torch.set_num_threads(args.threads)
    from prlmfuse.cache_features import build_cache
    from prlmfuse.prlms import prepare_alias, resolve_checkpoint
    from prlmfuse.fileio import prlmfuse_home
    from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler
    from prlmfuse.train_fused.bpe import train_bpe
    from prlmfuse.train_fused.config import PrLMUse, RunConfig
    from prlmfuse.train_fused.data import PairDataset, make_loader
    from prlmfuse.distributed import DistContext
    from prlmfuse.train_fused.modeling import FusedTransformer, PrLMSpec
    from prlmfuse.precision import resolve_runtime
    from prlmfuse.cache_features import CacheReader
    from prlmfuse.train_fused.branches import PrLMBranch, open_branch
    from prlmfuse.train_fused import update_step
    from prlmfuse.train_fused.trainer import Trainer

    home = Path(args.home) if args.home else prlmfuse_home()
    corpus = _corpus(home, args.train_pairs)
    try:
        info = prepare_alias(args.checkpoint)
    except Exception:  # not an alias: a local directory or hub id
        info = resolve_checkpoint(args.checkpoint)
    absolute_layer = args.layer if args.layer >= 0 else info.num_layers + 1 + args.layer
    caches = {}
    for split in ("train", "dev"):
        out = home / "bench" / "caches" / f"{Path(info.name).name}-{corpus.name}-{split}"
        caches[split] = build_cache(args.checkpoint, corpus.src_path(split), out, layers=str(absolute_layer), progress=True).path
    if set(args.systems) & set("ef"):
        out = home / "bench" / "caches" / f"{Path(info.name).name}-{corpus.name}-train-all"
        caches["train-all"] = build_cache(args.checkpoint, corpus.src_path("train"), out, layers="all", progress=True).path
    print(f"corpus {corpus.root} ({corpus.num_pairs('train')} train pairs), caches {caches['train']}", file=sys.stderr)

    src_lines = (corpus.root / "train.src").read_text(encoding="utf-8").splitlines()
    tgt_lines = (corpus.root / "train.tgt").read_text(encoding="utf-8").splitlines()
    bpe = train_bpe(src_lines + tgt_lines, args.bpe_vocab)
    src_ids = [np.asarray(x, dtype=np.int32) for x in bpe.encode_batch(src_lines)]
    tgt_ids = [np.asarray(x, dtype=np.int32) for x in bpe.encode_batch(tgt_lines)]
    sampler_args = dict(seed=1, shuffle=False)
    # The same batches for every system: epoch 0 of the trainer's length-bucketed, shuffled order.
    order_sampler = TokenBudgetBatchSampler(
        np.array([len(s) + 1 for s in src_ids]), np.array([len(t) + 1 for t in tgt_ids]), args.max_tokens, seed=1
    )
    needed = args.warmup + args.steps
    chosen = [order_sampler.batches[b] for b in order_sampler.epoch_order(0)][:needed]
    if len(chosen) < needed:
        raise SystemExit(f"only {len(chosen)} batches; raise --train-pairs")

    def sampler_over(batches):
        s = TokenBudgetBatchSampler(np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64), args.max_tokens, **sampler_args)
        s.batches = batches
        return s

    use = PrLMUse(checkpoint=args.checkpoint, layer=args.layer)
    # The paper's fused setting (encoder side, after the FFN), which results.md's figures of this bench measure.
    run = RunConfig(name="bench", preset=args.preset, prlms=[use], side="source", position="ffn",
                    max_tokens=args.max_tokens, max_updates=needed, num_workers=args.workers, dropout=0.1)
    spec = PrLMSpec(name=info.name, width=info.hidden_size, num_layers=1, num_pooled=absolute_layer + 1)
    runtime = resolve_runtime(args.device)
    bf16 = runtime.dtype == torch.bfloat16
    ctx = DistContext()
    tmp_run = Path(tempfile.mkdtemp(prefix="train-bench-run-"))

    class AllRowsTrainer(Trainer):
        """Logits [B, T, V] over every padded target position, pads ignored by the loss (the "without" of --compare rows)."""

        def _forward_sums(self, batch):
            batch = batch.to(self.device)
            with self.runtime.autocast():
                logits = self.model(batch.src_tokens, batch.tgt_in, batch.prlm)
            return update_step.label_smoothed_sums(logits, batch.tgt_out, self.run.label_smoothing)

    trainer_class = AllRowsTrainer if args.logit_rows == "all" else Trainer

    def make_trainer(prlm_specs, sources, run_config=run):
        torch.manual_seed(1)
        model = FusedTransformer(run_config.model_config(bpe.vocab_size, prlm_specs))
        dataset = PairDataset(src_ids, tgt_ids, sources)
        return trainer_class(run_config, tmp_run, model, dataset, dataset, ctx, progress=False, runtime=runtime), dataset

    def cached(in_memory: bool):
        return [PrLMBranch(CacheReader(caches["train"], in_memory=in_memory), layer_rows=(0,), pooled_rows=None)]

    def every_layer(layer, **setting):
        """A trainer of `layer` and `setting` (RunConfig fields; the rest at their defaults) over the
        every-layer cache, opened as a run opens it."""
        use = PrLMUse(checkpoint=args.checkpoint, layer=layer)
        branch = open_branch(use, str(caches["train-all"]), trained=None, source=str(corpus.src_path("train")),
                             source_name="train source", source_sha256=corpus.src_sha256("train"),
                             source_lines=corpus.num_pairs("train"), seed=1, in_memory=True)
        setting = {"position": None, "side": None, **setting}
        return make_trainer([branch.spec], [branch], dataclasses.replace(run, prlms=[use], **setting))

    makers = {
        "a": lambda: make_trainer([], []),
        "b": lambda: make_trainer([spec], cached(False)),
        "c": lambda: make_trainer([spec], cached(True)),
        "d": lambda: make_trainer([spec], []),  # features come from the live PrLM, not from a cache
        "e": lambda: every_layer(args.layer, position="ffn", side="both"),
        "f": lambda: every_layer("concat"),  # position and side at their defaults
    }
    systems = {k: make() for k, make in makers.items() if k in args.systems}
    for key in set(systems) & set("cef"):
        # Their features are in RAM from the start, as in_memory_features holds them; one read before timing.
        branch = systems[key][1].branches[0]
        branch.reader.features(0, branch.layer_rows)
    live = _LivePrLM(info, args.layer, runtime) if "d" in systems else None
    sizes = {k: f"{t.model.num_parameters() / 1e6:.1f}M" for k, (t, _) in systems.items()}
    print(f"model {args.preset}: parameters {sizes}; {runtime.describe()}; "
          f"{needed} batches of <= {args.max_tokens} tokens; PrLM {info.name} ({info.num_layers} layers, d={info.hidden_size})",
          file=sys.stderr)

    # One loader per system for the whole run: the warmup cycles' batches, then each round's.
    # (d) reads token batches only; its features come from the live PrLM inside the step.
    # A lane is what a cycle times once: a system, or with --compare of a switch, a system under
    # one variant of it. Both variants of a system share its trainer and loader, and the loader
    # yields every batch twice, so the two take the same batch one after the other.
    switch = _switches(args.compare) if args.compare else None
    variants = list(switch) if switch else [None]
    plain = PairDataset(src_ids, tgt_ids, [])
    batches = [b for b in chosen[: args.warmup] + chosen[args.warmup :] * args.rounds for _ in variants]
    feeds, worker_pids = {}, {}
    for key, (trainer, dataset) in systems.items():
        workers = 0 if key in "cef" else args.workers
        loader = make_loader(plain if key == "d" else dataset, sampler_over(batches), num_workers=workers)
        feeds[key] = iter(loader)
        worker_pids[key] = [w.pid for w in getattr(feeds[key], "_workers", [])]
    def lane_name(key, variant):
        return key if variant is None else f"{key}:{variant}"

    lanes = {lane_name(key, v): (key, v) for key in systems for v in variants}

    # Per lane, (wait, step, target tokens) of every timed cycle; rounds are slices of args.steps.
    timed: dict[str, list[tuple[float, float, int]]] = {k: [] for k in lanes}
    cycle_steal: list[float | None] = []

    def cycle(i: int, record: bool):
        mark = steal_mark()
        keys = list(systems) if i % 2 == 0 else list(reversed(systems))
        order = variants if i % 2 == 0 else list(reversed(variants))
        for key in keys:
            for variant in order:
                if switch:
                    switch[variant]()
                out = _step(systems[key][0], feeds[key], live if key == "d" else None, src_lines)
                if record:
                    timed[lane_name(key, variant)].append(out)
        if record:
            cycle_steal.append(steal_since(mark))

    for i in range(args.warmup):
        cycle(i, record=False)
    results: dict[str, list[dict]] = {k: [] for k in lanes}
    round_steal: list[float | None] = []
    worker_cpu = {k: 0.0 for k in systems}
    for r in range(args.rounds):
        cpu_before = {k: _cpu_seconds(pids) for k, pids in worker_pids.items()}
        mark = steal_mark()
        for i in range(args.steps):
            cycle(i, record=True)
        round_steal.append(steal_since(mark))
        for k in systems:
            worker_cpu[k] += _cpu_seconds(worker_pids[k]) - cpu_before[k]
        for lane, records in timed.items():
            wait, step, tokens = (sum(column) for column in zip(*records[-args.steps :]))
            results[lane].append({"step_s": step / args.steps, "data_wait_fraction": wait / step, "tgt_tokens_per_s": tokens / step})
        stolen = round_steal[-1]
        print(f"round {r + 1}: " + ", ".join(f"({k}) {o[-1]['step_s'] * 1000:.0f}" for k, o in results.items())
              + " ms/step, steal " + ("unknown" if stolen is None else f"{stolen:.1%}"), file=sys.stderr)
    feeds.clear()

    typical = {k: {f: _median([o[f] for o in v]) for f in ("step_s", "data_wait_fraction")} for k, v in results.items()}
    names = {"a": "baseline", "b": "fused, cache on disk (workers)", "c": "fused, cache in memory", "d": "fused, live PrLM",
             "e": "headline fused, in memory", "f": "shipped default, in memory"}
    for lane, (key, variant) in lanes.items():
        name = names[key] + ("" if variant is None else f", {variant}")
        times = ", ".join(f"{o['step_s'] * 1000:.0f}" for o in results[lane])
        print(f"({lane}) {name:32s} {typical[lane]['step_s'] * 1000:8.1f} ms/step (median; rounds {times})  "
              f"data wait {typical[lane]['data_wait_fraction']:6.1%}")
    result = {
        "checkpoint": args.checkpoint,
        "preset": args.preset,
        "max_tokens": args.max_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "bf16": bf16,
        "logit_rows": args.logit_rows,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "step_ms": {k: round(v["step_s"] * 1000, 1) for k, v in typical.items()},
        "parameters": {k: t.model.num_parameters() for k, (t, _) in systems.items()},
        "steal_fraction_rounds": [None if x is None else round(x, 3) for x in round_steal],
        "quiet_steal": QUIET_STEAL,
    }
    if switch:
        without, with_ = variants
        pairs = [(f"{k}:{without}", f"{k}:{with_}", f"{k}_{without}_over_{with_}") for k in systems]
        result["compare"] = args.compare
    else:
        pairs = [(top, bottom, f"{top}_over_{bottom}")
                 for top, bottom in (("b", "a"), ("b", "c"), ("d", "b"), ("e", "a"), ("f", "a"), ("f", "e"))]
    for top, bottom, name in pairs:
        if top in results and bottom in results:
            # The reported ratio: the median over quiet cycles of each cycle's ratio (the same batch,
            # updates seconds apart), which a burst of steal or of a neighbour's load on a few
            # updates cannot move; per-round ratios of summed step times are shown beside it.
            per_cycle = [t[1] / u[1] for t, u in zip(timed[top], timed[bottom])]
            ratio, used = quiet_median(per_cycle, cycle_steal)
            result[name] = round(ratio, 3)
            result[f"{name}_quartiles"] = [round(float(q), 3) for q in np.percentile(per_cycle, [25, 75])]
            result[f"{name}_cycles_used"] = used
            result[f"{name}_rounds"] = [round(t["step_s"] / u["step_s"], 3) for t, u in zip(results[top], results[bottom])]
    if "b" in typical:
        result["data_wait_fraction"] = round(typical["b"]["data_wait_fraction"], 4)
    # Worker CPU time per batch, beside the step: the reading a batch hands to the workers fits
    # inside one update, so it lands in the system's own steps (see the module docstring).
    result["worker_cpu_ms_per_batch"] = {k: round(v * 1000 / (args.rounds * args.steps * len(variants)), 1)
                                         for k, v in worker_cpu.items() if worker_pids[k]}
    print("RESULT " + json.dumps(result))
    return 0


# Settings that can change between two updates of one process: --compare of these times both
# variants in one run, each system's two updates on the same batch back to back (see the lanes in
# main); name -> {variant: set it}, the second variant is prlmfuse's default.
SWITCH_NAMES = ("nll",)


def _switches(name: str) -> dict:
    """{variant: function that sets it} for the switch `name`, prlmfuse's own functions captured
    before anything replaces them."""
    from prlmfuse.train_fused import update_step

    from_loss = update_step.label_smoothed_sums

    def setter(module, attribute, value):
        return lambda: setattr(module, attribute, value)

    return {
        # update_step.label_smoothed_sums is what Trainer._forward_sums (UpdateStepMixin's) calls
        "nll": {"logsumexp": setter(update_step, "label_smoothed_sums", _logsumexp_nll_sums),
                "fromloss": setter(update_step, "label_smoothed_sums", from_loss)},
    }[name]


# The other settings take effect at process start: child processes, the two variants alternating.
# name -> (systems timed, {variant: extra arguments}); the second variant is prlmfuse's default.
COMPARISONS = {
    "rows": ("ab", {"all": ["--logit-rows", "all"], "scored": ["--logit-rows", "scored"]}),
}


def _compare(name: str, argv: list[str], rounds: int, steps: int | None, warmup: int | None) -> int:
    """The systems in child processes, the two variants alternating; medians of per-round ratios."""
    import subprocess

    passthrough, skip = [], False
    for a in argv:  # drop --compare X / --compare=X and --rounds N (each child runs one round)
        if skip:
            skip = False
        elif a in ("--compare", "--rounds"):
            skip = True
        elif not a.startswith(("--compare=", "--rounds=")):
            passthrough.append(a)
    # Each child runs one round; 16 cycles give it as many timed updates per system as two main-mode rounds.
    if steps is None:
        passthrough += ["--steps", "16"]
    if warmup is None:
        passthrough += ["--warmup", "4"]
    systems, variants = COMPARISONS[name]
    children: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for variant in order:
            cmd = [sys.executable, __file__, *passthrough, *variants[variant], "--systems", systems, "--rounds", "1"]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            child = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
            print(f"round {r + 1} ({variant}): step_ms {child['step_ms']}, steal {child['steal_fraction_rounds']}, "
                  f"max RSS {child['max_rss_mib']} MiB", file=sys.stderr)
            children[variant].append(child)
    without, with_ = variants
    result = {"compare": name, "rounds": rounds}
    for v in variants:
        result[v] = {
            "step_ms": {k: round(_median([c["step_ms"][k] for c in children[v]]), 1) for k in systems},
            "max_rss_mib": max(c["max_rss_mib"] for c in children[v]),
        }
    def steal(child):
        return child["steal_fraction_rounds"][0]  # each child runs one round

    for k in systems:
        pairs = list(zip(children[without], children[with_]))
        per_round = [x["step_ms"][k] / y["step_ms"][k] for x, y in pairs]
        ratio, used = quiet_median(per_round, [worst_steal(steal(x), steal(y)) for x, y in pairs])
        result[f"{k}_{without}_over_{with_}"] = round(ratio, 3)
        result[f"{k}_{without}_over_{with_}_rounds"] = [round(x, 3) for x in per_round]
        result[f"{k}_{without}_over_{with_}_rounds_used"] = used
    result[f"rss_{without}_over_{with_}"] = round(result[without]["max_rss_mib"] / result[with_]["max_rss_mib"], 3)
    print("RESULT " + json.dumps(result))
    return 0

if __name__ == "__main__":
    sys.exit(main())
