"""One home for launching (prlmfuse.launch): no import circle through the pipeline; the local launcher's children
(a stop passed on, exit 75, the same command resumes); `--launcher slurm` through submitit's local executor (its
preemption signal reaches the trainer, the task is requeued and resumes from the resume point) and through a
fake sbatch (the array script and the commands it runs); the launcher section's refusals; the missing extra."""

from __future__ import annotations

import ast
import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import search_world as sw
from prlmfuse.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
# Where each package of the installed `prlmfuse` namespace lives in the checkout (pyproject's package-dir).
PACKAGES = {"prlmfuse": ROOT / "prlmfuse", "prlmfuse.cache_features": ROOT / "cache_features",
            "prlmfuse.train_fused": ROOT / "train_fused", "prlmfuse.evaluate": ROOT / "evaluate"}


# ---------------------------------------------------------------------------- the import circle


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    found = {}
    for package, folder in packages.items():
        for file in sorted(folder.rglob("*.py")):
            parts = list(file.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.setdefault(".".join([package, *parts]), file)
    return found


def _imports(name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (inside functions too): import statements,
    relative ones, importlib.import_module("...") and lazy-import tables ({"attr": "prlmfuse.x"})."""
    file = modules[name]
    package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
    named: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            named.add(base)
            named.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            named.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
        elif isinstance(node, ast.Dict):
            named.update(v.value for v in node.values if isinstance(v, ast.Constant) and v.value in modules)
    resolved = set()
    for module in named:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module:
            resolved.add(module)
    return resolved - {name}


def _reachable(start: str, modules: dict[str, Path], graph: dict[str, set[str]] | None = None) -> set[str]:
    graph = graph if graph is not None else {}
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in graph:
            graph[module] = _imports(module, modules)
        for imported in graph[module]:
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def _circles_through(target: str, modules: dict[str, Path]) -> list[str]:
    """The modules `target` imports (directly or not) that import `target` back (directly or not)."""
    graph: dict[str, set[str]] = {}
    return sorted(m for m in _reachable(target, modules, graph) - {target} if target in _reachable(m, modules, graph))


def test_no_module_the_pipeline_imports_imports_the_pipeline_back():
    modules = _modules(PACKAGES)
    reached = _reachable("prlmfuse.pipeline", modules)
    assert {"prlmfuse.launch", "prlmfuse.config", "prlmfuse.train_fused.run_setup"} <= reached  # the walk sees lazy imports
    assert _circles_through("prlmfuse.pipeline", modules) == []
    # The launcher is the one home of launching: `run`, `train` and `search` reach it, and it reaches no pipeline.
    for command in ("prlmfuse.commands.run", "prlmfuse.commands.train", "prlmfuse.search"):
        assert "prlmfuse.launch" in _reachable(command, modules), command
    assert not (ROOT / "prlmfuse" / "train_children.py").exists()


def test_the_walk_finds_a_circle_made_by_a_lazy_import(tmp_path):
    # The shape the old `train --jobs` children had: pipeline imports them inside a function, they import it back.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text("def train():\n    from pkg.children import run_children\n")
    (package / "children.py").write_text("from pkg.pipeline import run_path\n")
    (package / "launch.py").write_text("import os\n")
    modules = _modules({"pkg": package})
    assert _circles_through("pkg.pipeline", modules) == ["pkg.children"]
    (package / "children.py").write_text("from . import launch\n")
    assert _circles_through("pkg.pipeline", _modules({"pkg": package})) == []


# ---------------------------------------------------------------------------- the launcher section


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return sw.build_world(tmp_path_factory.mktemp("launch-world"))


@pytest.mark.parametrize("section, where, message", [
    ("{kind: slurn}", "launcher.kind", "'slurn' is not one of local, slurm"),
    ("{partiton: gpu}", "launcher.partiton", "unknown key; did you mean 'partition'?"),
    ("{time: soon}", "launcher.time", "expected minutes or HH:MM:SS / D-HH:MM:SS, got 'soon'"),
    ("{time: 2, signal_delay_s: 120}", "launcher.signal_delay_s", "120 s is not shorter than the time limit (2 min)"),
    ("{mem: lots}", "launcher.mem", "expected a number of GB or a size such as 32G or 500M"),
    ("{sbatch: ['--signal=B:USR1@60']}", "launcher.sbatch.0", "--signal is not set here: submitit asks for "
     "--signal=USR2@signal_delay_s itself"),
    ("{sbatch: ['--partition=gpu']}", "launcher.sbatch.0", "--partition is not set here: set launcher.partition"),
    ("{sbatch: ['account nlp']}", "launcher.sbatch.0", "expected an sbatch option such as --account=NAME"),
    ("{array_parallelism: 0}", "launcher.array_parallelism", "expected an integer >= 1"),
    ("{sbatch: ['--no-requeue']}", "launcher.sbatch.0", "--no-requeue is not set here: prlmfuse asks for --requeue"),
    ("{sbatch: ['-J mine']}", "launcher.sbatch.0", "-J is not set here: prlmfuse names the array"),
    ("{sbatch: ['--gpus=2']}", "launcher.sbatch.0", "--gpus is not set here: set launcher.gpus"),
    ("{sbatch: ['--mem-per-cpu=4G']}", "launcher.sbatch.0", "--mem-per-cpu is not set here: set launcher.mem"),
])
def test_the_launcher_section_is_refused_where_it_is_wrong(world, tmp_path, section, where, message):
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world, launcher=f"launcher: {section}\n")
    with pytest.raises(UserError) as refused:
        load_pipeline(path)
    line = str(refused.value)
    row = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("launcher:"))
    assert line.startswith(f"{path}:{row}:") and f": {where}: {message}" in line, line


def test_the_launcher_section_reads_times_and_sizes(world, tmp_path):
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world, launcher="launcher: {kind: slurm, time: '1-02:00:30', mem: 500M, "
                                                        "sbatch: ['#SBATCH --account=nlp', '--exclusive']}\n")
    launcher = load_pipeline(path).launcher
    assert (launcher.kind, launcher.time_minutes, launcher.mem_gb) == ("slurm", 26 * 60 + 1, 500 / 1024)
    assert launcher.extra_parameters == {"account": "nlp", "exclusive": True}


@pytest.mark.parametrize("written, minutes", [("1:00:00", 60), ("30:00", 30), ("90", 90), ("'1:00:00'", 60),
                                              ("1-00:00:00", 24 * 60), ("2:00", 2)])
def test_an_unquoted_time_is_read_as_slurm_reads_it(world, tmp_path, written, minutes):
    # YAML 1.1 reads an unquoted 1:00:00 as the base-60 integer 3600 (its seconds), not 3600 minutes.
    from prlmfuse.config import load_pipeline

    path = sw.write_pipeline(tmp_path, world, launcher=f"launcher:\n  kind: slurm\n  time: {written}\n  "
                                                       "signal_delay_s: 60\n")
    assert load_pipeline(path).launcher.time_minutes == minutes


# ---------------------------------------------------------------------------- local children


def test_local_children_pass_a_stop_on_and_the_same_command_resumes_them(world, tmp_path):
    path = sw.with_data(sw.write_pipeline(tmp_path, world, full=400))
    runs = tmp_path / "work" / "runs"
    proc = sw.start("train", "-p", path, "--runs", "fused,base", "--jobs", "2")
    sw.wait_for(lambda: sw.updates_logged(runs / "fused") >= 2 and sw.updates_logged(runs / "base") >= 2, proc,
                what="both runs to train")
    proc.send_signal(signal.SIGTERM)  # to the parent alone: it passes the signal on to each child
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out
    for name in ("fused", "base"):
        assert f"train: {name} -> {runs / name} (own process, 1 thread(s); log {runs / name / 'train.log'})" in out
        assert f"train: {name} stopped after" in out and "(stopped by a signal, saved at update" in out
        assert "stopped by SIGTERM" in (runs / name / "train.log").read_text()
    assert "rerun the same command to resume" in out.strip().splitlines()[-1]
    from prlmfuse.train_fused import run_dir as rundir

    saved = {name: rundir.state_to_resume(runs / name).update for name in ("fused", "base")}
    # A stop that lands on a save (every 100 updates, each epoch's end) needs no resume point: it resumes from that.
    source = {name: "its last checkpoint" if update in rundir.complete_checkpoints(runs / name)
              else "a stop signal's resume point" for name, update in saved.items()}
    path.write_text(path.read_text().replace("max_updates: 400", f"max_updates: {max(saved.values()) + 4}"))
    again = sw.cli("train", "-p", path, "--runs", "fused,base", "--jobs", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("finished in") == 2
    for name, update in saved.items():
        assert f"train: {name} resumes at update {update} from {source[name]}" in (runs / name / "train.log").read_text()


# ---------------------------------------------------------------------------- submitit: its local executor


def _process(pid: int) -> tuple[bytes, int]:
    """(cmdline, parent pid) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return Path(f"/proc/{pid}/cmdline").read_bytes(), int(stat[stat.rindex(")") + 2:].split()[1])


def _submitit_task_running(run: str) -> int | None:
    """The submitit task process whose child trains `run` (`prlmfuse train ... --runs RUN --launcher local`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline, parent = _process(int(entry.name))
            if (b"prlmfuse.cli\0train\0" in cmdline and f"--runs\0{run}\0".encode() in cmdline
                    and b"submitit.core._submit" in _process(parent)[0]):
                return parent
        except (OSError, ValueError, IndexError):
            continue
    return None


def test_submitit_preemption_reaches_the_trainer_and_the_requeued_task_resumes(world, tmp_path):
    from prlmfuse.train_fused import run_dir as rundir

    # A budget no loaded machine trains before USR2 lands; the requeued task reads the pipeline file again, with
    # the budget it then trains to (a resumed run may change max_updates).
    path = sw.with_data(sw.write_pipeline(tmp_path, world, full=5000, launcher="launcher: {time: 60}\n"))
    run = tmp_path / "work" / "runs" / "fused"
    proc = sw.start("train", "-p", path, "--runs", "fused", "--launcher", "slurm", PRLMFUSE_SUBMITIT_CLUSTER="local",
                    PRLMFUSE_SUBMITIT_POLL_S="0.5")
    sw.wait_for(lambda: sw.updates_logged(run) >= 2, proc, what="the array task to train")
    task = _submitit_task_running("fused")
    assert task is not None
    resumed_budget = sw.updates_logged(run) + 150
    path.write_text(path.read_text().replace("max_updates: 5000", f"max_updates: {resumed_budget}"))
    # What SLURM sends signal_delay_s before the time limit, to the submitit task: USR2. submitit's handler calls
    # the task's checkpoint(), which passes it on to prlmfuse, waits for it to save, and requeues the command.
    os.kill(task, signal.SIGUSR2)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    assert "train: 1 task(s) submitted as submitit local jobs" in out and "train: fused finished in" in out
    log = (run / "train.log").read_text()
    stopped = int(log.split("train: fused stopped by SIGUSR2 at update ")[1].split(";")[0])
    assert f"train: fused resumes at update {stopped} from a stop signal's resume point" in log
    assert rundir.state_to_resume(run).update == resumed_budget and 2 <= stopped < resumed_budget
    submitit_log = "".join(p.read_text() for p in (tmp_path / "work" / "slurm").glob("*_log.*"))
    assert "prlmfuse task: SIGUSR2 passed on; prlmfuse exited 75; requeued" in submitit_log
    assert "Requeued job" in submitit_log
    dev = [r["update"] for r in rundir.read_metrics(run) if "dev_loss" in r]
    assert dev == sorted(set(dev))


FAKE_SCONTROL = """\
#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM/calls"
"""


def test_a_task_stopped_by_sigterm_is_requeued_to_resume_not_to_start_over(tmp_path, monkeypatch):
    # SLURM's SIGTERM at a preemption reaches prlmfuse without passing through submitit, which rewrites the
    # submitted pickle only on its own USR2 path: the task writes the resumed command there itself before it asks
    # SLURM to requeue it, or every requeue of a `--fresh` task would start it over.
    from submitit.core.utils import DelayedSubmission

    from prlmfuse.launch import ChildCommand

    fake = tmp_path / "fake-slurm"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "bin" / "scontrol").chmod(0o755)
    folder = tmp_path / "slurm"
    folder.mkdir()
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": str(folder), "SLURM_JOB_ID": "4250",
                        "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "0",
                        "FAKE_SLURM": str(fake), "PATH": f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}"}.items():
        monkeypatch.setenv(name, value)
    # A task whose prlmfuse command was stopped by a signal: it exits 75.
    command = [sys.executable, "-c", "import sys; sys.exit(75)", "train", "--runs", "fused", "--fresh"]
    submitted = DelayedSubmission(ChildCommand(command, str(tmp_path / "train.log"), {}, stop_wait=5))
    submitted.set_timeout(60, 7)
    submitted.dump(folder / "4242_3_submitted.pkl")
    with pytest.raises(SystemExit) as ended:
        DelayedSubmission.load(folder / "4242_3_submitted.pkl").function()
    assert ended.value.code == 75
    assert (fake / "calls").read_text().splitlines() == ["scontrol requeue 4242_3"]
    rerun = DelayedSubmission.load(folder / "4242_3_submitted.pkl")
    assert rerun.function.command == command[:-1]  # what the requeued task runs: it resumes
    assert (rerun._timeout_min, rerun._timeout_countdown) == (60, 7)


def test_the_array_task_tells_its_own_command_who_it_is(tmp_path):
    # The command an array task runs sees the task's pid in ARRAY_TASK_ENV, as its parent's: a search worker there
    # keeps the array task's identity (prlmfuse.search_study.worker_identity); what that command starts does not.
    from prlmfuse.launch import ARRAY_TASK_ENV, ChildCommand

    log = tmp_path / "task.log"
    show = f"import os; print(os.environ['{ARRAY_TASK_ENV}'], os.getppid())"
    assert ChildCommand([sys.executable, "-c", show], str(log), {})() == 0
    marker, parent = log.read_text().split()
    assert marker == parent == str(os.getpid())


# ---------------------------------------------------------------------------- submitit: a fake SLURM


FAKE_SBATCH = """\
#!/bin/bash
# What sbatch was given, and a copy of the script; the answer SLURM gives.
echo "sbatch $*" >> "$FAKE_SLURM/calls"
n=$(ls "$FAKE_SLURM"/script-*.sh 2>/dev/null | wc -l)
cp "${@: -1}" "$FAKE_SLURM/script-$n.sh"
echo "Submitted batch job $((4242 + n))"
"""


FAKE_SACCT = """\
#!/bin/bash
# The state of array 4242's first task, where the test sets one.
echo "sacct $*" >> "$FAKE_SLURM/calls"
if [ -n "$FAKE_SACCT_STATE" ]; then echo "JobID|State|NodeList"; echo "4242_0|$FAKE_SACCT_STATE|node1"; fi
"""


@pytest.fixture
def fake_slurm(tmp_path):
    folder = tmp_path / "fake-slurm"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "sbatch").write_text(FAKE_SBATCH)
    for command in ("srun", "squeue", "scancel", "scontrol"):
        (folder / "bin" / command).write_text(f'#!/bin/bash\necho "{command} $*" >> "$FAKE_SLURM/calls"\n')
    (folder / "bin" / "sacct").write_text(FAKE_SACCT)
    for script in (folder / "bin").iterdir():
        script.chmod(0o755)
    return {"FAKE_SLURM": str(folder), "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def _commands(slurm_folder: Path, array: int) -> list[list[str]]:
    """The command of each task of an array, from the pickles submitit submitted (task order)."""
    from submitit.core.utils import DelayedSubmission

    pickles = sorted(slurm_folder.glob(f"{array}_*_submitted.pkl"), key=lambda p: int(p.name.split("_")[1]))
    return [DelayedSubmission.load(p).function.command for p in pickles]


def test_the_array_submitted_to_slurm_runs_each_runs_command_and_requeues(world, tmp_path, fake_slurm):
    launcher = ("launcher: {partition: gpu, gpus: 1, cpus: 4, mem: 16G, time: '02:00:00', array_parallelism: 2, "
                "signal_delay_s: 180, sbatch: ['--account=nlp'], setup: ['module load cuda']}\n")
    runs = "    base2: {seed: 2}\n"
    path = sw.with_data(sw.write_pipeline(tmp_path, world, launcher=launcher, runs=runs))
    done = sw.cli("train", "-p", path, "--launcher", "slurm", "--no-wait", "--fresh", **fake_slurm)
    assert done.returncode == 0, done.stderr
    calls = Path(fake_slurm["FAKE_SLURM"], "calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("sbatch ")  # ONE submission: the whole array
    script = Path(fake_slurm["FAKE_SLURM"], "script-0.sh").read_text()
    for line in ("#SBATCH --array=0-2%2", "#SBATCH --partition=gpu", "#SBATCH --requeue", "#SBATCH --signal=USR2@180",
                 "#SBATCH --time=120", "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=16GB",
                 "#SBATCH --account=nlp", "module load cuda", "#SBATCH --job-name=prlmfuse-train"):
        assert line in script.splitlines(), (line, script)
    assert "-m submitit.core._submit" in script and "srun " in script
    pipeline = os.path.abspath(path)
    for i, name in enumerate(("fused", "base", "base2")):
        assert f"# task {i} ({name}): prlmfuse train --pipeline {pipeline} --runs {name} " in script
    commands = _commands(tmp_path / "work" / "slurm", 4242)
    assert [c[3:] for c in commands] == [
        ["train", "--pipeline", pipeline, "--runs", name, "--device", "auto", "--precision", "fp32", "--launcher",
         "local", "--fresh"] for name in ("fused", "base", "base2")]
    assert all(c[:3] == [sys.executable, "-m", "prlmfuse.cli"] for c in commands)
    assert "train: 3 task(s) submitted as SLURM array 4242, 2 at once" in done.stderr
    assert "train: base2 -> " in done.stderr and "(array task 4242_2; log " in done.stderr and "--no-wait" in done.stderr
    # A requeued task resumes: checkpoint() hands submitit the same command without --fresh.
    from submitit.core.utils import DelayedSubmission

    task = DelayedSubmission.load(next((tmp_path / "work" / "slurm").glob("4242_0_submitted.pkl"))).function
    assert task.checkpoint().function.command == commands[0][:-1]

    # Submitted again while the first array's task still runs: refused, before anything is submitted.
    twice = sw.cli("train", "-p", path, "--launcher", "slurm", "--no-wait", FAKE_SACCT_STATE="RUNNING", **fake_slurm)
    assert twice.returncode == 2 and twice.stderr.strip().splitlines()[-1].startswith(
        "error: fused is still RUNNING in SLURM array 4242 (task 0), submitted earlier; wait for it"), twice.stderr
    assert not Path(fake_slurm["FAKE_SLURM"], "script-1.sh").exists()

    # A search's workers: one array of --jobs tasks, each `prlmfuse search PIPELINE --worker`.
    searched = sw.cli("search", path, "--launcher", "slurm", "--no-wait", "--jobs", "2", **fake_slurm)
    assert searched.returncode == 0, searched.stderr
    script = Path(fake_slurm["FAKE_SLURM"], "script-1.sh").read_text()
    assert "#SBATCH --array=0-1%2" in script.splitlines() and "#SBATCH --job-name=prlmfuse-search" in script
    assert "search: 2 task(s) submitted as SLURM array 4243, 2 at once" in searched.stderr
    workers = _commands(tmp_path / "work" / "slurm", 4243)
    assert [c[3:] for c in workers] == [["search", pipeline, "--worker", "--device", "auto", "--precision", "fp32",
                                         "--launcher", "local"]] * 2


def test_slurm_and_no_wait_refuse_in_one_line(world, tmp_path):
    path = sw.with_data(sw.write_pipeline(tmp_path, world))
    no_wait = sw.cli("train", "-p", path, "--no-wait")
    assert no_wait.returncode == 2 and no_wait.stderr.strip().splitlines() == [
        "error: --no-wait needs --launcher slurm (or launcher.kind: slurm): local children end with the command that "
        "starts them"]
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "submitit").mkdir()
    (blocked / "submitit" / "__init__.py").write_text("raise ImportError('submitit is not installed here')\n")
    missing = sw.cli("train", "-p", path, "--launcher", "slurm", PYTHONPATH=str(blocked))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.strip().splitlines()[-1] == ("error: --launcher slurm needs submitit, which is not installed: "
                                                       "pip install 'prlmfuse[search]' (optuna and submitit)")
    no_srun = sw.cli("train", "-p", path, "--launcher", "slurm", PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin")
    assert no_srun.returncode == 2 and "Traceback" not in no_srun.stderr, no_srun.stderr
    assert "srun" in no_srun.stderr.strip().splitlines()[-1]
