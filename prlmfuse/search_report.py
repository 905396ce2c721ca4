"""What a search reports and what follows it: the plan (`--dry-run`: the space, each trial's state and
parameters, the most updates it can spend), the table of every trial (trials.md and trials.json in the search's
folder) with the best setting and the updates spent as a share of the full grid's, the pruned trials that
`--check-pruned` trained on to the full budget beside the best, and `--confirm`, which trains the best setting and
its two baselines to the full budget and evaluates them on test once.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import math
import os
from pathlib import Path

from prlmfuse.config import PipelineConfig
from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_json, atomic_write_text
from prlmfuse.launch import say
from prlmfuse.pipeline import evaluate_pipeline, train_runs
from prlmfuse.pipeline_inputs import SPLITS, build_caches, ensure_data, planned_parameters, run_path
from prlmfuse.search_space import SearchConfig
from prlmfuse.search_study import (amount, lease_path, lease_state, read_lease, search_dir, the_search,
                                   trials_pipeline, with_runs, worker_identity)
from prlmfuse.train_fused import run_dir as rundir
from prlmfuse.train_fused.config import RunConfig

TABLE_MD = "trials.md"
TABLE_JSON = "trials.json"
CONFIRM = "confirm"
CHECK = "check"  # the search folder's copies of pruned trials that --check-pruned trains on


# ---------------------------------------------------------------------------- the table


def _trial_rows(cfg: PipelineConfig, study) -> list[dict]:
    from optuna.trial import TrialState

    search = the_search(cfg)
    tcfg = trials_pipeline(cfg)
    by_setting = {t.user_attrs.get("setting"): t for t in study.get_trials(deepcopy=False)}
    rows = []
    me = worker_identity()
    for i, setting in enumerate(search.settings):
        run = search.trials[i]
        out = run_path(tcfg, run.name)
        trial = by_setting.get(i)
        try:
            state = rundir.state_to_resume(out)
        except UserError:
            state = None
        try:
            params = int(rundir.read_run_info(out)["trainable_parameters"])
        except (UserError, KeyError, TypeError, ValueError):
            params = planned_parameters(tcfg, run)
        updates = state.update if state is not None else 0
        rungs = {}
        if trial is not None:
            values = trial.intermediate_values
            rungs = {str(step): values[step] for step in search.rungs if step in values}
        status, dev_loss = "waiting", None
        if trial is not None and trial.state == TrialState.COMPLETE:
            status, dev_loss = "finished", trial.value
        elif trial is not None and trial.state == TrialState.PRUNED:
            status = f"pruned at {amount(max(int(s) for s in rungs) if rungs else updates, search.unit)}"
        elif trial is not None and trial.state == TrialState.RUNNING:
            lease = read_lease(lease_path(cfg, run.name))
            if lease is not None and lease.get("failed"):
                status = f"failed: {lease['failed']}"
            else:
                held = lease_state(lease_path(cfg, run.name), me) == "held"
                status = "running" if held else f"stopped at update {updates}, resumes"
        elif trial is not None and trial.state == TrialState.FAIL:
            status = "failed"
        rows.append({"run": run.name, "setting": setting, "trainable_parameters": params, "updates": updates,
                     "epochs": state.epoch if state is not None else 0, "dev_loss_at_rungs": rungs,
                     "dev_loss": dev_loss, "status": status, "log": str(out / rundir.TRAIN_LOG),
                     "updates_per_epoch": _updates_per_epoch(state, run)})
    return rows


def _updates_per_epoch(state, run: RunConfig) -> int | None:
    if state is None or not state.batches_per_epoch:
        return None
    return -(-state.batches_per_epoch // run.update_freq)


def check_dir(cfg: PipelineConfig, run: str) -> Path:
    """Where --check-pruned trains pruned trial `run` on: a copy of its run directory in the search's folder."""
    return search_dir(cfg) / CHECK / run


def pruned_to_check(table: dict, count: int) -> list[dict]:
    """The `count` pruned trials that came nearest to going on: those that reached the highest rung first, and among
    them the lowest dev loss at it."""
    pruned = [r for r in table["trials"] if r["status"].startswith("pruned") and r["dev_loss_at_rungs"]]

    def nearest(row: dict) -> tuple[int, float]:
        rung = max(row["dev_loss_at_rungs"], key=int)
        return -int(rung), row["dev_loss_at_rungs"][rung]

    return sorted(pruned, key=nearest)[:count]


def check_progress(cfg: PipelineConfig, run: str) -> tuple[rundir.TrainingState | None, bool]:
    """Pruned trial `run`'s check copy: its trainer state (None before it trained) and whether it reached the full
    budget."""
    trial = next(t for t in the_search(cfg).trials if t.name == run)
    state = rundir.state_to_resume(check_dir(cfg, run))
    return state, state is not None and rundir.stop_reason(trial, state) is not None


