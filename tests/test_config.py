"""pipeline.yaml: parsed once into typed config; every mistake is one line naming where it is."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prlmfuse.config import load_pipeline
from prlmfuse.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def error_of(path) -> str:
    with pytest.raises(UserError) as e:
        load_pipeline(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_repo_pipeline_and_examples_parse():
    cfg = load_pipeline(REPO / "pipeline.yaml")
    names = [r.name for r in cfg.train.runs]
    assert "baseline" in names and any(r.prlms for r in cfg.train.runs)
    assert cfg.evaluate.baseline in names
    for example in sorted((REPO / "examples").glob("*.yaml")):
        load_pipeline(example)


def test_defaults_apply_and_runs_override(tmp_path):
    p = write(tmp_path, """
        cache: {checkpoints: [{name: minilm-l6, layers: all}]}
        train:
          defaults: {preset: tiny, max_updates: 10, lr: 5e-4}
          runs:
            base: {}
            fused: {prlms: [{checkpoint: minilm-l6, layer: dwatt}], merge: gate, lr: 1e-3}
    """)
    cfg = load_pipeline(p)
    base, fused = cfg.train.runs
    assert base.lr == 5e-4 and base.prlms == [] and base.preset == "tiny"
    assert fused.lr == 1e-3 and fused.merge == "gate" and fused.prlms[0].layer == "dwatt"
    assert cfg.cache.checkpoints[0].layers == "all"
    assert cfg.workdir == (tmp_path / "work")


def test_grid_expands_to_one_run_per_combination(tmp_path):
    p = write(tmp_path, """
        cache: {checkpoints: [{name: minilm-l6}]}
        train:
          defaults: {max_updates: 5}
          runs:
            fused:
              prlms: [{checkpoint: minilm-l6}]
              grid: {merge: [sum, gate], side: [source, both]}
    """)
    runs = load_pipeline(p).train.runs
    assert [r.name for r in runs] == [
        "fused.merge-sum.side-source", "fused.merge-sum.side-both",
        "fused.merge-gate.side-source", "fused.merge-gate.side-both",
    ]
    assert runs[3].merge == "gate" and runs[3].side == "both"


def test_runs_named_with_a_seed_are_selected_and_located_by_their_own_name(tmp_path):
    """`fused.seed-2` written as a run of its own: `--runs fused` means the run named fused, not its seeds,
    and a mistake in it is located at its own key, not at fused's."""
    from prlmfuse.pipeline_inputs import _selected_runs

    text = """
        cache: {checkpoints: [{name: minilm-l6}]}
        train:
          runs:
            fused: {prlms: [{checkpoint: minilm-l6}]}
            fused.seed-2: {prlms: [{checkpoint: minilm-l6}], seed: 2}
            wide:
              grid: {seed: [1, 2]}
    """
    cfg = load_pipeline(write(tmp_path, text))
    assert [r.name for r in _selected_runs(cfg, ["fused"])] == ["fused"]
    assert [r.name for r in _selected_runs(cfg, ["fused.seed-2"])] == ["fused.seed-2"]
    assert [r.name for r in _selected_runs(cfg, ["wide"])] == ["wide.seed-1", "wide.seed-2"]
    p = write(tmp_path, text.replace("minilm-l6}], seed: 2", "minilm-l7}], seed: 2"), "b.yaml")
    msg = error_of(p)
    assert "train.runs.fused.seed-2.prlms.0.checkpoint: 'minilm-l7' is not in cache.checkpoints" in msg
    assert msg.startswith(f"{p}:6:")


def test_yaml_syntax_error_reports_line_and_column(tmp_path):
    p = write(tmp_path, "data:\n  kind: bible\n  src: [en\n")
    msg = error_of(p)
    assert msg.startswith(f"{p}:4:1: YAML syntax error")


def test_unknown_key_names_path_and_closest_key(tmp_path):
    p = write(tmp_path, """
        train:
          runs:
            fused:
              merg: sum
              max_updates: 3
    """)
    msg = error_of(p)
    assert "train.runs.fused.merg: unknown key; did you mean 'merge'?" in msg
    assert msg.startswith(f"{p}:5:")


def test_unknown_top_level_and_default_keys(tmp_path):
    assert "did you mean 'cache'?" in error_of(write(tmp_path, "cahce: {}\n"))
    msg = error_of(write(tmp_path, "train:\n  defaults: {max_update: 3}\n", "b.yaml"))
    assert "train.defaults.max_update: unknown key; did you mean 'max_updates'?" in msg


