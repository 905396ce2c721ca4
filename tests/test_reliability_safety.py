"""Safe loading: nothing unpickles, weights are safetensors only, remote code stays off.

Fast: the source tree has no unpickling call, no allow_pickle, no trust_remote_code=True, no unsafe
YAML; a pickle planted where a checkpoint belongs is refused without running it; trust_remote_code
reaches the checkpoint loader only when pipeline.yaml (or --trust-remote-code) sets it.
Slow: cache build, training, evaluation and live translation in a fresh process where every
unpickling entry point raises, recording what each from_pretrained call received.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prlmfuse.errors import UserError

from helpers import small_runs

_here = Path(__file__).parent

REPO = _here.parent
SOURCE_DIRS = ("prlmfuse", "cache_features", "train_fused", "evaluate", "bench")

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------ the source tree


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<expr>"
    return "<absent>"


_PICKLE_MODULES = ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal")
# Imported by bare name, these loaders' calls would look like any `load(...)`: the import itself is flagged.
_LOADERS_BY_NAME = {"torch": {"load"}, "yaml": {"load", "unsafe_load", "full_load"}}


def unsafe_loads(source: str, where: str = "<src>") -> list[str]:
    """The places in Python `source` that could unpickle or run remote code, as "where:line: what"."""
    tree = ast.parse(source)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.split(".")[0] in _PICKLE_MODULES for n in names):
                problems.append(f"{where}:{node.lineno}: imports {names}")
            if isinstance(node, ast.ImportFrom) and _LOADERS_BY_NAME.get(node.module or "", set()) & {a.name for a in node.names}:
                problems.append(f"{where}:{node.lineno}: imports a loader by name from {node.module}")
    for call, func in _calls(tree):
        at = f"{where}:{call.lineno}"
        if func == "torch.load" and _keyword(call, "weights_only") is not True:
            problems.append(f"{at}: torch.load without weights_only=True")
        if func.endswith("jit.load") or func in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
            problems.append(f"{at}: {func}")
        if _keyword(call, "allow_pickle") not in ("<absent>", False):
            problems.append(f"{at}: allow_pickle={_keyword(call, 'allow_pickle')}")
        if _keyword(call, "trust_remote_code") is True:
            problems.append(f"{at}: trust_remote_code=True")
        if _keyword(call, "use_safetensors") is False:
            problems.append(f"{at}: use_safetensors=False")
        if func.endswith("from_pretrained") and _keyword(call, "trust_remote_code") == "<absent>":
            problems.append(f"{at}: {func} without an explicit trust_remote_code")
    return problems


def test_source_tree_never_unpickles_or_trusts_remote_code():
    files = sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py"))
    assert len(files) > 20
    problems = [q for path in files for q in unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert problems == []


def test_the_scan_would_catch_what_it_looks_for():
    """The scanner above is only worth something if it flags every forbidden form, line by line."""
    bad = textwrap.dedent("""\
        import pickle
        from torch import load
        import numpy as np, torch, yaml
        from transformers import AutoModel
        torch.load("w.pt")
        np.load("a.npy", allow_pickle=True)
        AutoModel.from_pretrained("x", trust_remote_code=True)
        AutoModel.from_pretrained("x", trust_remote_code=False, use_safetensors=False)
        AutoModel.from_pretrained("x")
        yaml.load("a: 1")
        torch.jit.load("m.pt")
    """)
    flagged_lines = sorted({int(q.split(":")[1]) for q in unsafe_loads(bad)})
    assert flagged_lines == [1, 2, 5, 6, 7, 8, 9, 10, 11]
    good = textwrap.dedent("""\
        import numpy as np, torch, yaml
        from transformers import AutoModel
        torch.load("w.pt", weights_only=True)
        np.load("a.npy")
        AutoModel.from_pretrained("x", trust_remote_code=False, use_safetensors=True)
        yaml.safe_load("a: 1")
    """)
    assert unsafe_loads(good) == []


# ------------------------------------------------------------------------------------------ planted pickles


class _Payload:
    """Unpickling this touches a marker file: proof that something ran code from a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-safety")
    corpus = small_runs.small_bible(root, train=80, dev=8, test=8)
    from prlmfuse.train_fused import train_run

    run_dir = train_run(small_runs.tiny_run("base", max_updates=4, save_every=2), corpus, [], root / "base",
                        progress=False)
    return {"root": root, "corpus": corpus, "run_dir": run_dir}


