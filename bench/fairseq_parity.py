"""prlmfuse's baseline beside fairseq 0.12's `transformer`, trained at once on the same data: dev NLL and peak RSS.

Both train English->Japanese Bible (`prlmfuse run --only data`) with the same segmentation (the
joint BPE that train_run trains, `train_bpe` on the same lines: prlmfuse's bpe.json, whose ids
fairseq reads as its tokens), the same model (the `small` preset: 256 wide, 3+3 layers, 4 heads,
FFN 1,024, post-LN, shared embeddings), the same batching rule (at most 1,200 tokens, pairs sorted
by length as fairseq does), Adam(0.9, 0.98) at lr 7e-4 with 300 inverse-sqrt warmup updates,
label smoothing 0.1, dropout 0.1, seed 1, one thread each, the two processes side by side. Each
evaluates its dev loss every `--eval-every` updates; fairseq logs its NLL in bits, converted here
to nats (prlmfuse's unit). Peak RSS of each training process (VmHWM) and of its loader workers is
sampled from /proc as bench/train_memory.py does. prlmfuse trains at its device's default
precision (bf16 autocast on a CPU with AVX512-BF16 or AMX), fairseq in float32.

fairseq installs from the package index as `fairseq-fixed` into a venv of its own
(`--fairseq-python`, default .venv-fairseq/bin/python in this checkout):

    python3 -m venv .venv-fairseq && .venv-fairseq/bin/pip install torch==2.13.0 fairseq-fixed

    python bench/fairseq_parity.py --updates 4000 --eval-every 500 [--logdir work/bench-fairseq-parity]
    python bench/fairseq_parity.py --report LOGDIR        # the table from the logs of a run

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_memory import TreePeak  # noqa: E402

FAIRSEQ_PYTHON = str(REPO / ".venv-fairseq" / "bin" / "python")
RUN = "baseline"
SETTINGS = {"bpe_vocab": 4000, "max_tokens": 1200, "lr": 7e-4, "warmup": 300, "label_smoothing": 0.1, "dropout": 0.1, "seed": 1}

PIPELINE = """\
# Written by bench/fairseq_parity.py: prlmfuse's baseline at the settings fairseq trains with.
workdir: .
data: {{kind: bible, src: en, tgt: ja}}
train:
  defaults: {{preset: small, bpe_vocab: {bpe_vocab}, max_tokens: {max_tokens}, lr: {lr}, warmup: {warmup},
             label_smoothing: {label_smoothing}, dropout: {dropout}, seed: {seed}, max_updates: {updates},
             max_epochs: null, save_every: {eval_every}, keep_last: 1, num_workers: 1}}
  runs:
    {run}: {{}}
"""


def pipeline_text(updates: int, eval_every: int) -> str:
    return PIPELINE.format(run=RUN, updates=updates, eval_every=eval_every, **SETTINGS)


def fairseq_dict_lines(vocab_size: int, first_id: int = 4) -> list[str]:
    """fairseq's dict.txt for prlmfuse's ids: every id past the specials as a token of its own, in id order.

    fairseq numbers its own <s> <pad> </s> <unk> 0..3 and the dictionary's tokens from 4, so id i
    of prlmfuse (i >= 4) is fairseq's i as well; the model sees the same segmentation.
    """
    return [f"{i} 1" for i in range(first_id, vocab_size)]


def id_line(ids) -> str:
    """One sentence as fairseq reads it: prlmfuse's BPE ids as space-separated tokens."""
    return " ".join(str(int(i)) for i in ids)


def fairseq_train_command(python: str, data_bin: Path, *, updates: int, eval_every: int, save_dir: Path) -> list[str]:
    s = SETTINGS
    return [
        python, "-m", "fairseq_cli.train", str(data_bin),
        "--arch", "transformer", "--encoder-layers", "3", "--decoder-layers", "3",
        "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
        "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
        "--dropout", str(s["dropout"]), "--attention-dropout", "0", "--activation-dropout", "0",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-8",
        "--lr", str(s["lr"]), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(s["warmup"]),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", str(s["label_smoothing"]),
        "--max-tokens", str(s["max_tokens"]), "--max-update", str(updates), "--seed", str(s["seed"]),
        "--validate-interval-updates", str(eval_every), "--validate-interval", "1000000",
        "--no-save", "--save-dir", str(save_dir), "--cpu", "--num-workers", "1",
        "--log-format", "json", "--log-interval", "50", "--skip-invalid-size-inputs-valid-test",
    ]