def test_wrong_type_names_key_path(tmp_path):
    msg = error_of(write(tmp_path, "train:\n  defaults:\n    max_updates: many\n  runs: {x: {}}\n"))
    assert ":3:18: train.defaults.max_updates: expected an integer, got 'many'" in msg
    msg = error_of(write(tmp_path, "cache:\n  checkpoints:\n    - {name: m, layers: last}\n", "b.yaml"))
    assert "cache.checkpoints.0.layers" in msg


def test_bad_choice_and_unknown_checkpoint_reference(tmp_path):
    msg = error_of(write(tmp_path, "train:\n  runs:\n    g: {max_updates: 2, merge: summ}\n"))
    assert "train.runs.g.merge: 'summ' is not one of sum, average, gate, dropnet, direct" in msg
    msg = error_of(write(tmp_path, """
        cache: {checkpoints: [{name: minilm-l6}]}
        train: {runs: {f: {max_updates: 2, prlms: [{checkpoint: minilm-l7}]}}}
    """, "b.yaml"))
    assert "train.runs.f.prlms.0.checkpoint: 'minilm-l7' is not in cache.checkpoints; did you mean 'minilm-l6'?" in msg


def test_target_side_choices_name_both_decoders(tmp_path):
    cfg = load_pipeline(write(tmp_path, "train:\n  runs:\n    f: {max_updates: 2, side: target_flow}\n"))
    assert cfg.run("f").side == "target_flow"
    msg = error_of(write(tmp_path, "train:\n  runs:\n    g: {max_updates: 2, side: target-flow}\n", "b.yaml"))
    assert "b.yaml:3:31: train.runs.g.side: 'target-flow' is not one of source, target, both, target_flow, both_flow" in msg


def test_patience_and_epoch_settings_are_checked_where_they_stand(tmp_path):
    cfg = load_pipeline(write(tmp_path, "train:\n  runs:\n    f: {max_epochs: 30, patience: 3, min_epochs: 10}\n"))
    assert (cfg.run("f").patience, cfg.run("f").min_epochs, cfg.run("f").keep_last_epochs) == (3, 10, 5)
    msg = error_of(write(tmp_path, "train:\n  runs:\n    g: {max_epochs: 5, patience: 3, min_epochs: 10}\n", "b.yaml"))
    assert "b.yaml:3:49: train.runs.g.min_epochs: min_epochs 10 exceeds max_epochs 5" in msg
    cfg = load_pipeline(write(tmp_path, "train: {runs: {f: {max_epochs: 3}}}\nevaluate: {average: epochs}\n", "e.yaml"))
    assert cfg.evaluate.average == "epochs"
    msg = error_of(write(tmp_path, "train: {runs: {f: {max_epochs: 3}}}\nevaluate:\n  average: epoch\n", "d.yaml"))
    assert "d.yaml:3:12: evaluate.average: 'epoch' is not one of saves, epochs" in msg
    msg = error_of(write(tmp_path, "train: {runs: {f: {max_epochs: 3, keep_last_epochs: 2}}}\n"
                                   "evaluate: {average: epochs, average_last: 3}\n", "k.yaml"))
    assert "evaluate.average_last: averages 3 epoch-end checkpoints but run 'f' keeps only keep_last_epochs 2" in msg
    msg = error_of(write(tmp_path, "train:\n  runs:\n    g: {max_epochs: 5, patience: 0}\n", "c.yaml"))
    assert "c.yaml:3:34: train.runs.g.patience: expected a positive integer, got 0" in msg


def test_missing_file_names_key_path(tmp_path):
    msg = error_of(write(tmp_path, """
        data:
          kind: text
          files: {train_src: nope.txt, train_tgt: a, dev_src: a, dev_tgt: a, test_src: a, test_tgt: a}
    """))
    assert "data.files.train_src: file not found:" in msg and "nope.txt" in msg
    assert "pipeline file not found" in error_of(tmp_path / "absent.yaml")


