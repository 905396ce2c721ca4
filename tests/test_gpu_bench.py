"""bench/gpu.py, the one command that gathers every GPU figure, runs end to end on the CPU at toy sizes.

The GPU run happens rarely and on a machine lent for minutes, so the script must not rot in between:
`--device cpu --tiny` takes the same code paths, and its gpu.json must hold every section with numbers
and a met/not verdict for every target.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
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
    assert set(sections) == {"env", "tests", "inputs", "cache", "train", "shapes", "decode", "torchrun", "compile"}
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

    targets = report["targets"]
    assert len(targets) == 11
    for target in targets:
        assert isinstance(target["met"], bool) and _number(target["value"]), target
        assert summary["targets"][target["target"]] == {"value": target["value"], "met": target["met"]}


NODE_SCRIPT = BENCH.parent / "gpu_node.sh"


@pytest.mark.parametrize("args, says", [
    (["out", "60", "bench", "warmup"], "unknown step 'warmup'"),
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
