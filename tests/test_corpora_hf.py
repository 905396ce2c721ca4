"""data kind hf: corpora from Hugging Face `datasets` datasets made in the test (save_to_disk
directories and local data files; nothing is downloaded), their checks, the pipeline.yaml keys,
the CLI's paste-ready lines, and two training updates from such a corpus."""

from __future__ import annotations

import json
import random
import sys

import pytest

from prlmfuse.corpora import build_hf, load_corpus
from prlmfuse.errors import UserError
from prlmfuse.fileio import read_lines, sha256_file

from helpers import small_runs
from helpers.reliability import assert_one_line_error, run_cli

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No hub, and `datasets`' own cache of local files kept inside the test's directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _pairs(n: int, start: int = 0) -> list[tuple[str, str]]:
    """Distinct English/Japanese pairs (the Japanese says the same thing, number included)."""
    nouns = ["cat", "dog", "bird", "fish", "tree", "river", "house", "book"]
    ja = {"cat": "猫", "dog": "犬", "bird": "鳥", "fish": "魚", "tree": "木", "river": "川", "house": "家", "book": "本"}
    out = []
    for i in range(start, start + n):
        noun = nouns[i % len(nouns)]
        out.append((f"I see {i} {noun}s near the water .", f"水 の 近く に {ja[noun]} が {i} 匹 見える 。"))
    return out


def _translation_rows(pairs):
    return [{"translation": {"en": en, "ja": ja}} for en, ja in pairs]


def _save_train_only(path, n=80):
    datasets.Dataset.from_list(_translation_rows(_pairs(n))).save_to_disk(str(path))
    return path


def test_named_splits_of_a_saved_dataset_dict_with_source_and_target_columns(tmp_path):
    parts = {"train": _pairs(30), "validation": _pairs(5, 100), "test": _pairs(6, 200)}
    datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"src_text": [e for e, _ in p], "tgt_text": [j for _, j in p],
                                          "id": list(range(len(p)))})
        for name, p in parts.items()
    }).save_to_disk(str(tmp_path / "saved"))

    corpus = build_hf(tmp_path / "corpus", dataset=str(tmp_path / "saved"), src_lang="en", tgt_lang="ja",
                      src_field="src_text", tgt_field="tgt_text")
    for split, name in (("train", "train"), ("dev", "validation"), ("test", "test")):
        assert read_lines(corpus.src_path(split)) == [e for e, _ in parts[name]]
        assert read_lines(corpus.tgt_path(split)) == [j for _, j in parts[name]]
    assert (corpus.src_lang, corpus.tgt_lang, corpus.task) == ("en", "ja", "translation")
    assert "src_field=src_text" in corpus.source and "dev=validation" in corpus.source


def test_train_only_translation_dicts_split_by_a_stable_hash_of_the_source(tmp_path):
    pairs = _pairs(200)
    datasets.Dataset.from_list(_translation_rows(pairs)).save_to_disk(str(tmp_path / "a"))
    shuffled = pairs[:]
    random.Random(0).shuffle(shuffled)
    datasets.Dataset.from_list(_translation_rows(shuffled)).save_to_disk(str(tmp_path / "b"))

    a = build_hf(tmp_path / "ca", dataset=str(tmp_path / "a"), src_lang="en", tgt_lang="ja",
                 splits={"dev": 0.1, "test": 0.1})
    again = build_hf(tmp_path / "ca2", dataset=str(tmp_path / "a"), src_lang="en", tgt_lang="ja",
                     splits={"dev": 0.1, "test": 0.1})
    b = build_hf(tmp_path / "cb", dataset=str(tmp_path / "b"), src_lang="en", tgt_lang="ja",
                 splits={"dev": 0.1, "test": 0.1})
    sets = {}
    for split in ("train", "dev", "test"):
        assert sha256_file(a.src_path(split)) == sha256_file(again.src_path(split))  # deterministic
        src_a, tgt_a = read_lines(a.src_path(split)), read_lines(a.tgt_path(split))
        # Each pair stays a pair, keeps the dataset's order, and lands in the same split whatever the row order.
        assert [(s, t) for s, t in pairs if s in set(src_a)] == list(zip(src_a, tgt_a))
        assert set(read_lines(b.src_path(split))) == set(src_a)
        sets[split] = set(src_a)
    assert sets["dev"] and sets["test"] and not (sets["train"] & sets["test"]) and not (sets["dev"] & sets["test"])
    assert sum(len(s) for s in sets.values()) == 200
    assert 5 <= len(sets["test"]) <= 40 and 5 <= len(sets["dev"]) <= 40