@pytest.mark.parametrize("weights", ["last", "best", "average"])
def test_a_pickle_where_a_checkpoint_belongs_is_refused_unrun(trained, tmp_path, weights):
    import shutil

    from prlmfuse.train_fused import load_run

    run_dir = tmp_path / "run"
    shutil.copytree(trained["run_dir"], run_dir)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"model": _Payload(marker)})
    target = run_dir / ("best.safetensors" if weights == "best" else "checkpoints/update-00000004.safetensors")
    target.write_bytes(payload)
    with pytest.raises(UserError, match=r"is corrupt") as refused:
        load_run(run_dir, weights, last=2)
    assert str(target) in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ trust_remote_code


def _pipeline(tmp_path: Path, ckpt: Path, trust: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(f"""\
        workdir: {tmp_path / "work"}
        cache:
          checkpoints:
            - name: {ckpt}
              layers: [-2]
              {trust}
        train:
          runs:
            base: {{max_updates: 2}}
        """))
    return path


@pytest.mark.parametrize("trust, expected", [("", False), ("trust_remote_code: false", False),
                                             ("trust_remote_code: true", True)])
def test_trust_remote_code_only_when_pipeline_yaml_sets_it(trained, tmp_path, monkeypatch, trust, expected):
    import prlmfuse.cache_features
    import prlmfuse.prlms
    from prlmfuse import pipeline_inputs
    from prlmfuse.config import load_pipeline

    ckpt = small_runs.tiny_prlm(tmp_path / "bert")
    cfg = load_pipeline(_pipeline(tmp_path, ckpt, trust))
    seen = []
    real_resolve = prlmfuse.prlms.resolve_checkpoint

    def resolve(name, *, trust_remote_code=False):
        seen.append(("resolve", trust_remote_code))
        return real_resolve(name, trust_remote_code=False)  # the test's model needs no remote code

    def build_cache(*args, **kwargs):
        seen.append(("build_cache", kwargs["trust_remote_code"]))

    # Patched where they live and in the module that builds the caches, which may import either name at module level.
    for module, name, fake in ((prlmfuse.prlms, "resolve_checkpoint", resolve),
                               (prlmfuse.cache_features, "build_cache", build_cache)):
        monkeypatch.setattr(module, name, fake)
        monkeypatch.setattr(pipeline_inputs, name, fake, raising=False)
    pipeline_inputs.build_caches(cfg, trained["corpus"])
    assert seen and all(value is expected for _, value in seen), seen


def test_cli_cache_build_passes_trust_remote_code_only_with_the_flag(tmp_path, monkeypatch, capsys):
    import prlmfuse.cache_features
    from prlmfuse import cli

    seen = []

    class Result:
        reused, path, key = True, "x", "0" * 64

    def build_cache(*args, **kwargs):
        seen.append(kwargs["trust_remote_code"])
        return Result()

    monkeypatch.setattr(prlmfuse.cache_features, "build_cache", build_cache)
    for extra in ([], ["--trust-remote-code"]):
        monkeypatch.setattr(sys, "argv", ["prlmfuse", "cache", "build", "--checkpoint", "c", "--corpus", "f",
                                          "--out", str(tmp_path), *extra])
        cli.main()
    assert seen == [False, True]


def test_cli_translate_passes_trust_remote_code_only_with_the_flag(tmp_path, monkeypatch):
    import prlmfuse.evaluate
    from prlmfuse import cli

    seen = []

    def translate(run_dir, lines, **kwargs):
        seen.append(kwargs["trust_remote_code"])
        return []

    monkeypatch.setattr(prlmfuse.evaluate, "translate", translate)
    text = tmp_path / "in.txt"
    text.write_text("hello\n")
    for extra in ([], ["--trust-remote-code"]):
        monkeypatch.setattr(sys, "argv", ["prlmfuse", "translate", "--run", str(tmp_path), "--input", str(text), *extra])
        cli.main()
    assert seen == [False, True]


