"""bench/gpu.py's output: gpu.json and gpu.log, and each section run under a guard."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from gpu_targets import section_errors, targets


class Report:
    """gpu.json and gpu.log: every line printed is also logged, and the json is rewritten after each section."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu.json", out / "gpu.log"
        self.log_file = open(self.log_path, "w", encoding="utf-8")
        self.data: dict = {"sections": {}, "targets": []}
        self.started = time.perf_counter()
        self.current: str | None = None  # the section running now
        self.lock = threading.Lock()  # the main thread and the time-limit watchdog both write
        # Library messages (build_cache's first line, warnings) go to the log as well.
        handler = logging.StreamHandler(self.log_file)
        handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
        logging.getLogger("prlmfuse").addHandler(handler)
        logging.getLogger("prlmfuse").setLevel(logging.INFO)

    def print(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        with self.lock:
            print(line, flush=True)
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            tmp = self.json_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable) + "\n", encoding="utf-8")
            tmp.replace(self.json_path)

    def finish(self, device: torch.device) -> int:
        """Targets, errors, the last save and the RESULT line; returns the exit status."""
        sections = self.data["sections"]
        self.data["targets"] = targets(sections, self.data.get("sizes", {}).get("step_configs", ()))
        self.print("== targets")
        for t in self.data["targets"]:
            value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
            verdict = "met    " if t["met"] else "NOT met"
            self.print(f"   {verdict}  {t['target']}: {value} (needs {t['op']} {t['threshold']})")
        self.data["errors"] = errors = section_errors(sections)
        self.save()
        missed = [t["target"] for t in self.data["targets"] if not t["met"]]
        summary = {"device": str(device), "gpu": sections.get("env", {}).get("gpu"), "tiny": self.data.get("tiny"),
                   "elapsed_s": round(self.elapsed(), 1),
                   "targets": {t["target"]: {"value": t["value"], "met": t["met"]} for t in self.data["targets"]},
                   "errors": errors, "gpu_json": str(self.json_path),
                   # aten ops dispatched by one step (torch.profiler): the CPU-side proxy for kernel launches
                   "ops_per_step": {config: {name: system.get("profiled", {}).get("aten_ops")
                                             for name, system in c.get("systems", {}).items()}
                                    for config, c in sections.get("step", {}).get("configs", {}).items()}}
        self.print("RESULT " + json.dumps(summary))
        return 1 if errors or (device.type == "cuda" and missed) else 0

    def stop_at(self, seconds: float, device: torch.device) -> None:
        """At `seconds`, record the section still running as stopped, finish, and end the process: a section
        that overruns (compiling, most likely) must not cost the figures and the RESULT line of the others."""
        def stop():
            name = self.current or "run"
            self.data["sections"][name] = {"error": f"stopped at the time limit ({seconds:.0f} s)"}
            self.print(f"   {name}: stopped at the time limit ({seconds:.0f} s)")
            status = self.finish(device)
            sys.stdout.flush()
            os._exit(status or 1)

        watchdog = threading.Timer(max(0.0, seconds - self.elapsed()), stop)
        watchdog.daemon = True
        watchdog.start()


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def run_section(report: Report, name: str, fn, *args, wanted: bool = True, skip: str | None = None):
    """Run one section; an exception is recorded as its error and the run goes on. Returns its result or None."""
    if not wanted:
        report.data["sections"][name] = {"skipped": "not in --only"}
        report.save()
        return None
    if skip is not None:
        report.print(f"== {name}: skipped ({skip})")
        report.data["sections"][name] = {"skipped": skip}
        report.save()
        return None
    report.print(f"== {name} (at {report.elapsed():.0f} s)")
    report.current = name
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        report.print(f"   {name} FAILED: {result['error']}")
        report.log_file.write(traceback.format_exc() + "\n")
    report.current = None
    result["seconds"] = round(time.perf_counter() - start, 1)
    report.data["sections"][name] = result
    report.save()
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rounded(x, digits: int = 4):
    return None if x is None else round(float(x), digits)
