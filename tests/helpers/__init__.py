"""Shared builders for the tests (no tests here); tests/conftest.py puts tests/ on sys.path so a test
file imports them as `from helpers import tiny_prlms, small_runs, reliability`.

- tiny_prlms: random-weight checkpoints of each PrLM family, saved like real ones, and test sentences.
- small_runs: a small real Bible corpus, a tiny BERT, its caches and a seconds-long training run.
- reliability: the CLI run in-process, a forking "zygote" for kill trials, cache comparison and damage.
"""