# ------------------------------------------------------------------------------------------ slow: end to end


_GUARDED = r"""
import json, pickle, sys
from pathlib import Path

def refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} was called: nothing in prlmfuse may unpickle")
    return refused

# Every file-loading way to unpickle. (pickle.loads is left alone only because nothing here uses
# multiprocessing: num_workers=0.)
pickle.load = refuse("pickle.load")
pickle.loads = refuse("pickle.loads")
class NoUnpickler(pickle.Unpickler):
    def load(self):
        raise AssertionError("pickle.Unpickler.load was called")
pickle.Unpickler = NoUnpickler
import numpy as np
_np_load = np.load
def np_load(*args, allow_pickle=False, **kwargs):
    if allow_pickle:
        raise AssertionError("numpy.load(allow_pickle=True) was called")
    return _np_load(*args, allow_pickle=False, **kwargs)
np.load = np_load
import torch
torch.set_num_threads(1)
torch.load = refuse("torch.load")
import transformers
CALLS = []
for cls in (transformers.AutoConfig, transformers.AutoModel, transformers.AutoTokenizer):
    def wrap(original, owner=cls.__name__):
        def from_pretrained(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            CALLS.append({"what": owner, "caller": caller,
                          "trust_remote_code": kwargs.get("trust_remote_code", "<absent>"),
                          "use_safetensors": kwargs.get("use_safetensors", "<absent>")})
            return original(*args, **kwargs)
        return from_pretrained
    cls.from_pretrained = wrap(cls.from_pretrained)

args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests"])
from helpers import small_runs as s
from prlmfuse.cache_features import CacheReader
from prlmfuse.evaluate import evaluate_runs, translate
from prlmfuse.train_fused import PrLMUse, average_checkpoints, load_run, train_run

root = Path(args["root"])
corpus = s.small_bible(root, train=80, dev=8, test=8)
ckpt = s.tiny_prlm(root / "bert")
paths = s.build_caches(ckpt, corpus, root / "cache", layers="-2")
reader = CacheReader(paths["test"], in_memory=True)
reader.features(0), reader.pooled(0)
use = PrLMUse(checkpoint=str(ckpt), layer=-2)
run_dir = train_run(s.tiny_run("fused", prlms=[use], max_updates=4, save_every=2), corpus,
                    [s.caches_for(use, paths)], root / "run", progress=False)
train_run(s.tiny_run("fused", prlms=[use], max_updates=6, save_every=2), corpus,
          [s.caches_for(use, paths)], root / "run", progress=False)  # a resume loads every checkpoint file
average_checkpoints(run_dir, last=2)
for weights in ("best", "last", "average"):
    load_run(run_dir, weights, last=2)
evaluate_runs([run_dir], out=root / "results", beam=1, average_last=2, progress=False)
hyps = translate(run_dir, ["In the beginning God created the heavens and the earth."], beam=1, average_last=2)
print(json.dumps({"calls": CALLS, "hyps": hyps}))
"""


@pytest.mark.slow
def test_cache_train_evaluate_translate_with_every_unpickler_booby_trapped(tmp_path):
    args = {"root": str(tmp_path), "tests": str(_here)}
    done = subprocess.run([sys.executable, "-c", _GUARDED, json.dumps(args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "PRLMFUSE_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["hyps"]) == 1
    ours = [c for c in report["calls"] if c["caller"].startswith("prlmfuse")]
    # Stage one resolves and loads the PrLM (config, model, tokenizer) for 3 caches and for translate.
    assert {c["what"] for c in ours} == {"AutoConfig", "AutoModel", "AutoTokenizer"}
    assert all(c["trust_remote_code"] is False for c in ours), ours
    assert all(c["use_safetensors"] is True for c in ours if c["what"] == "AutoModel"), ours
    assert not any(c["trust_remote_code"] is True for c in report["calls"]), report["calls"]
    assert (tmp_path / "results" / "results.md").is_file()