def fairseq_dev_nll(log_text: str) -> dict[int, float]:
    """{update: dev NLL in nats} from fairseq's json log (its valid_nll_loss is in bits)."""
    out = {}
    for line in log_text.splitlines():
        start = line.find("{")
        if start < 0 or "valid_nll_loss" not in line:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        out[int(record["valid_num_updates"])] = float(record["valid_nll_loss"]) * math.log(2)
    return out


def prlmfuse_dev_nll(metrics_text: str) -> dict[int, float]:
    """{update: dev NLL in nats} from a prlmfuse run's metrics.jsonl."""
    out = {}
    for line in metrics_text.splitlines():
        if line.strip():
            record = json.loads(line)
            if "dev_nll_loss" in record:
                out[int(record["update"])] = float(record["dev_nll_loss"])
    return out


def table_rows(ours: dict[int, float], theirs: dict[int, float]) -> list[dict]:
    """One row per update count both logged: the two NLLs and prlmfuse's relative to fairseq's."""
    return [
        {"update": u, "prlmfuse": ours[u], "fairseq": theirs[u], "ratio": ours[u] / theirs[u]}
        for u in sorted(set(ours) & set(theirs))
    ]


def report(logdir: Path) -> dict:
    ours = prlmfuse_dev_nll((logdir / "runs" / RUN / "metrics.jsonl").read_text(encoding="utf-8"))
    theirs = fairseq_dev_nll((logdir / "fairseq" / "train.log").read_text(encoding="utf-8", errors="replace"))
    rows = table_rows(ours, theirs)
    rss = json.loads((logdir / "rss.json").read_text(encoding="utf-8")) if (logdir / "rss.json").is_file() else {}
    print(f"{'updates':>8} {'prlmfuse NLL':>13} {'fairseq NLL':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['update']:>8} {r['prlmfuse']:>13.3f} {r['fairseq']:>12.3f} {r['ratio']:>6.3f}")
    for name, peak in rss.items():
        print(f"{name}: peak RSS {peak['train_mb']:.0f} MB (loader worker {peak['worker_mb']:.0f} MB), {peak['wall_s']:.0f} s")
    if "prlmfuse" in rss and "fairseq" in rss:
        print(f"peak RSS prlmfuse / fairseq: {rss['prlmfuse']['train_mb'] / rss['fairseq']['train_mb']:.2f}")
    return {"rows": rows, "rss": rss}


