"""How much padding the trainer's token-budget batches carry, beside those of the other sort order.

`TokenBudgetBatchSampler.build_batches` forms batches from the pairs sorted by length as fairseq
does: by target length, then stably by source length, so source length is the primary key
("source_first"). This also forms the batches with the two sorts the other way round
("target_first": every batch takes sentences of nearly equal target length but widely spread
source lengths) and prints, for the training split of a corpus and each `--max-tokens`, the
number of batches and the padded over real token counts of the source and of the target side
(each batch padded to its longest, as the trainer pads). Encoder work, and with it every PrLM branch, grows
with the padded source; decoder layers with the padded target. No timing: the counts are exact.

    python bench/batch_padding.py [--corpus DIR] [--max-tokens 1200 3500] [--bpe-vocab 4000]
                                  [--storage-windows CHECKPOINT] [--prlm CHECKPOINT]

The batches of `static_shapes: true` ("static_shapes_4", and "static_shapes_8" over a ladder twice as
fine) are counted too, each padded to its class's rounded lengths and rows: with the number of distinct
shapes a compiled step captures, and every position computed (source, target and PrLM features together)
over those of prlmfuse's token-budget batches.

--storage-windows: also the batches of `train.read_window` K ("storage_window_K", K = 1, 2, 4, 8, 32)
over a cache of CHECKPOINT, which stores the training sources sorted by their token length, ties by
line: windows of K batches' worth of neighbouring stored sentences, each sorted by the longer side's
length, then target, then source length, and cut under the budget. With it (or with --prlm), every order also
counts the padding of the PrLM features (the checkpoint's token lengths), which the PrLM attention reads.

Default corpus: the Bible English->Japanese corpus under $PRLMFUSE_HOME (built if missing). The
last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def padding(batches: list[list[int]], lens: np.ndarray, *, padded: list[tuple[int, int]] | None = None) -> float:
    """Padded over real tokens of one side (the batches hold every pair once): each batch padded to its longest,
    or to the (rows, length) of `padded` (static_shapes: its class's)."""
    padded = padded or [(len(b), int(lens[b].max())) for b in batches]
    return sum(rows * length for rows, length in padded) / float(lens.sum())


def target_first_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: int) -> list[list[int]]:
    """build_batches with the two length sorts swapped: target length is the primary key."""
    from prlmfuse.batching import token_budget_batches

    ranked = np.random.RandomState(seed).permutation(len(src_lens))
    ranked = ranked[np.argsort(src_lens[ranked], kind="stable")]
    ranked = ranked[np.argsort(tgt_lens[ranked], kind="stable")]
    return [b.tolist() for b in token_budget_batches(ranked, np.maximum(src_lens, tgt_lens), max_tokens)]