@pytest.mark.parametrize("text,needle", [
    ("data:\n  kind: bible\n  src: [en\n", "YAML syntax error"),
    ("train:\n  runs:\n    f: {merg: sum, max_updates: 1}\n", "did you mean 'merge'"),
    ("train:\n  defaults: {max_updates: many}\n", "expected an integer"),
    ("data:\n  kind: text\n  files: {train_src: nope.txt, train_tgt: a, dev_src: a, dev_tgt: a,"
     " test_src: a, test_tgt: a}\n", "data.files.train_src: file not found: "),
])
def test_cli_reports_one_line_and_exit_2(tmp_path, text, needle):
    p = write(tmp_path, text)
    out = subprocess.run(
        [sys.executable, "-m", "prlmfuse.cli", "run", str(p), "--dry-run"], capture_output=True, text=True
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "nope.txt" not in text or lines[0].endswith(str(tmp_path / "nope.txt"))
    assert "Traceback" not in out.stderr


def test_device_and_precision_are_top_level_runtime_settings(tmp_path):
    cfg = load_pipeline(write(tmp_path, "train: {runs: {b: {max_updates: 2}}}\n"))
    assert (cfg.device, cfg.precision) == ("auto", "auto")
    cfg = load_pipeline(write(tmp_path, "device: CUDA:1\nprecision: fp32\ntrain: {runs: {b: {max_updates: 2}}}\n", "b.yaml"))
    assert (cfg.device, cfg.precision) == ("cuda:1", "fp32")


@pytest.mark.parametrize("text, needle", [
    ("device: gpu\n", ":1:9: device: device 'gpu' unknown; use auto, cpu, cuda or cuda:N"),
    ("device: 0\n", ":1:9: device: device 0 unknown"),
    ("precision: half\n", ":1:12: precision: precision 'half' unknown; use auto, bf16, fp16, fp32"),
    ("devise: cpu\n", "did you mean 'device'?"),
    ("train: {runs: {b: {max_updates: 2, update_freq: 0}}}\n", "train.runs.b.update_freq: expected a positive integer"),
    ("train: {runs: {b: {max_updates: 2, bf16: true}}}\n", "train.runs.b.bf16: unknown key"),
])
def test_bad_runtime_settings_are_located_one_line_errors(tmp_path, text, needle):
    assert needle in error_of(write(tmp_path, text))


@pytest.mark.parametrize("text,needle", [
    # a run whose value is not a mapping of settings
    ("train:\n  defaults: {max_updates: 1}\n  runs:\n    baseline: yes\n",
     "p.yaml:4:15: train.runs.baseline: expected a mapping of run settings"),
    ("train:\n  defaults: {max_updates: 1}\n  runs:\n    baseline: [1, 2]\n", "train.runs.baseline: expected a mapping"),
    # settings that would stop nothing, save or log never, or decode nothing
    ("train:\n  runs:\n    b: {save_every: 0, max_updates: 4}\n", "train.runs.b.save_every: expected a positive integer, got 0"),
    ("train:\n  runs:\n    b: {log_every: 0, max_updates: 4}\n", "train.runs.b.log_every: expected a positive integer, got 0"),
    ("train:\n  runs:\n    b: {max_updates: 0}\n", "train.runs.b.max_updates: expected a positive integer, got 0"),
    # a bad value inherited from train.defaults is pointed out there, not at the run that inherits it
    ("train:\n  defaults: {max_updates: -3}\n  runs:\n    b: {}\n",
     "p.yaml:2:27: train.defaults.max_updates: expected a positive integer, got -3"),
    ("train:\n  defaults:\n    max_updates: 2\n    preset: tine\n  runs:\n    b: {}\n",
     "p.yaml:4:13: train.defaults.preset: 'tine' is not one of base, summarization, small, tiny"),
    ("train:\n  defaults: {max_updates: 2, merge: summ}\n  runs:\n    b: {merge: gate}\n    c: {}\n",
     "train.defaults.merge: 'summ' is not one of"),
    ("train:\n  defaults: {max_updates: 2, merge: summ}\n  runs:\n    b: {merge: sumx}\n",
     "p.yaml:4:16: train.runs.b.merge: 'sumx' is not one of"),
    # sizes the trainer would refuse only after the corpus and the caches are built
    ("train:\n  defaults: {max_updates: 2, bpe_vocab: 200}\n  runs:\n    b: {}\n",
     "p.yaml:2:41: train.defaults.bpe_vocab: expected an integer >= 324, got 200 (8000 is typical)"),
    ("train:\n  runs:\n    b: {max_updates: 2, max_tokens: 8}\n",
     "p.yaml:3:37: train.runs.b.max_tokens: expected an integer >= 16, got 8 (3500 is typical)"),
    ("train:\n  runs:\n    b: {max_updates: 2, max_epochs: 0}\n", "train.runs.b.max_epochs: expected a positive integer"),
    ("evaluate: {beam: 0}\n", "p.yaml:1:18: evaluate.beam: expected a number >= 1, got 0"),
    ("evaluate: {average_last: -1}\n", "evaluate.average_last: expected a number >= 0, got -1"),
    # a learned combination of layers over a cache of one layer
    ("cache: {checkpoints: [{name: minilm-l6, layers: [-2]}]}\ntrain:\n  runs:\n    d: {max_updates: 2, prlms: [{checkpoint: minilm-l6, layer: dyn_cls}]}\n",
     "p.yaml:4:64: train.runs.d.prlms.0.layer: 'dyn_cls' combines the cached layers, but cache.checkpoints.0 (minilm-l6) "
     "stores only [-2]; set its layers: all"),
    # optimisation numbers torch would refuse, or misuse, only once training starts
    ("train:\n  runs:\n    b: {max_updates: 2, lr: -1}\n", "p.yaml:3:29: train.runs.b.lr: expected a number >= 0, got -1.0"),
    ("train:\n  defaults: {max_updates: 2, lr: -0.5}\n  runs:\n    b: {}\n", "train.defaults.lr: expected a number >= 0"),
    ("train:\n  runs:\n    b: {max_updates: 2, lr: .inf}\n", "train.runs.b.lr: expected a number >= 0, got inf"),
    ("train:\n  runs:\n    b: {max_updates: 2, warmup: -5}\n", "train.runs.b.warmup: expected an integer >= 0, got -5"),
    ("train:\n  runs:\n    b: {max_updates: 2, keep_last: 0}\n", "train.runs.b.keep_last: expected a positive integer"),
    ("train:\n  runs:\n    b: {max_updates: 2, label_smoothing: 1.0}\n",
     "train.runs.b.label_smoothing: expected a number in [0, 1), got 1.0"),
    ("train:\n  runs:\n    b: {max_updates: 2, weight_decay: -0.1}\n", "train.runs.b.weight_decay: expected a number >= 0"),
    ("train:\n  runs:\n    b: {max_updates: 2, clip_norm: -1.0}\n", "train.runs.b.clip_norm: expected a number >= 0"),
    ("train:\n  runs:\n    b: {max_updates: 2, adam_betas: [0.9, 1.5]}\n",
     "train.runs.b.adam_betas: expected two numbers in [0, 1)"),
    # data and cache values the later stages would refuse without a place in the file
    ("data: {kind: bible, src: fr}\n", "p.yaml:1:26: data.src: 'fr' is not one of en, ja"),
    ("data: {kind: bible, src: ja, tgt: ja}\n", "data.tgt: src and tgt are both 'ja'"),
    ("cache: {max_tokens: 0}\n", "p.yaml:1:21: cache.max_tokens: expected a positive number of tokens per forward pass"),
    # a run name that is no directory of its own
    ("train:\n  defaults: {max_updates: 1}\n  runs:\n    '..': {}\n", "p.yaml:4:5: train.runs...: '..' cannot name a run directory"),
    ("train:\n  defaults: {max_updates: 1}\n  runs:\n    '.': {}\n", "'.' cannot name a run directory"),
    ("train:\n  defaults: {max_updates: 1}\n  runs:\n    a/b: {}\n", "'a/b' cannot name a run directory"),
])
def test_values_that_cannot_work_are_refused_when_the_file_is_read(tmp_path, text, needle):
    p = write(tmp_path, text)
    assert needle in error_of(p)


def test_a_bad_run_value_is_one_line_through_the_cli_before_any_work(tmp_path):
    p = write(tmp_path, f"workdir: {tmp_path / 'work'}\ntrain:\n  defaults: {{max_updates: 1}}\n  runs:\n    baseline: yes\n")
    out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "run", str(p)], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "train.runs.baseline: expected a mapping of run settings" in out.stderr
    assert not (tmp_path / "work").exists()


