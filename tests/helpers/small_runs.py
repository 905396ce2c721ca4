"""Builders for the stage-two tests: a small real corpus, a tiny PrLM, its caches, a seconds-long run."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_prlms
from prlmfuse.train_fused.config import PrLMUse, RunConfig


def small_bible(root: Path, *, train: int = 240, dev: int = 24, test: int = 24):
    """The first verses of the real Bible English->Japanese corpus, registered as a corpus of its own."""
    from prlmfuse.corpora import build_bible, register_text

    full = build_bible(root / "bible")
    files = {}
    for split, n in (("train", train), ("dev", dev), ("test", test)):
        for side in ("src", "tgt"):
            lines = (full.root / f"{split}.{side}").read_text(encoding="utf-8").splitlines()[:n]
            path = root / "raw" / f"{split}.{side}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            files[f"{split}_{side}"] = path
    return register_text(root / "small", **files, src_lang="en", tgt_lang="ja", name="bible-small")


def tiny_prlm(root: Path, *, layers: int = 3, width: int = 32) -> Path:
    """A random-weight BERT with its WordPiece tokenizer saved in `root` (a local checkpoint dir)."""
    return tiny_prlms.build_tiny("bert", root, layers=layers, width=width, max_positions=128)


def build_caches(checkpoint: Path, corpus, out: Path, *, layers: str = "-2", backend: str = "zarr") -> dict[str, str]:
    from prlmfuse.cache_features import build_cache

    paths = {}
    for split in ("train", "dev", "test"):
        result = build_cache(str(checkpoint), corpus.src_path(split), out / split, layers=layers, backend=backend, progress=False)
        paths[split] = str(result.path)
    return paths


def caches_for(use: PrLMUse, paths: dict[str, str]) -> dict[str, str]:
    """The {split: cache} that train_run takes for one PrLM branch."""
    return {split: paths[split] for split in ("train", "dev", "test") if split in paths}


def tiny_run(name: str = "tiny", **overrides) -> RunConfig:
    """A seconds-long run: tiny preset, small BPE, small batches, no dropout randomness unless asked."""
    values = dict(
        name=name, preset="tiny", bpe_vocab=600, max_tokens=300, max_updates=12, max_epochs=None,
        save_every=4, keep_last=3, log_every=2, warmup=4, dropout=0.0, num_workers=0, seed=3,
    )
    values.update(overrides)
    return RunConfig(**values)


def fused_world(root: Path, *, layers: str = "-2"):
    """(corpus, PrLMUse, [its caches]): the small Bible, a tiny PrLM's caches of its splits, one branch over them."""
    corpus = small_bible(root)
    checkpoint = tiny_prlm(root / "bert")
    paths = build_caches(checkpoint, corpus, root / "cache", layers=layers)
    use = PrLMUse(checkpoint=str(checkpoint), layer=-2)
    return corpus, use, [caches_for(use, paths)]
