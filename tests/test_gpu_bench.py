"""bench/gpu.py, the one command that gathers every GPU figure, runs end to end on the CPU at toy sizes.

The GPU run happens rarely and on a machine lent for minutes, so the script must not rot in between:
`--device cpu --tiny` takes the same code paths, and its gpu.json must hold every section with numbers
and a met/not verdict for every target.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "gpu.py"

SYSTEMS = ("baseline", "fused_disk", "fused_disk_more_workers", "fused_gpu_memory", "fused_live_prlm")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
def test_gpu_bench_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--out", str(out),
                           "--scratch", str(tmp_path / "scratch")],
                          capture_output=True, text=True, timeout=1200, cwd=BENCH.parents[1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    summary = json.loads(last.removeprefix("RESULT "))
    report = json.loads((out / "gpu.json").read_text(encoding="utf-8"))
    assert "RESULT " in (out / "gpu.log").read_text(encoding="utf-8")
    assert report["errors"] == [] and summary["errors"] == []

    sections = report["sections"]
    assert set(sections) == {"env", "tests", "inputs", "grid", "step", "shapes", "train", "cache", "decode", "torchrun",
                             "compile"}
    assert all(_number(s["seconds"]) for s in sections.values())
    env = sections["env"]
    assert env["torch"] and env["cache_backend"] in ("zarr", "hdf5") and env["device"] == "cpu"
    # On the CPU the CUDA-marked tests are collected and all skipped, and the run says so.
    assert sections["tests"]["returncode"] == 0 and "skipped" in sections["tests"]["summary"]
    assert _number(sections["inputs"]["matmul_peak"]["tflops"])

    assert sections["cache"]["backend"] == env["cache_backend"]
    for prlm in ("minilm-l6", "bert-random"):
        cache = sections["cache"][prlm]
        for key in ("naive_tokens_per_s", "bare_tokens_per_s", "build_tokens_per_s", "build_over_naive",
                    "build_over_bare"):
            assert _number(cache[key]) and cache[key] > 0, (prlm, key)
        # every backend and storage dtype built once, against the bare forward and the disk's raw write
        assert set(cache["variants"]) == {"hdf5-float16", "hdf5-int8", "zarr-float16", "zarr-int8"}
        for variant in cache["variants"].values():
            for key in ("build_tokens_per_s", "build_over_bare", "store_GBps", "build_over_raw_write"):
                assert _number(variant[key]) and variant[key] > 0, (prlm, key)
        int8, float16 = cache["variants"]["zarr-int8"], cache["variants"]["zarr-float16"]
        assert int8["stored_bytes"] < float16["stored_bytes"]  # int8 keeps about half float16's bytes
    assert _number(sections["cache"]["raw_write_GBps"]) and sections["cache"]["raw_write_GBps"] > 0

    train = sections["train"]
    assert set(train["systems"]) == set(SYSTEMS)
    for name in SYSTEMS:
        system = train["systems"][name]
        for key in ("step_ms_median", "timed_s", "target_tokens_per_s", "data_wait_fraction", "mfu"):
            assert _number(system[key]), (name, key)
        # every system timed in each round, the fastest kept, each step's time with it
        assert len(system["rounds"]) == report["sizes"]["train_rounds"] == 2, name
        assert system["timed_s"] == min(r["timed_s"] for r in system["rounds"]) and "round_errors" not in system
        assert len(system["step_ms"]) == report["sizes"]["steps"] and all(_number(t) for t in system["step_ms"])
    assert _number(train["systems"]["fused_live_prlm"]["prlm_non_embedding_parameters"])

    shapes = sections["shapes"]
    for name in ("new_shapes", "seen_shapes"):  # each choice timed on its own batches, in both passes
        for choice in ("cudnn_off", "cudnn_allowed"):
            times = shapes[name][f"{choice}_step_ms"]
            assert len(times) == report["sizes"]["shape_steps"] and all(_number(t) for t in times), (name, choice)
        assert _number(shapes[name]["allowed_over_off"])

    assert _number(sections["decode"]["fused_over_baseline"])
    torchrun = sections["torchrun"]
    assert torchrun["ok"] and torchrun["child"]["backend"] == "gloo" and torchrun["child"]["updates"] == 2
    assert _number(sections["compile"]["compile_true"]["step_ms_median"]) and _number(sections["compile"]["off_over_on"])

    # The GPU path: every step system of every size timed and profiled, no graph compiled after the first pass.
    step = sections["step"]["configs"]
    assert list(step) == ["tiny_800", "tiny_400"]
    for config in step.values():
        for name in ("eager", "static_eager", "static_compiled"):
            system = config["systems"][name]
            assert _number(system["step_ms_median"]) and _number(system["mfu"]) and system["profiled"]["aten_ops"] > 0
            assert system["graphs_compiled_while_timed"] == 0, name
        assert config["systems"]["static_eager"]["shapes"] <= config["systems"]["eager"]["shapes"]
        assert _number(config["compiled_over_eager"])
    assert summary["ops_per_step"]["tiny_400"]["eager"] == step["tiny_400"]["systems"]["eager"]["profiled"]["aten_ops"]
    grid = sections["grid"]
    assert set(grid["runs"]) == {"1", "2"} and _number(grid["eager_one_updates_per_s"])
    for k, run in grid["runs"].items():
        assert len(run["children"]) == int(k) and _number(run["updates_per_s_sum"]) and run["overlap"] > 0

    targets = report["targets"]
    assert len(targets) == 11 + 1 + 3 + 2 + 2 * 4  # and a build target per PrLM, backend and dtype
    for target in targets:
        # the one GPU-only measure: the GPU kernels' own time, which a CPU has not
        assert isinstance(target["met"], bool) and (_number(target["value"]) or "GPU kernel" in target["target"]), target
        assert summary["targets"][target["target"]] == {"value": target["value"], "met": target["met"]}
    assert report["gpu_plan_s"]["grid"] > 0 and set(report["gpu_plan_s"]) == set(sections)


def test_the_bench_times_random_weights_of_minilms_shape_where_its_checkpoint_did_not_travel(tmp_path, monkeypatch):
    # A bundle for the bench calls may leave MiniLM's weights behind to fit the node's copy limit: every section
    # still gets a PrLM of MiniLM-L6's shape, and the cache section builds from it.
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import gpu
    import gpu_inputs
    import torch
    from gpu_report import Report

    shared = {"minilm": str(tmp_path / "no-such-checkpoint"), "backend": "hdf5"}
    (tmp_path / "scratch").mkdir()
    result = gpu_inputs.inputs(Report(tmp_path / "out"), gpu.TINY, torch.device("cpu"), tmp_path / "scratch", shared)
    assert "minilm-l6" in result["unavailable"]
    minilm = result["prlms"]["minilm-l6"]
    assert (minilm["layers"], minilm["hidden_size"]) == (6, 384)
    assert shared["minilm"] == minilm["path"] and shared["prlms"]["minilm-l6"].path == minilm["path"]
    assert "random weights of its shape" in (tmp_path / "out" / "gpu.log").read_text(encoding="utf-8")


NODE_SCRIPT = BENCH.parent / "gpu_node.sh"


@pytest.mark.parametrize("args, says", [
    (["out", "60", "bench", "warmup"], "unknown step 'warmup'"),
    (["out", "60", "bench:shape"], "bench/gpu.py has no section 'shape'"),
    (["out", "ten", "probe"], "SECONDS must be a whole number"),
    (["out", "60"], "usage: bash bench/gpu_node.sh"),
    (["out", "60", "probe"], "no offline/install.sh here"),
])
def test_gpu_node_script_refuses_bad_input_in_one_line_before_writing_anything(tmp_path, args, says):
    # The node is lent for minutes: a typo must fail at once, before the bundle's install or any step.
    done = subprocess.run(["bash", str(NODE_SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _node_tree(tmp_path, files: list[str], stub: str, **settings: str):
    """A node tree holding `files` (repo paths), a bundle whose install does nothing, and a `prlmfuse` on PATH
    that runs the bash `stub` after recording its arguments in calls.txt: (tree, env for gpu_node.sh)."""
    repo = BENCH.parents[1]
    tree = tmp_path / "tree"
    (tree / "examples").mkdir(parents=True)
    (tree / "offline").mkdir()
    for name in files:
        shutil.copy(repo / name, tree / name)
    (tree / "offline" / "install.sh").write_text("echo installed\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prlmfuse = bin_dir / "prlmfuse"
    prlmfuse.write_text('#!/usr/bin/env bash\necho "$@" >> calls.txt\n' + stub)
    prlmfuse.chmod(0o755)
    return tree, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **settings}


def test_gpu_node_headline_decodes_what_training_saved_when_the_deadline_stops_it(tmp_path):
    # Training that runs into DECODE_SECONDS is stopped there; the runs have saved what they trained, and the
    # step still decodes test in the time it kept.
    tree, env = _node_tree(tmp_path, ["examples/default-en-ja-base.yaml"],
                           'case "$*" in *"--only train"*) sleep 60 ;; esac\n', DECODE_SECONDS="20")
    done = subprocess.run(["bash", str(NODE_SCRIPT), str(tmp_path / "out"), "40", "headline"],
                          capture_output=True, text=True, timeout=120, cwd=tree, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tree / "calls.txt").read_text().splitlines()
    assert [c.rsplit("--only ", 1)[1] for c in calls] == ["cache", "train", "evaluate --no-score"]
    session = (tmp_path / "out" / "session.txt").read_text()
    assert "(stopped at the deadline)" in session and "test is decoded from the checkpoints the runs have" in session


@pytest.mark.parametrize("name", ["PROBE_UPDATES", "HEADLINE_UPDATES", "SUMMARIZATION_UPDATES", "DECODE_SECONDS"])
def test_gpu_node_script_refuses_a_budget_that_is_not_a_whole_number(tmp_path, name):
    done = subprocess.run(["bash", str(NODE_SCRIPT), "out", "60", "headline"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, name: "1.5"})
    assert done.returncode == 2
    assert done.stderr.strip() == f"gpu_node.sh: {name} must be a whole number, got '1.5'"
    assert not (tmp_path / "out").exists()


def test_gpu_node_script_runs_its_steps_in_order_on_node_pipeline_files(tmp_path):
    # A node tree: the two pipeline files the steps derive from, a bundle whose install does nothing, and
    # a `prlmfuse` that records its arguments and leaves a run behind, so the steps and the packing run
    # here in seconds; the pipeline files they write must load and point at the bundle's checkpoint.
    from prlmfuse.config import load_pipeline

    tree, env = _node_tree(
        tmp_path, ["examples/results-en-ja-base.yaml", "examples/default-en-ja-base.yaml", "pipeline.yaml"],
        'd=$(dirname "$2")/../work/$(basename "$2" .yaml)/runs/baseline.seed-1; mkdir -p "$d"\n'
        'echo "{}" > "$d/metrics.jsonl"; echo weights > "$d/best.safetensors"\n',
        PROBE_UPDATES="7", HEADLINE_UPDATES="9", DECODE_SECONDS="5")
    done = subprocess.run(["bash", str(NODE_SCRIPT), str(tmp_path / "out"), "120", "probe", "headline", "demo"],
                          capture_output=True, text=True, timeout=120, cwd=tree, env=env)
    assert done.returncode == 0, done.stdout + done.stderr

    calls = (tree / "calls.txt").read_text().splitlines()
    assert calls[:2] == ["run offline/probe.yaml --runs baseline.seed-1,fused.seed-1 --only cache",
                         "run offline/probe.yaml --runs baseline.seed-1,fused.seed-1 --only train"]
    headline_runs = "--runs baseline,default,baseline-matched-default --device cuda"
    assert calls[2:5] == [f"run offline/headline.yaml {headline_runs} --only cache",
                          f"run offline/headline.yaml {headline_runs} --only train",
                          f"run offline/headline.yaml {headline_runs} --only evaluate --no-score"]
    # with MeCab the whole pipeline in one call; without, cache, train and a decode-only evaluation
    assert calls[5:] in (["run offline/demo.yaml --device cuda"],
                         ["run offline/demo.yaml --device cuda --only cache", "run offline/demo.yaml --device cuda --only train",
                          "run offline/demo.yaml --device cuda --only evaluate --no-score"]), calls
    session = (tmp_path / "out" / "session.txt").read_text()
    assert session.index("== probe") < session.index("== headline") < session.index("== demo")
    assert "no offline/corpus" in session

    probe = load_pipeline(tree / "offline" / "probe.yaml")
    assert probe.workdir.resolve() == (tree / "work" / "probe").resolve()
    assert probe.train.defaults["max_updates"] == 7
    assert probe.cache.checkpoints[0].name == "offline/checkpoints/minilm-l6"
    headline = load_pipeline(tree / "offline" / "headline.yaml")
    assert headline.workdir.resolve() == (tree / "work" / "headline").resolve()
    assert headline.train.defaults["max_updates"] == 9 and headline.train.defaults["preset"] == "base"
    assert [c.name for c in headline.cache.checkpoints] == ["offline/checkpoints/minilm-l6"]
    assert {r.name: r.prlms[0].checkpoint for r in headline.train.runs if r.prlms} == {
        "default": "offline/checkpoints/minilm-l6"}
    demo = load_pipeline(tree / "offline" / "demo.yaml")
    assert demo.workdir.resolve() == (tree / "work" / "demo").resolve()
    assert demo.cache.checkpoints[0].name == "offline/checkpoints/minilm-l6"

    with tarfile.open(tmp_path / "out" / "probe.tar.gz") as tar:
        names = tar.getnames()
    assert "offline/probe.yaml" in names and "work/probe/runs/baseline.seed-1/metrics.jsonl" in names
    assert not any(n.endswith(".safetensors") for n in names)
    with tarfile.open(tmp_path / "out" / "headline.tar.gz") as tar:
        names = tar.getnames()
    assert "offline/headline.yaml" in names and "work/headline/runs/baseline.seed-1/metrics.jsonl" in names
    assert not any(n.endswith(".safetensors") for n in names)


def test_gpu_node_summarization_trains_the_four_runs_on_the_bundled_corpus_and_scores_on_the_node(tmp_path):
    # The node cannot fetch apt's lists: the step unpacks the bundled corpus where the data stage finds it,
    # trains the four runs at the paper's summarization width to SUMMARIZATION_UPDATES, and evaluates with
    # scoring (ROUGE needs no MeCab).
    from prlmfuse.config import load_pipeline

    tree, env = _node_tree(
        tmp_path, ["examples/summarization-compare-debian-base.yaml"],
        'd=$(dirname "$2")/../work/$(basename "$2" .yaml)/runs/fused; mkdir -p "$d"\n'
        'echo "{}" > "$d/metrics.jsonl"; echo weights > "$d/best.safetensors"\n',
        SUMMARIZATION_UPDATES="11", DECODE_SECONDS="5")
    # a node whose bundle left zarr out (`prlmfuse bundle --leave-out zarr`): the step's caches are hdf5
    python3 = tmp_path / "bin" / "python3"
    python3.write_text(f'#!/usr/bin/env bash\ncase "$*" in *"import zarr"*) exit 1 ;; esac\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    corpus = tmp_path / "debian-descriptions"
    corpus.mkdir()
    (corpus / "corpus.json").write_text("{}")
    (tree / "offline" / "corpus").mkdir()
    with tarfile.open(tree / "offline" / "corpus" / "debian-descriptions.tar.gz", "w:gz") as tar:
        tar.add(corpus, arcname="debian-descriptions")
    done = subprocess.run(["bash", str(NODE_SCRIPT), str(tmp_path / "out"), "60", "summarization"],
                          capture_output=True, text=True, timeout=120, cwd=tree, env=env)
    assert done.returncode == 0, done.stdout + done.stderr

    runs = "--runs baseline,fused,default,baseline-matched-default --device cuda"
    assert (tree / "calls.txt").read_text().splitlines() == [
        f"run offline/summarization.yaml {runs} --only cache", f"run offline/summarization.yaml {runs} --only train",
        f"run offline/summarization.yaml {runs} --only evaluate"]
    assert (tree / "work" / "summarization" / "data" / "debian-descriptions" / "corpus.json").is_file()
    assert "no offline/corpus" not in (tmp_path / "out" / "session.txt").read_text()
    cfg = load_pipeline(tree / "offline" / "summarization.yaml")
    assert cfg.workdir.resolve() == (tree / "work" / "summarization").resolve()
    assert cfg.data.kind == "debian-descriptions" and cfg.train.defaults["preset"] == "summarization"
    assert cfg.train.defaults["max_updates"] == 11 and cfg.evaluate.baseline == "baseline"
    assert cfg.cache.backend == "hdf5" and cfg.cache.dtype == "float16"
    assert {r.name: [p.checkpoint for p in r.prlms] for r in cfg.train.runs} == {
        "baseline": [], "fused": ["offline/checkpoints/minilm-l6"], "default": ["offline/checkpoints/minilm-l6"],
        "baseline-matched-default": []}
    with tarfile.open(tmp_path / "out" / "summarization.tar.gz") as tar:
        names = tar.getnames()
    assert "offline/summarization.yaml" in names and "work/summarization/runs/fused/metrics.jsonl" in names
    assert not any(n.endswith(".safetensors") for n in names)