def test_train_jobs_is_read_and_checked(tmp_path):
    assert load_pipeline(write(tmp_path, "train:\n  runs: {x: {max_updates: 2}}\n")).train.jobs == 1
    assert load_pipeline(write(tmp_path, "train:\n  jobs: 2\n  runs: {x: {max_updates: 2}}\n", "b.yaml")).train.jobs == 2
    msg = error_of(write(tmp_path, "train:\n  jobs: 0\n  runs: {x: {max_updates: 2}}\n", "c.yaml"))
    assert "train.jobs: expected a positive integer (runs trained at once), got 0" in msg
    assert "did you mean 'jobs'?" in error_of(write(tmp_path, "train:\n  job: 2\n", "d.yaml"))


# Every rule of a run's model (train_fused.config.ModelConfig), each broken by one setting of one run:
# (setting written, its value, what the refusal says). The run fuses minilm-l6 unless it sets prlms.
MODEL_RULES = [
    ("heads", "3", "d_model=64 must be a positive multiple of heads=3"),
    ("d_model", "0", "d_model=0 must be a positive multiple of heads=2"),  # heads from the preset
    ("enc_layers", "0", "expected a positive integer, got 0"),
    ("dec_layers", "0", "expected a positive integer, got 0"),
    ("ffn", "0", "expected a positive integer, got 0"),
    ("dropout", "1.0", "expected a number in [0, 1), got 1.0"),
    ("attention_dropout", "-0.1", "expected a number in [0, 1), got -0.1"),
    ("activation_dropout", "1.5", "expected a number in [0, 1), got 1.5"),
    ("feature_dropout", "1.0", "expected a number in [0, 1), got 1.0"),
    ("dropnet_p", "1.5", "expected a number in [0, 1], got 1.5"),
    ("preset", "huge", "'huge' is not one of base, summarization, small, tiny"),
    ("merge", "concat", "'concat' is not one of sum, average, gate, dropnet, direct"),
    ("position", "ffn2", "'ffn2' is not one of attn, add_norm1, ffn, add_norm2"),
    ("side", "left", "'left' is not one of source, target, both, target_flow, both_flow"),
    ("prlms", "[]", None),  # with merge: direct, below
    ("pre_ln", "true", None),  # with position: add_norm1, below
]
# Rules whose setting pipeline.yaml does not hold: the BPE decides vocab_size (bpe_vocab is held to
# a least value above the special ids), and activation and max_positions are the model's fixed choices.
NOT_RUN_SETTINGS = {"vocab_size", "activation", "max_positions"}
PAIRED = {
    "prlms": ("merge: direct, prlms: []", "prlms: []", "train.runs.r.merge: 'direct' feeds PrLM features as the encoder "
              "input; add at least one PrLM to prlms"),
    "pre_ln": ("pre_ln: true, position: add_norm1", "add_norm1", "train.runs.r.position: 'add_norm1' merges after an "
               "add&norm, which pre-LN layers do not have"),
}