def prepare(logdir: Path, args) -> Path:
    """Corpus, the joint BPE as train_run trains it, and fairseq's binarized copy of both splits in those ids."""
    from prlmfuse.config import load_pipeline
    from prlmfuse.fileio import read_lines
    from prlmfuse.pipeline_inputs import ensure_data
    from prlmfuse.train_fused.bpe import BPE, train_bpe
    from prlmfuse.train_fused.run_setup import _encode_split

    logdir.mkdir(parents=True, exist_ok=True)
    (logdir / "pipeline.yaml").write_text(pipeline_text(args.updates, args.eval_every), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "prlmfuse.cli", "--quiet", "run", str(logdir / "pipeline.yaml"), "--only", "data"],
                   check=True)
    cfg = load_pipeline(logdir / "pipeline.yaml")
    corpus = ensure_data(cfg, build=False)
    bpe_path = logdir / "bpe.json"
    if not bpe_path.is_file():
        train_bpe(read_lines(corpus.src_path("train")) + read_lines(corpus.tgt_path("train")), SETTINGS["bpe_vocab"]).save(bpe_path)
    bpe = BPE.load(bpe_path)
    data_bin = logdir / "fairseq" / "data-bin"
    if (data_bin / "dict.en.txt").is_file():
        return data_bin
    text = logdir / "fairseq" / "ids"
    text.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train"), ("dev", "valid")):
        src, tgt = _encode_split(bpe, corpus, split, None)
        (text / f"{name}.en").write_text("".join(id_line(s) + "\n" for s in src), encoding="utf-8")
        (text / f"{name}.ja").write_text("".join(id_line(t) + "\n" for t in tgt), encoding="utf-8")
    (text / "dict.txt").write_text("\n".join(fairseq_dict_lines(bpe.vocab_size)) + "\n", encoding="utf-8")
    subprocess.run([
        args.fairseq_python, "-m", "fairseq_cli.preprocess", "--source-lang", "en", "--target-lang", "ja",
        "--trainpref", str(text / "train"), "--validpref", str(text / "valid"), "--destdir", str(data_bin),
        "--srcdict", str(text / "dict.txt"), "--joined-dictionary", "--workers", "1",
    ], check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return data_bin


def train_both(logdir: Path, data_bin: Path, args) -> dict:
    """Both trainers at once, one thread each; their process trees sampled until both exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    run_dir = logdir / "runs" / RUN
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    commands = {
        "prlmfuse": [sys.executable, "-m", "prlmfuse.cli", "--quiet", "train", "-p", str(logdir / "pipeline.yaml"),
                     "--runs", RUN, "--fresh", "--device", "cpu"],
        "fairseq": fairseq_train_command(args.fairseq_python, data_bin, updates=args.updates, eval_every=args.eval_every,
                                         save_dir=logdir / "fairseq" / "checkpoints"),
    }
    logs = {"prlmfuse": run_dir / "train.log", "fairseq": logdir / "fairseq" / "train.log"}
    procs, peaks, started, walls = {}, {}, {}, {}
    for name, cmd in commands.items():
        with open(logs[name], "wb") as fh:
            procs[name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        peaks[name] = TreePeak(procs[name].pid)
        started[name] = time.perf_counter()
    while any(p.poll() is None for p in procs.values()):
        for name, p in procs.items():
            if p.poll() is None:
                peaks[name].sample()
            elif name not in walls:
                walls[name] = time.perf_counter() - started[name]
        time.sleep(0.05)
    for name, p in procs.items():
        walls.setdefault(name, time.perf_counter() - started[name])
        if p.returncode != 0:
            tail = logs[name].read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            raise SystemExit(f"{name} failed ({p.returncode}); {logs[name]}: {' | '.join(tail)}")
    if (run_dir / "bpe.json").read_bytes() != (logdir / "bpe.json").read_bytes():
        raise SystemExit(f"{run_dir / 'bpe.json'} differs from the BPE fairseq was given ({logdir / 'bpe.json'})")
    rss = {name: {"train_mb": peaks[name].train_kib * 1.024e-3, "worker_mb": peaks[name].worker_kib * 1.024e-3,
                  "other_mb": peaks[name].other_kib * 1.024e-3, "wall_s": walls[name]} for name in procs}
    (logdir / "rss.json").write_text(json.dumps(rss, indent=1), encoding="utf-8")
    return rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, default=REPO / "work" / "bench-fairseq-parity")
    parser.add_argument("--updates", type=int, default=4000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--fairseq-python", default=FAIRSEQ_PYTHON, help="python of the venv fairseq is installed in")
    parser.add_argument("--report", type=Path, metavar="LOGDIR", help="print the table from an earlier run's logs")
    args = parser.parse_args(argv)
    if args.report is not None:
        result = report(args.report)
        print("RESULT " + json.dumps(result))
        return 0
    else:
        if not Path(args.fairseq_python).is_file():
            print(f"error: no python at {args.fairseq_python}; install fairseq-fixed into a venv (see --help)", file=sys.stderr)
            return 2
        data_bin = prepare(args.logdir, args)
        train_both(args.logdir, data_bin, args)
        result = report(args.logdir)
    print("RESULT " + json.dumps({**result, "settings": {**SETTINGS, "updates": args.updates, "eval_every": args.eval_every}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
