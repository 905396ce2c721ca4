"""Why prlmfuse's p-values are larger than `sacrebleu --paired-bs` on the same files.

    python bench/significance.py REF BASELINE_HYP SYSTEM_HYP [--tgt-lang ja] [--samples 1000]

Scores the two hypothesis files against REF with BLEU (ja-mecab for Japanese, as prlmfuse does) and
prints, side by side:
- prlmfuse's p (evaluate.metrics.paired_p_value): Koehn (2004)'s paired bootstrap, the share of
  resampled test sets on which the system is not better, made two-sided by doubling the smaller tail;
- its one-sided half in the observed direction: the share of resampled sets on which Δ's sign turns;
- sacrebleu's paired bootstrap (`--paired-bs`, Moses's bootstrap-hypothesis-difference-significance.pl):
  the resampled absolute differences centred on their mean, and the share of them beyond the observed
  absolute difference;
- sacrebleu's approximate randomisation (`--paired-ar`, its default test).
The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    from prlmfuse.evaluate.metrics import bleu_tokenizer_for, bootstrap_scores, paired_p_value, sentence_stats
    from prlmfuse.fileio import read_lines

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref")
    parser.add_argument("baseline")
    parser.add_argument("system")
    parser.add_argument("--tgt-lang", default="ja")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--ar-trials", type=int, default=10000, help="sacrebleu's approximate randomisation trials")
    parser.add_argument("--seed", type=int, default=12345, help="the bootstrap seed (prlmfuse's and sacrebleu's default)")
    args = parser.parse_args(argv)

    refs = read_lines(args.ref)
    base, system = read_lines(args.baseline), read_lines(args.system)
    tokenize = bleu_tokenizer_for(args.tgt_lang)

    stats = [sentence_stats(h, refs, metric="bleu", tgt_lang=args.tgt_lang) for h in (base, system)]
    samples = [bootstrap_scores(s, n_samples=args.samples, seed=args.seed) for s in stats]
    delta = samples[1] - samples[0]
    ours = paired_p_value(*samples)
    # One-sided in the direction observed: the share of resampled sets on which the sign of Δ turns.
    one_sided = min(np.count_nonzero(delta <= 0) + 1, np.count_nonzero(delta >= 0) + 1) / (len(delta) + 1)

    metrics = {"BLEU": BLEU(tokenize=tokenize)}
    found = {}
    for test in ("bs", "ar"):
        _, results = PairedTest([("baseline", base), ("system", system)], metrics, [refs], test_type=test,
                                n_samples=args.samples if test == "bs" else args.ar_trials)()
        found[test] = results["BLEU"][1].p_value
    result = {
        "bleu_baseline": round(stats[0].score, 2), "bleu_system": round(stats[1].score, 2),
        "delta": round(stats[1].score - stats[0].score, 2), "samples": args.samples,
        "prlmfuse_two_sided": round(ours, 4), "prlmfuse_one_sided": round(float(one_sided), 4),
        "sacrebleu_paired_bs": round(float(found["bs"]), 4), "sacrebleu_paired_ar": round(float(found["ar"]), 4),
        "ar_trials": args.ar_trials, "tokenize": tokenize,
    }
    print(f"BLEU {result['bleu_baseline']} -> {result['bleu_system']} (Δ {result['delta']:+.2f}), {tokenize}, "
          f"{args.samples} resamples")
    print(f"prlmfuse paired bootstrap, two-sided  : p {result['prlmfuse_two_sided']:.3f}")
    print(f"  one-sided, in the observed direction: p {result['prlmfuse_one_sided']:.3f}")
    print(f"sacrebleu --paired-bs                 : p {result['sacrebleu_paired_bs']:.3f}")
    print(f"sacrebleu --paired-ar ({args.ar_trials:,} trials){' ' * max(0, 6 - len(f'{args.ar_trials:,}'))}: p "
          f"{result['sacrebleu_paired_ar']:.3f}")
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
