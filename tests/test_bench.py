"""bench/_steal.py: steal accounting and the quiet-round median the benchmarks report."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from helpers import small_runs

BENCH = Path(__file__).parents[1] / "bench"


def _module(path: Path):
    """A bench script loaded as a module of its own name (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


steal = _module(BENCH / "_steal.py")


def test_quiet_median_uses_only_quiet_rounds():
    ratios = [1.10, 1.60, 1.12, 3.00, 1.14]
    steals = [0.01, 0.30, 0.02, 0.55, 0.00]
    assert steal.quiet_median(ratios, steals) == (pytest.approx(1.12), 3)


def test_quiet_median_falls_back_to_all_rounds():
    assert steal.quiet_median([1.0, 2.0, 4.0], [0.2, None, 0.3]) == (2.0, 3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_steal_fraction_is_a_fraction():
    mark = steal.steal_mark()
    sum(i * i for i in range(200_000))  # let the jiffy counters move
    fraction = steal.steal_since(mark)
    assert fraction is None or 0.0 <= fraction <= 1.0


def test_decode_bench_readers_serve_batch_features(monkeypatch):
    """bench/decode_throughput.py's in-memory and offset readers keep CacheReader's reading interface."""
    import torch

    from prlmfuse.train_fused.branches import PrLMBranch
    from prlmfuse.train_fused.data import batch_features

    spec = importlib.util.spec_from_file_location("decode_throughput", Path(__file__).parents[1] / "bench" / "decode_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_throughput", bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    states = [torch.randn(2, n, 8) for n in (3, 5, 4)]
    pooled = [torch.randn(3, 2, 8) for _ in states]
    reader = bench._Offset(bench.InMemoryFeatures(states, pooled, layers=[4, 5]), 1)
    feats = batch_features(PrLMBranch(reader, layer_rows=(1,), pooled_rows=(0, 2)), [0, 1])
    assert feats.states.shape == (2, 1, 5, 8)
    assert torch.equal(feats.states[1, 0, :4], states[2][1])
    assert feats.mask.sum(dim=1).tolist() == [5, 4]
    assert torch.equal(feats.pooled[1], pooled[2][[0, 2]])


def _train_bench(monkeypatch):
    """bench/train_throughput.py as a module, with bench/ on sys.path for its `from _steal import ...`."""
    monkeypatch.syspath_prepend(str(BENCH))
    return _module(BENCH / "train_throughput.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/stat is Linux's")
def test_train_bench_counts_worker_cpu_time(monkeypatch):
    """bench/train_throughput.py's per-batch worker CPU figure reads /proc/<pid>/stat correctly."""
    import os
    import time

    bench = _train_bench(monkeypatch)
    before, process_before = bench._cpu_seconds([os.getpid()]), time.process_time()
    sum(i * i for i in range(3_000_000))
    spent, process_spent = bench._cpu_seconds([os.getpid()]) - before, time.process_time() - process_before
    assert spent == pytest.approx(process_spent, abs=0.05)  # /proc counts in clock ticks (10 ms)
    assert bench._cpu_seconds([2**22 + 1]) == 0.0  # a pid that does not exist: nothing, no error


def test_train_bench_switches_end_on_prlmfuses_default(monkeypatch):
    """Every --compare switch of bench/train_throughput.py really swaps something, and its second
    variant (the one each cycle ends on) puts prlmfuse's own setting back."""
    from prlmfuse.train_fused import update_step

    bench = _train_bench(monkeypatch)
    before = update_step.label_smoothed_sums
    assert bench.SWITCH_NAMES == ("nll",)
    for name in bench.SWITCH_NAMES:
        without, default = bench._switches(name).values()
        without()
        assert update_step.label_smoothed_sums is not before, name
        default()
        assert update_step.label_smoothed_sums is before, name


def test_train_bench_compare_choices_name_existing_settings(monkeypatch):
    """--compare offers only settings prlmfuse still has, each variant a flag the bench parses."""
    import inspect

    bench = _train_bench(monkeypatch)
    parser_source = inspect.getsource(bench.main)
    assert set(bench.COMPARISONS).isdisjoint(bench.SWITCH_NAMES)
    for name, (systems, variants) in bench.COMPARISONS.items():
        assert len(variants) == 2 and set(systems) <= set("abcd"), name
        for extra in variants.values():
            assert f'add_argument("{extra[0]}"' in parser_source, (name, extra)


def test_batch_padding_bench_counts_both_orders(tmp_path, capsys):
    """bench/batch_padding.py on real Bible verses: source-first batches pad the source less than target-first ones."""
    import json

    corpus = small_runs.small_bible(tmp_path)
    bench = _module(BENCH / "batch_padding.py")
    assert bench.main(["--corpus", str(corpus.root), "--bpe-vocab", "600", "--max-tokens", "400"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("RESULT "))
    row = result["max_tokens_400"]
    assert row["source_first"]["src_padded_over_real"] < row["target_first"]["src_padded_over_real"]
    assert row["source_first"]["tgt_padded_over_real"] > row["target_first"]["tgt_padded_over_real"]
    assert all(r["src_padded_over_real"] >= 1 and r["batches"] > 1 for r in row.values())
    assert bench.main(["--corpus", str(tmp_path / "missing")]) == 2
    assert "corpus directory not found" in capsys.readouterr().err


def test_train_memory_bench_pipeline_names_one_run_per_system_and_size(tmp_path):
    """bench/train_memory.py's pipeline parses, with one run per (system, pairs) at the bench's settings."""
    from prlmfuse.config import load_pipeline

    bench = _module(BENCH / "train_memory.py")
    path = tmp_path / "pipeline.yaml"
    path.write_text(bench.pipeline_text(["baseline", "fused"], [10000, 30000], updates=200), encoding="utf-8")
    cfg = load_pipeline(path)
    runs = {r.name: r for r in cfg.train.runs}
    assert set(runs) == {"baseline-10000", "baseline-30000", "fused-10000", "fused-30000"}
    assert runs["baseline-30000"].max_train_pairs == 30000 and not runs["baseline-30000"].prlms
    fused = runs["fused-10000"]
    assert [(p.checkpoint, p.layer) for p in fused.prlms] == [("minilm-l6", -2)]
    assert (fused.preset, fused.bpe_vocab, fused.max_tokens, fused.max_updates) == ("small", 4000, 1200, 200)
    with pytest.raises(ValueError, match="unknown system"):
        bench.pipeline_text(["live"], [10])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_train_memory_bench_tells_loader_workers_from_helpers(tmp_path):
    """bench/train_memory.py finds forkserver-started and forked workers in a real process tree and reads their peak RSS."""
    import subprocess
    import time

    bench = _module(BENCH / "train_memory.py")
    script = tmp_path / "tree.py"
    script.write_text(
        "import multiprocessing as mp, sys, time\n"
        "def work():\n    time.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('forkserver').Process(target=work); p.start()\n"
        "    q = mp.get_context('fork').Process(target=work); q.start()\n"
        "    print('started', flush=True); time.sleep(60)\n",
        encoding="utf-8",
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        tree = bench.classify_tree(proc.pid)
        for _ in range(50):  # the worker appears under the forkserver once forked
            if len(tree["worker"]) == 2:
                break
            time.sleep(0.1)
            tree = bench.classify_tree(proc.pid)
        assert tree["train"] == [proc.pid]
        assert len(tree["worker"]) == 2  # one from the forkserver, one forked with the parent's command line
        assert any("forkserver" in bench.cmdline(pid) for pid in tree["helper"])
        peak = bench.TreePeak(proc.pid)
        peak.sample()
        assert peak.train_kib > 1000 and peak.worker_kib > 1000 and peak.tree_kib >= peak.train_kib + peak.worker_kib
        assert peak.workers_seen == set(tree["worker"])
    finally:
        import os
        import signal

        for pid in [*bench.classify_tree(proc.pid)["worker"], *bench.classify_tree(proc.pid)["helper"]]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    assert bench.status_kib(proc.pid) == {} and bench.children(proc.pid) == []


def _parity_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return _module(BENCH / "fairseq_parity.py")


def test_fairseq_parity_reads_both_logs_in_nats(monkeypatch):
    """bench/fairseq_parity.py converts fairseq's dev NLL from bits and pairs it with prlmfuse's at the same updates."""
    import math

    bench = _parity_bench(monkeypatch)
    fairseq_log = "\n".join([
        '2026-11-25 09:00:00 | INFO | train_inner | {"epoch": 1, "update": 0.2, "loss": "11.2", "nll_loss": "11.1", "num_updates": "50"}',
        '2026-11-25 09:01:00 | INFO | valid | {"epoch": 1, "valid_loss": "9.5", "valid_nll_loss": "8.0", "valid_num_updates": "100"}',
        "some warning without json",
        '2026-11-25 09:02:00 | INFO | valid | {"epoch": 1, "valid_loss": "8.5", "valid_nll_loss": "7.0", "valid_num_updates": "200"}',
    ])
    theirs = bench.fairseq_dev_nll(fairseq_log)
    assert theirs == {100: pytest.approx(8.0 * math.log(2)), 200: pytest.approx(7.0 * math.log(2))}
    metrics = "\n".join([
        '{"update": 50, "loss": 9.0, "nll_loss": 8.9}',
        '{"update": 100, "dev_loss": 6.0, "dev_nll_loss": 5.0}',
        '{"update": 300, "dev_loss": 5.0, "dev_nll_loss": 4.5}',
        "",
    ])
    ours = bench.prlmfuse_dev_nll(metrics)
    assert ours == {100: 5.0, 300: 4.5}
    rows = bench.table_rows(ours, theirs)
    assert [r["update"] for r in rows] == [100]
    assert rows[0]["ratio"] == pytest.approx(5.0 / (8.0 * math.log(2)))


def test_fairseq_parity_gives_fairseq_prlmfuses_ids_and_settings(tmp_path, monkeypatch):
    """fairseq's dictionary numbers prlmfuse's BPE ids as prlmfuse does; both sides get the issue's recipe."""
    from prlmfuse.config import load_pipeline

    bench = _parity_bench(monkeypatch)
    lines = bench.fairseq_dict_lines(10)
    # fairseq puts <s> <pad> </s> <unk> at 0..3 and a dictionary's tokens after them, in file order.
    assert [int(line.split()[0]) for line in lines] == list(range(4, 10))
    assert bench.id_line([17, 4, 523]) == "17 4 523"
    cmd = bench.fairseq_train_command("python", tmp_path / "bin", updates=200, eval_every=100, save_dir=tmp_path / "ck")
    opts = dict(zip(cmd, cmd[1:]))
    assert (opts["--max-tokens"], opts["--lr"], opts["--warmup-updates"], opts["--label-smoothing"]) == ("1200", "0.0007", "300", "0.1")
    assert (opts["--encoder-embed-dim"], opts["--encoder-layers"], opts["--encoder-ffn-embed-dim"]) == ("256", "3", "1024")
    assert "--share-all-embeddings" in cmd and "--encoder-normalize-before" not in cmd
    path = tmp_path / "pipeline.yaml"
    path.write_text(bench.pipeline_text(200, 100), encoding="utf-8")
    run = load_pipeline(path).run(bench.RUN)
    assert (run.preset, run.bpe_vocab, run.max_tokens, run.lr, run.warmup) == ("small", 4000, 1200, 7e-4, 300)
    assert (run.label_smoothing, run.dropout, run.max_updates, run.save_every, run.pre_ln) == (0.1, 0.1, 200, 100, False)
    assert not run.prlms


def test_int8_error_bench_shows_what_one_outlier_does_to_a_per_token_scale():
    bench = _module(BENCH / "int8_error.py")
    token = torch.full((1, 64), 1.0)
    token[0, 0] = 1000.0  # one outlier channel sets the token's scale: every other value rounds to 0
    assert bench.relative_errors(token, token) == (0.0, 0.0)
    read_back = bench.per_token_absmax(token)
    assert read_back[0, 0] == 1000.0 and (read_back[0, 1:] == 0).all()


def test_storage_dtype_bench_builds_and_reads_both_dtypes_of_the_same_verses(tmp_path, monkeypatch, capsys):
    import json

    bench = _module(BENCH / "storage_dtype.py")
    checkpoint = small_runs.tiny_prlm(tmp_path / "prlm", width=128)
    monkeypatch.setattr(sys, "argv", ["storage_dtype.py", "--checkpoint", str(checkpoint), "--sentences", "12",
                                      "--rounds", "2"])
    bench.main()
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1].removeprefix("RESULT "))
    assert result["tokens"] > 12 and set(result["build_seconds"]) == {"float16", "int8"}
    # int8 stores a byte per value plus a per-token scale and 4 exact outliers: at 128 wide, well under float16's two bytes
    assert result["bytes_per_token"]["int8"] < 0.75 * result["bytes_per_token"]["float16"]
    assert all(rate > 0 for rate in result["read_sentences_per_s"].values())


def test_significance_bench_gives_the_reports_p_beside_sacrebleus(capsys):
    """On Table 3's committed files: prlmfuse's two-sided p is the one `report --against fused` stored."""
    import json

    table3 = Path(__file__).parents[1] / "docs" / "results" / "table3"
    stored = json.loads((table3.parent / "table3.json").read_text(encoding="utf-8"))
    (against,) = [c for c in stored["against"] if c["run"] == "merge-average" and c["against"] == "fused"]
    bench = _module(BENCH / "significance.py")
    assert bench.main([str(table3 / "batch-1" / "ref.test.txt"), str(table3 / "batch-1" / "hyp.fused.test.txt"),
                       str(table3 / "batch-3" / "hyp.merge-average.test.txt"), "--ar-trials", "200"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("RESULT "))
    assert result["prlmfuse_two_sided"] == round(against["p_value"]["bleu"], 4)
    assert result["prlmfuse_one_sided"] * 2 == pytest.approx(result["prlmfuse_two_sided"], abs=2e-3)
    assert 0 < result["sacrebleu_paired_bs"] < result["prlmfuse_two_sided"]


def test_cache_at_scale_h5py_lane_reads_through_h5py_what_the_library_reads(monkeypatch):
    """--compare's hdf5 lane must stay a reader through h5py however the loader reads (features_into), or the
    side-by-side compares the library with itself."""
    import numpy as np

    from prlmfuse.cache_features import CacheReader
    from prlmfuse.cache_features.shard_handle import ShardHandle

    bench = _module(BENCH / "cache_at_scale.py")
    fixture = Path(__file__).parent / "fixtures" / "cache-format" / "hdf5-float16"
    library = CacheReader(fixture)
    ids = list(range(len(library)))[::-1]

    def rows(reader):
        out = [np.zeros((len(reader.layers), int(reader.lengths[i]) + 3, reader.hidden_size), np.float16) for i in ids]
        reader.features_into(ids, None, out)
        return out

    expected = rows(library)
    lane = bench.H5pyReader(fixture)
    monkeypatch.setattr(ShardHandle, "read_into", lambda *a, **k: pytest.fail("the h5py lane read through the library"))
    monkeypatch.setattr(ShardHandle, "read", lambda *a, **k: pytest.fail("the h5py lane read through the library"))
    got = rows(lane)
    assert len(lane.__dict__["_h5"]) == len(lane._shard_names)  # every shard opened by h5py
    assert all(np.array_equal(a, b) for a, b in zip(expected, got)) and any(a.any() for a in got)
    lane.close()


def test_url_read_bench_lanes_read_the_same_values_by_ranged_reads_and_by_zarrs_api():
    """url_read's zarr_api lane must go through zarr's array API and its library lane through ranged reads, over
    the same values (a committed layout-2 cache at its file:// URL)."""
    from prlmfuse.cache_features import CacheReader
    from prlmfuse.cache_features.shard_handle import _FileRegion

    bench = _module(BENCH / "url_read.py")
    url = f"file://{(Path(__file__).parent / 'fixtures' / 'cache-format' / 'zarr-layout2-float16').resolve()}"
    values, kinds = {}, {}
    for lane, context in bench.LANES.items():
        with context():
            reader = CacheReader(url)
            values[lane] = reader.features_many(range(len(reader)), widen=False)
            kinds[lane] = {type(a) for h in reader._handles.values() for a in h.arrays.values() if a.shape[0]}
            reader.close()
    assert kinds["library"] == {_FileRegion} and _FileRegion not in kinds["zarr_api"]
    assert all(torch.equal(a, b) for a, b in zip(values["library"], values["zarr_api"]))