def _rule_keys_of_the_model_config() -> set[str]:
    """The setting names ModelConfig's rules raise a SettingError for, read from its source."""
    import ast
    import inspect

    from prlmfuse.train_fused.config import ModelConfig

    keys = set()
    for node in ast.walk(ast.parse(inspect.getsource(ModelConfig))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("SettingError", "_one_of"):
            first = node.args[0]
            if isinstance(first, ast.Constant):
                keys.add(first.value)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):  # `for key in ("dropout", ...)`
            keys.update(e.value for e in node.iter.elts if isinstance(e, ast.Constant))
    return keys


def test_every_model_rule_has_a_read_time_case():
    covered = {key for key, _, _ in MODEL_RULES} | {"side", "position", "merge"}
    assert _rule_keys_of_the_model_config() - NOT_RUN_SETTINGS <= covered


@pytest.mark.parametrize("key,value,detail", [r for r in MODEL_RULES if r[2] is not None], ids=lambda x: str(x))
def test_each_model_rule_is_refused_at_read_time_where_the_setting_stands(tmp_path, key, value, detail):
    settings = f"{key}: {value}" + (", merge: dropnet" if key == "dropnet_p" else "")
    run_line = f"    r: {{prlms: [{{checkpoint: minilm-l6}}], {settings}}}"
    p = write(tmp_path, "cache: {checkpoints: [{name: minilm-l6}]}\ntrain:\n  defaults: {preset: tiny, max_updates: 10}\n"
              f"  runs:\n{run_line}\n")
    column = run_line.index(f"{key}: {value}") + len(key) + 3
    assert f"p.yaml:5:{column}: train.runs.r.{key}: {detail}" in error_of(p)