def _checked_rows(cfg: PipelineConfig, rows: list[dict]) -> list[dict]:
    """The pruned trials --check-pruned trains on (their copies in the check folder): where each was pruned, how far
    it has trained since, and its dev loss once it reached the full budget."""
    out = []
    for row in rows:
        copy = check_dir(cfg, row["run"])
        if not copy.is_dir() or not row["dev_loss_at_rungs"]:
            continue
        try:
            state, done = check_progress(cfg, row["run"])
        except UserError as e:  # a damaged copy: the table says so rather than failing every search call
            out.append({"run": row["run"], "setting": row["setting"], "status": f"unreadable: {e}"})
            continue
        rung = max(row["dev_loss_at_rungs"], key=int)
        out.append({"run": row["run"], "setting": row["setting"], "pruned_at": int(rung),
                    "updates_when_pruned": row["updates"],
                    "dev_loss_when_pruned": row["dev_loss_at_rungs"][rung],
                    "updates": state.update if state is not None else 0,
                    "dev_loss": state.last_dev_loss if done else None,
                    "status": "trained to the full budget" if done else "training on", "log": str(copy / rundir.TRAIN_LOG)})
    return out


def write_table(cfg: PipelineConfig, study) -> dict:
    """trials.json and trials.md in the search's folder: every trial, the best setting, the updates spent."""
    search = the_search(cfg)
    rows = _trial_rows(cfg, study)
    finished = [r for r in rows if r["status"] == "finished"]
    best = min(finished, key=lambda r: r["dev_loss"]) if finished else None
    spent = sum(r["updates"] for r in rows)
    if search.unit == "updates":
        full_grid = len(rows) * search.full
    else:
        per_epoch = next((r["updates_per_epoch"] for r in rows if r["updates_per_epoch"]), None)
        full_grid = len(rows) * search.full * per_epoch if per_epoch else None
    table = {
        "search": search.name, "pipeline": str(cfg.path), "base": search.base or "train.defaults",
        "space": search.space, "unit": search.unit, "full_budget": search.full, "least_budget": search.least,
        "pruner": search.pruner, "reduction_factor": search.reduction_factor, "rungs": search.rungs,
        "trials": rows, "best": best, "updates_spent": spent, "full_grid_updates": full_grid,
        "share_of_full_grid": (spent / full_grid) if full_grid else None,
        "counts": {s: sum(r["status"].startswith(s) for r in rows)
                   for s in ("finished", "pruned", "running", "stopped", "waiting", "failed")},
        "test_read": False,
    }
    checked = _checked_rows(cfg, rows)
    if checked:
        table["checked"] = checked
        table["check_updates"] = sum(max(0, c["updates"] - c["updates_when_pruned"]) for c in checked
                                     if "updates" in c)
    directory = search_dir(cfg)
    atomic_write_json(directory / TABLE_JSON, table)
    atomic_write_text(directory / TABLE_MD, table_markdown(table))
    return table


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def table_markdown(table: dict) -> str:
    keys = list(table["space"])
    rungs = table["rungs"]
    unit = table["unit"]
    lines = [f"# Search {table['search']}", "",
             f"Base run `{table['base']}`, {len(table['trials'])} settings over {', '.join(keys)}; full budget "
             f"{table['full_budget']} {unit}, least {table['least_budget']}; {table['pruner'].replace('_', ' ')} "
             f"(reduction factor {table['reduction_factor']}), rungs at {', '.join(map(str, rungs)) or 'none'} {unit}. "
             "Dev loss: label-smoothed cross entropy per target token, lower is better. Test was not read.", "",
             "| trial | " + " | ".join(keys) + f" | trainable params | updates | "
             + " | ".join(f"dev loss @{r}" for r in rungs) + f" | dev loss @{table['full_budget']} | status |",
             "|" + "---|" * (len(keys) + len(rungs) + 5)]
    for r in table["trials"]:
        cells = [r["run"], *(str(r["setting"][k]) for k in keys), f"{r['trainable_parameters']:,}", str(r["updates"]),
                 *(_fmt(r["dev_loss_at_rungs"].get(str(s))) for s in rungs), _fmt(r["dev_loss"]), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    checked = table.get("checked") or []
    if checked:
        lines += ["", "Pruned trials trained on to the full budget from where they were pruned (`--check-pruned`), "
                  "to see whether the pruner stopped a setting better than the best:", "",
                  "| trial | " + " | ".join(keys) + f" | pruned at | dev loss then | updates | dev loss @{table['full_budget']} |",
                  "|" + "---|" * (len(keys) + 5)]
        for c in (c for c in checked if "updates" in c):  # an unreadable copy is named in the lines below
            lines.append("| " + " | ".join([c["run"], *(str(c["setting"][k]) for k in keys), str(c["pruned_at"]),
                                            _fmt(c["dev_loss_when_pruned"]), str(c["updates"]), _fmt(c["dev_loss"])])
                         + " |")
    lines.append("")
    lines += summary_lines(table)
    return "\n".join(lines) + "\n"


def summary_lines(table: dict) -> list[str]:
    counts = table["counts"]
    parts = [f"{counts[k]} {k}" for k in ("finished", "pruned", "running", "stopped", "waiting", "failed") if counts[k]]
    lines = [f"search {table['search']}: {len(table['trials'])} settings, {', '.join(parts)}"]
    best = table["best"]
    if best is not None:
        setting = ", ".join(f"{k} {v}" for k, v in best["setting"].items())
        lines.append(f"best: {best['run']} ({setting}): dev loss {best['dev_loss']:.4f} at "
                     f"{amount(table['full_budget'], table['unit'])}")
    if table["full_grid_updates"]:
        full = amount(table["full_budget"], table["unit"])
        lines.append(f"spent: {table['updates_spent']:,} of the {table['full_grid_updates']:,} updates that train "
                     f"every setting to {full} ({100 * table['share_of_full_grid']:.0f}%)")
    lines += _check_lines(table)
    return lines


def _check_lines(table: dict) -> list[str]:
    """One line per pruned trial trained on: its dev loss at the full budget against the best's."""
    best = table["best"]
    lines = []
    for c in table.get("checked") or []:
        if "updates" not in c:
            lines.append(f"check: {c['run']}'s copy is {c['status']}")
            continue
        pruned = f"{c['run']} (pruned at {amount(c['pruned_at'], table['unit'])})"
        if c["dev_loss"] is None:
            lines.append(f"check: {pruned} is training on, at update {c['updates']}; rerun the same command to finish it")
            continue
        line = f"check: {pruned} trained on to {amount(table['full_budget'], table['unit'])}: dev loss {c['dev_loss']:.4f}"
        if best is not None:
            ahead = c["dev_loss"] < best["dev_loss"]
            line += (f", {'below' if ahead else 'above'} the best's {best['dev_loss']:.4f}"
                     + (": the pruner stopped a setting better than the best" if ahead else ""))
        lines.append(line)
    if table.get("checked"):
        lines.append(f"check spent {table['check_updates']:,} updates more")
    return lines


# ---------------------------------------------------------------------------- --dry-run


def _bracket_of(search: SearchConfig, number: int) -> int:
    """The hyperband bracket of trial `number`, as optuna's HyperbandPruner assigns it (crc32 of the study's name
    and the trial's number); successive halving has one bracket, 0."""
    if search.pruner != "hyperband":
        return 0
    eta = search.reduction_factor
    n = math.floor(math.log(search.full / search.least, eta)) + 1
    budgets = [math.ceil(n * eta ** (n - 1 - s) / (n - s)) for s in range(n)]
    left = binascii.crc32(f"{search.name}_{number}".encode()) % sum(budgets)
    for s, b in enumerate(budgets):
        left -= b
        if left < 0:
            return s
    return len(budgets) - 1


def _bracket_counts(search: SearchConfig, numbers: list[int]) -> dict[int, int]:
    """Trials per hyperband bracket (successive halving: all in bracket 0)."""
    counts: dict[int, int] = {}
    for number in numbers:
        s = _bracket_of(search, number)
        counts[s] = counts.get(s, 0) + 1
    return counts


def _bracket_lines(search: SearchConfig) -> list[str]:
    """Hyperband's brackets: each one's trials and first rung, and a warning for a bracket of one trial (no other
    trial is compared with it, so it is never pruned)."""
    if search.pruner != "hyperband":
        return []
    members: dict[int, list[str]] = {}
    for i in range(len(search.settings)):
        members.setdefault(_bracket_of(search, i), []).append(search.trial_name(i))
    lines = ["hyperband brackets (each prunes among its own trials): " + "; ".join(
        f"{s}: {len(names)} trial{'s' if len(names) != 1 else ''}, first rung at "
        f"{amount(search.least * search.reduction_factor ** s, search.unit)}" for s, names in sorted(members.items()))]
    for s, names in sorted(members.items()):
        if len(names) == 1:
            lines.append(f"warning: hyperband bracket {s} holds a single trial ({names[0]}): nothing is compared with "
                         "it, so it is never pruned")
    return lines


def planned_updates(search: SearchConfig) -> tuple[int, int]:
    """(updates if each rung keeps 1/reduction_factor of the trials that reach it, as synchronous successive
    halving would; the full grid's). In epochs for an epoch budget."""
    eta = search.reduction_factor
    total = 0
    for bracket, n in _bracket_counts(search, list(range(len(search.settings)))).items():
        rungs = [r for r in search.rungs if r >= search.least * eta ** bracket]
        reached, spent_to = n, 0
        for r in rungs:
            total += reached * (r - spent_to)
            spent_to = r
            reached = max(1, reached // eta)
        total += reached * (search.full - spent_to)
    return total, len(search.settings) * search.full


def dry_run_lines(cfg: PipelineConfig) -> list[str]:
    """What `search --dry-run` prints: the space, its size, each trial's state and parameters, the budget."""
    search = the_search(cfg)
    tcfg = trials_pipeline(cfg)
    unit = search.unit
    lines = [f"search {search.name} (pipeline {cfg.path}, workdir {cfg.workdir}): base run "
             f"{search.base or 'train.defaults'}, {search.pruner.replace('_', ' ')} (reduction factor "
             f"{search.reduction_factor}), {cfg.launcher.kind} launcher",
             "space: " + "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in search.space.items())
             + f" -> {len(search.settings)} settings",
             f"budget: {search.full} {unit} each; rungs at {', '.join(map(str, search.rungs))} {unit} (a dev evaluation "
             "at each; the pruner stops a trial there that is not among the best 1/"
             f"{search.reduction_factor} of those that reached it)"]
    lines += _bracket_lines(search)
    lines += [f"warning: {w}" for w in search.warnings()]
    for i, setting in enumerate(search.settings):
        run = search.trials[i]
        try:
            state, _ = rundir.training_progress(run, rundir.state_to_resume(run_path(tcfg, run.name)))
        except UserError as e:
            state = f"unreadable: {e}"
        lines.append(f"  {run.name}  {search.describe(setting):<40} {planned_parameters(tcfg, run):>12,} trainable "
                     f"parameters  [{state}]")
    pruned, full = planned_updates(search)
    lines.append(f"budget: at most {full:,} {unit} if no trial is pruned (the full grid: {len(search.settings)} × "
                 f"{search.full}); {pruned:,} ({100 * pruned / full:.0f}%) if each rung keeps 1/{search.reduction_factor}"
                 " of the trials that reach it")
    return lines


# ---------------------------------------------------------------------------- --confirm


def confirm_pipeline(cfg: PipelineConfig, table: dict | None = None) -> PipelineConfig:
    """The pipeline whose runs are the winner, the plain baseline and the matched baseline (--confirm's), its
    evaluation compared with the plain baseline and written to the search's confirm/ folder."""
    search = the_search(cfg)
    if table is None:
        try:
            table = json.loads((search_dir(cfg) / TABLE_JSON).read_text())
        except (OSError, ValueError):
            raise UserError(f"search {search.name} has no table yet; run `prlmfuse search {cfg.path}` first") from None
    if not table.get("best"):
        raise UserError(f"search {search.name} has no finished trial to confirm")
    runs = search.confirm_runs(table["best"]["setting"])
    confirmed = with_runs(cfg, runs)
    out = str(Path("search") / search.name / CONFIRM)
    return dataclasses.replace(confirmed, evaluate=dataclasses.replace(cfg.evaluate, baseline=runs[1].name, out=out))


def confirm_search(cfg: PipelineConfig, table: dict, *, parallel: int, wait: bool, score: bool):
    """Train the winner and its two baselines to the full budget as plain runs, then evaluate them on test once."""
    ccfg = confirm_pipeline(cfg, table)
    names = [r.name for r in ccfg.train.runs]
    best = table["best"]
    say(f"search: confirming {best['run']}'s setting as {names[0]}, beside {names[1]} and {names[2]} "
        f"({table['full_budget']} {table['unit']} each), on test")
    corpus = ensure_data(ccfg, build=False)
    build_caches(ccfg, corpus, names, splits=SPLITS)  # the test cache, first needed now
    abspath = os.path.abspath(cfg.path)
    train_runs(ccfg, names, parallel=parallel, wait=wait,
               task_argv=lambda run: ["search", abspath, "--train-run", run.name])
    if not wait:
        return None
    return evaluate_pipeline(ccfg, names, score=score)


def train_confirm_run(cfg: PipelineConfig, name: str) -> None:
    """`search PIPELINE --train-run NAME`: a child of --confirm trains one of its runs here."""
    ccfg = confirm_pipeline(cfg)
    if name not in [r.name for r in ccfg.train.runs]:
        raise UserError(f"--train-run {name!r}: --confirm trains {', '.join(r.name for r in ccfg.train.runs)}")
    ccfg.launcher.kind = "local"
    train_runs(ccfg, [name])