def test_local_jsonl_csv_and_parquet_files(tmp_path):
    pairs = _pairs(60)
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"en": e, "ja": j}, ensure_ascii=False) + "\n" for e, j in pairs), encoding="utf-8")
    csv_file = tmp_path / "pairs.csv"
    datasets.Dataset.from_dict({"en": [e for e, _ in pairs], "ja": [j for _, j in pairs]}).to_csv(str(csv_file), index=False)
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    datasets.Dataset.from_dict({"s": [e for e, _ in pairs[:50]], "t": [j for _, j in pairs[:50]]}).to_parquet(str(parquet_dir / "train.parquet"))
    datasets.Dataset.from_dict({"s": [e for e, _ in pairs[50:]], "t": [j for _, j in pairs[50:]]}).to_parquet(str(parquet_dir / "test.parquet"))

    # Columns named after the two languages are found without src_field/tgt_field.
    from_jsonl = build_hf(tmp_path / "c1", dataset=str(jsonl), src_lang="en", tgt_lang="ja", splits={"dev": 0.2, "test": 0.2})
    from_csv = build_hf(tmp_path / "c2", dataset=str(csv_file), src_lang="en", tgt_lang="ja", splits={"dev": 0.2, "test": 0.2})
    for split in ("train", "dev", "test"):
        assert read_lines(from_jsonl.src_path(split)) == read_lines(from_csv.src_path(split))
        assert read_lines(from_jsonl.tgt_path(split)) == read_lines(from_csv.tgt_path(split))
    # A folder of files: its train and test splits by file name, dev carved from train.
    folder = build_hf(tmp_path / "c3", dataset=str(parquet_dir), src_lang="en", tgt_lang="ja", src_field="s", tgt_field="t",
                      splits={"dev": 0.2})
    assert read_lines(folder.src_path("test")) == [e for e, _ in pairs[50:]]
    assert folder.num_pairs("train") + folder.num_pairs("dev") == 50 and folder.num_pairs("dev") >= 1


@pytest.mark.parametrize("rows, kwargs, needles", [
    ([{"en": "a b", "ja": ""}], {}, ["row 0", "empty target", "Dataset.filter"]),
    ([{"en": "a b", "ja": None}], {}, ["row 0", "NoneType", "not text"]),
    ([{"en": "a b", "ja": "x"}], {"src_field": "source", "tgt_field": "ja"}, ["no column 'source'", "en, ja"]),
    ([{"en": "a b", "ja": "x"}], {"src_field": "en"}, ["give both src_field and tgt_field"]),
    ([{"en": "a b", "ja": "x"}], {"splits": {"test": "test"}}, ["no split 'test'", "its splits are train", "fraction"]),
    ([{"en": "a b", "ja": "x"}], {"splits": {"dev": 0.9}}, ["splits.dev", "at most 0.5"]),
    ([{"en": "a b", "ja": "x"}], {"splits": {"test": "train"}}, ["train and test would both be its split 'train'"]),
    ([{"en": "a b", "ja": "x"}], {"splits": {"dev": 0.01, "test": 0.01}}, ["dev split is empty", "raise its fraction"]),
    ([{"translation": {"en": "a", "de": "b"}}], {}, ["row 0", "translation holds {en, de}", "keys en and ja"]),
    ([{"text": "a"}], {}, ["has columns text", "src_field and tgt_field", "translation_field"]),
])
def test_bad_rows_and_settings_are_one_clear_error_and_leave_no_corpus(tmp_path, rows, kwargs, needles):
    datasets.Dataset.from_list(rows * 3).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "corpus"
    kwargs = {"splits": {"dev": 0.5, "test": 0.5}} | kwargs
    with pytest.raises(UserError) as e:
        build_hf(out, dataset=str(tmp_path / "saved"), src_lang="en", tgt_lang="ja", **kwargs)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".corpus")]


def test_missing_local_path_unreachable_hub_id_and_missing_datasets_package(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="no such file or directory"):
        build_hf(tmp_path / "c", dataset=str(tmp_path / "nowhere" / "ds"), src_lang="en", tgt_lang="ja")
    with pytest.raises(UserError, match=r"^dataset someone/no-such-dataset: `datasets` could not load it \(") as e:
        build_hf(tmp_path / "c", dataset="someone/no-such-dataset", src_lang="en", tgt_lang="ja")
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()
    _save_train_only(tmp_path / "saved")
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets where it is not installed
    with pytest.raises(UserError, match=r"needs the `datasets` package.*pip install 'prlmfuse\[hf\]'"):
        build_hf(tmp_path / "c", dataset=str(tmp_path / "saved"), src_lang="en", tgt_lang="ja")