@pytest.mark.parametrize("key", sorted(PAIRED))
def test_rules_of_two_settings_point_at_the_one_named(tmp_path, key):
    settings, value, message = PAIRED[key]
    run_line = f"    r: {{prlms: [{{checkpoint: minilm-l6}}], {settings}}}"
    if key == "prlms":
        run_line = f"    r: {{{settings}}}"
    p = write(tmp_path, "cache: {checkpoints: [{name: minilm-l6}]}\ntrain:\n  defaults: {preset: tiny, max_updates: 10}\n"
              f"  runs:\n{run_line}\n")
    msg = error_of(p)
    assert message in msg and msg.startswith(f"{p}:5:"), msg


def test_a_model_rule_broken_by_a_default_points_at_train_defaults(tmp_path):
    p = write(tmp_path, "cache: {checkpoints: [{name: minilm-l6}]}\ntrain:\n  defaults: {preset: tiny, max_updates: 10, "
              "pre_ln: true, position: add_norm2}\n  runs:\n    base: {}\n    f: {prlms: [{checkpoint: minilm-l6}]}\n")
    # The baseline has no branch to merge, so only the fused run breaks the rule, at the default it inherits.
    assert "p.yaml:3:69: train.defaults.position: 'add_norm2' merges after an add&norm" in error_of(p)
    # A rule between two settings (heads from the preset, d_model written) points at the one written.
    p = write(tmp_path, "train:\n  defaults: {max_updates: 10}\n  runs:\n    b: {d_model: 100}\n", "b.yaml")
    assert "b.yaml:4:18: train.runs.b.d_model: d_model=100 must be a positive multiple of heads=8" in error_of(p)


def test_merge_direct_takes_several_prlms_as_the_model_does(tmp_path):
    p = write(tmp_path, "cache: {checkpoints: [{name: minilm-l6}, {name: e5-small}]}\ntrain:\n  runs:\n"
              "    d: {max_updates: 2, merge: direct, prlms: [{checkpoint: minilm-l6}, {checkpoint: e5-small}]}\n")
    assert [u.checkpoint for u in load_pipeline(p).run("d").prlms] == ["minilm-l6", "e5-small"]


def test_dropnet_p_is_a_run_setting_that_reaches_run_json_and_the_model(tmp_path):
    p = write(tmp_path, "cache: {checkpoints: [{name: minilm-l6}]}\ntrain:\n  runs:\n"
              "    d: {max_updates: 2, merge: dropnet, dropnet_p: 0.3, prlms: [{checkpoint: minilm-l6}]}\n")
    run = load_pipeline(p).run("d")
    assert run.to_dict()["dropnet_p"] == 0.3 and run.model_config(500, []).dropnet_p == 0.3


def test_the_issue_runs_are_refused_by_the_dry_run_with_their_location(tmp_path):
    """Two runs only the model could refuse, refused by `run --dry-run` before any work."""
    body = (f"workdir: {tmp_path / 'work'}\ncache: {{checkpoints: [{{name: minilm-l6}}]}}\ntrain:\n"
            "  defaults: {preset: tiny, max_updates: 10}\n  runs:\n")
    runs = {"a": "    a: {prlms: [{checkpoint: minilm-l6, layer: -2}], pre_ln: true, position: add_norm1}\n",
            "b": "    b: {prlms: [{checkpoint: minilm-l6, layer: -2}], merge: direct, side: both}\n"}
    expected = {"a": ":6:78: train.runs.a.position: 'add_norm1' merges after an add&norm",
                "b": ":6:75: train.runs.b.side: merge 'direct' replaces the source input, so side must be 'source'"}
    for name, line in runs.items():
        p = write(tmp_path, body + line, f"{name}.yaml")
        out = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "run", str(p), "--dry-run"], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"error: {p}{expected[name]}"), out.stderr
    assert not (tmp_path / "work").exists()


def test_the_plan_counts_every_batch_of_an_update(tmp_path):
    """`run --dry-run` states an update as update_freq batches, and its token bound counts them all."""
    from prlmfuse.plan import plan_lines

    cfg = load_pipeline(write(tmp_path, "device: cpu\ntrain:\n  defaults: {max_tokens: 4096, max_updates: 300}\n"
                                        "  runs:\n    one: {}\n    eight: {update_freq: 8}\n"))
    lines = plan_lines(cfg, None)
    assert any(line.startswith("train: one ") and line.endswith("budget 300 updates of 4096-token batches")
               for line in lines), lines
    assert any(line.startswith("train: eight ") and line.endswith("budget 300 updates of 8 x 4096-token batches per update")
               for line in lines), lines
    assert "estimate: 600 updates left (2700 batches), at most 11.1M tokens" in lines  # 300 x 4096 x (1 + 8)