def storage_window_batches(storage: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int,
                           window: int, seed: int) -> list[list[int]]:
    """The batches of train.read_window `window` over a cache that stores the sentences in `storage` order."""
    from prlmfuse.train_fused.batch_samplers import StorageWindowBatchSampler

    return StorageWindowBatchSampler(src_lens, tgt_lens, max_tokens, storage, window=window, seed=seed).batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=None, help="a prlmfuse corpus directory (default: the Bible en->ja under $PRLMFUSE_HOME)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1200, 3500])
    parser.add_argument("--bpe-vocab", type=int, default=4000, help="joint BPE size (default 4000, the demo's and results' recipe)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--storage-windows", metavar="CHECKPOINT",
                        help="also batches drawn from windows of sentences neighbouring in a cache of CHECKPOINT")
    parser.add_argument("--prlm", metavar="CHECKPOINT",
                        help="count the padding of CHECKPOINT's features too (static_shapes sorts its classes by them)")
    args = parser.parse_args(argv)

    from prlmfuse.corpora import build_bible, load_corpus
    from prlmfuse.fileio import prlmfuse_home
    from prlmfuse.errors import UserError
    from prlmfuse.train_fused.batch_samplers import TokenBudgetBatchSampler
    from prlmfuse.train_fused.bpe import train_bpe
    from prlmfuse.train_fused.buckets import STEPS_PER_OCTAVE, BatchShapes

    try:
        corpus = load_corpus(Path(args.corpus)) if args.corpus else build_bible(prlmfuse_home() / "corpora" / "bible-en-ja")
        src = corpus.src_path("train").read_text(encoding="utf-8").splitlines()
        tgt = corpus.tgt_path("train").read_text(encoding="utf-8").splitlines()
        bpe = train_bpe(src + tgt, args.bpe_vocab)
    except UserError as e:
        print(f"batch_padding: {e}", file=sys.stderr)
        return 2
    # +1 for </s>, as PairDataset counts them.
    src_lens = np.array([len(x) + 1 for x in bpe.encode_batch(src)], dtype=np.int64)
    tgt_lens = np.array([len(x) + 1 for x in bpe.encode_batch(tgt)], dtype=np.int64)
    # What the BPE made of each side: a vocabulary crowded by a large alphabet learns few merges.
    chars = [len(set("".join(lines)) - {" "}) for lines in (src, tgt)]
    print(f"corpus {corpus.root}: {len(src_lens)} train pairs; BPE {args.bpe_vocab} gave {bpe.vocab_size} ids; "
          f"source {int(src_lens.sum())} tokens ({src_lens.mean() - 1:.1f} pieces a sentence, {chars[0]} distinct "
          f"characters), target {int(tgt_lens.sum())} ({tgt_lens.mean() - 1:.1f}, {chars[1]})", file=sys.stderr)

    storage = prlm_lens = None
    if args.storage_windows or args.prlm:
        from prlmfuse.cache_features.extract import encode_corpus
        from prlmfuse.prlms import load_prlm, resolve_checkpoint

        _model, tokenizer = load_prlm(resolve_checkpoint(args.storage_windows or args.prlm))
        prlm_lens = encode_corpus(tokenizer, src, max_length=512).lengths
        if args.storage_windows:
            storage = np.argsort(prlm_lens, kind="stable")

    result: dict = {"corpus": str(corpus.root), "bpe_vocab": args.bpe_vocab}
    for max_tokens in args.max_tokens:
        orders = {
            "target_first": target_first_batches(src_lens, tgt_lens, max_tokens, args.seed),
            "source_first": TokenBudgetBatchSampler.build_batches(src_lens, tgt_lens, max_tokens, seed=args.seed),
        }
        for window in (1, 2, 4, 8, 32) if storage is not None else ():
            orders[f"storage_window_{window}"] = storage_window_batches(storage, src_lens, tgt_lens, max_tokens,
                                                                        window, args.seed)
        static = {}
        for steps in (4, 8):  # the ladder static_shapes uses (STEPS_PER_OCTAVE) and a finer one
            shapes = BatchShapes.fit(src_lens, tgt_lens, prlm_lens, max_tokens, steps_per_octave=steps)
            name = f"static_shapes_{steps}" + ("" if steps == STEPS_PER_OCTAVE else " (finer ladder)")
            order = np.random.RandomState(args.seed).permutation(len(src_lens))
            orders[name] = shapes.batches(src_lens, tgt_lens, prlm_lens, order)
            static[name] = shapes
        sides = {"src": src_lens, "tgt": tgt_lens} | ({"prlm": prlm_lens} if prlm_lens is not None else {})
        row = {}
        for name, batches in orders.items():
            shapes = static.get(name)
            padded = {side: None for side in sides}
            if shapes is not None:
                classes = [shapes.shape(int(src_lens[b].max()), int(tgt_lens[b].max()),
                                        int(prlm_lens[b].max()) if prlm_lens is not None else 0) for b in batches]
                padded = {side: [(c[0], c[k]) for c in classes] for k, side in enumerate(sides, start=1)}
            over = {side: padding(batches, lens, padded=padded[side]) for side, lens in sides.items()}
            row[name] = {"batches": len(batches)} | {f"{side}_padded_over_real": round(v, 3) for side, v in over.items()}
            # every position a step computes (source, target and PrLM features), against today's batches
            row[name]["positions"] = int(round(sum(over[side] * float(lens.sum()) for side, lens in sides.items())))
            if shapes is not None:
                row[name]["distinct_shapes"] = len(set(classes))
                row[name]["ratios"] = {"target": round(shapes.target_ratio, 3), "prlm": round(shapes.prlm_ratio, 3)}
            label = {"target_first": "target first", "source_first": "prlmfuse (source first)"}.get(name, name)
            prlm = f", PrLM {row[name]['prlm_padded_over_real']:.3f}" if prlm_lens is not None else ""
            distinct = f"; {row[name]['distinct_shapes']} shapes" if shapes is not None else ""
            print(f"max_tokens {max_tokens:5d}  {label:30s} {row[name]['batches']:6d} batches  padded/real: "
                  f"source {row[name]['src_padded_over_real']:.3f}, target {row[name]['tgt_padded_over_real']:.3f}{prlm}"
                  f"{distinct}")
        for name in static:
            row[name]["positions_over_source_first"] = round(row[name]["positions"] / row["source_first"]["positions"], 3)
            print(f"max_tokens {max_tokens:5d}  {name}: {row[name]['positions_over_source_first']:.3f}x the positions "
                  "of prlmfuse's batches (source, target and PrLM together)")
        result[f"max_tokens_{max_tokens}"] = row
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