HF_PIPELINE = """\
workdir: work
precision: fp32
{data}
cache:
  checkpoints:
    - name: {prlm}
      layers: [-2]
train:
  defaults: {{preset: tiny, bpe_vocab: 400, max_tokens: 300, max_updates: 2, max_epochs: null, warmup: 2,
             save_every: 2, keep_last: 1, num_workers: 0, dropout: 0.0}}
  runs:
    fused: {{prlms: [{{checkpoint: {prlm}, layer: -2}}]}}
"""


def test_cli_prints_the_pipeline_lines_and_a_pipeline_from_them_trains_two_updates(tmp_path, capsys, monkeypatch):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline import train_runs
    from prlmfuse.pipeline_inputs import build_caches, ensure_data, run_path
    from prlmfuse.train_fused import run_dir as rundir

    monkeypatch.setenv("PRLMFUSE_HOME", str(tmp_path / "home"))
    _save_train_only(tmp_path / "saved", n=120)
    code, out, err = run_cli(["data", "hf", tmp_path / "by-cli", "--dataset", tmp_path / "saved", "--src-lang", "en",
                              "--tgt-lang", "ja", "--dev-split", "0.1", "--test-split", "0.1"], capsys, monkeypatch)
    assert code == 0, err
    block = out[out.index("data:\n"):]
    assert "  kind: hf\n" in block and f"  dataset: {tmp_path / 'saved'}\n" in block
    assert "  splits: {dev: 0.1, test: 0.1}\n" in block

    prlm = small_runs.tiny_prlm(tmp_path / "prlm", layers=2, width=32)
    path = tmp_path / "pipeline.yaml"
    path.write_text(HF_PIPELINE.format(data=block.rstrip("\n"), prlm=prlm), encoding="utf-8")
    cfg = load_pipeline(path)
    assert cfg.data.kind == "hf" and cfg.data.splits == {"dev": 0.1, "test": 0.1}
    corpus = ensure_data(cfg)
    by_cli = load_corpus(tmp_path / "by-cli")
    for split in ("train", "dev", "test"):  # the pasted lines build the corpus the command built
        assert corpus.src_sha256(split) == by_cli.src_sha256(split)
        assert corpus.tgt_sha256(split) == by_cli.tgt_sha256(split)
    jobs = build_caches(cfg, corpus)
    train_runs(cfg, jobs=jobs)
    state = rundir.latest_trainer_state(run_path(cfg, "fused"))
    assert state.update == 2
    assert rundir.read_run_info(run_path(cfg, "fused"))["corpus"]["root"] == str(corpus.root)


@pytest.mark.parametrize("data, needles", [
    ("data: {kind: hf, src: en, tgt: ja}", [":2:", "kind 'hf' needs dataset"]),
    ("data: {kind: hf, dataset: ./missing-dir, src: en, tgt: ja}", ["data.dataset", "no such file or directory"]),
    ("data: {kind: hf, dataset: some/hub-id, splits: {dev: 2}}", ["data.splits.dev", "at most 0.5"]),
    ("data: {kind: hf, dataset: some/hub-id, splits: {valid: validation}}", ["data.splits.valid", "unknown split"]),
    ("data: {kind: hf, dataset: some/hub-id, src_field: en}", ["give both src_field and tgt_field"]),
    ("data: {kind: bible, translation_field: translation}", ["data.translation_field", "only kind 'hf'"]),
])
def test_pipeline_hf_keys_are_checked_with_their_location(tmp_path, data, needles):
    from prlmfuse.config import load_pipeline

    path = tmp_path / "pipeline.yaml"
    path.write_text(f"workdir: work\n{data}\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_pipeline(path)
    message = str(e.value)
    assert message.startswith(str(path)), message
    for needle in needles:
        assert needle in message, message


def test_cli_data_hf_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    datasets.Dataset.from_list([{"en": "a", "ja": ""}] * 4).save_to_disk(str(tmp_path / "saved"))
    result = run_cli(["data", "hf", tmp_path / "out", "--dataset", tmp_path / "saved", "--src-lang", "en",
                      "--tgt-lang", "ja", "--dev-split", "0.5", "--test-split", "0.5"], capsys, monkeypatch)
    assert_one_line_error(result, "empty target")
