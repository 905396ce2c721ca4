"""Decoding settings and their defaults: the one place they are defined.

The CLI's decode options, pipeline.yaml's `evaluate:` section, `evaluate_runs`, `translate` and
bench/decode_throughput.py all take their defaults from here. Imports nothing heavy, so the CLI
can read it while building its options.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

AVERAGE_LAST = 5  # decode with the average of the newest 5 checkpoints (0: best.safetensors)
# Which checkpoints average_last counts: the newest saves, or the newest saved at an epoch end (the
# paper averages the last 5 epoch-end checkpoints). train_fused.run_dir reads the choices from here.
AVERAGE_CHOICES = ("saves", "epochs")
AVERAGE = "saves"
BATCH_TOKENS = 4096  # source tokens per decoding batch
SUMMARIZATION_NO_REPEAT_NGRAM = 3  # the paper's trigram blocking for summarization


@dataclass(frozen=True)
class DecodeSettings:
    beam: int = 5
    lenpen: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    min_len: int = 1
    no_repeat_ngram_size: int = 0
    bf16: bool = False  # autocast the decoder's matmuls to bf16 (fast on AMX CPUs, not bit-identical)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_run(cls, run, no_repeat_ngram_size: int | None, **options) -> DecodeSettings:
        """The settings for one run (anything with a `task`): n-gram blocking defaults to 3 for
        summarization, as in the paper, and to none otherwise."""
        if no_repeat_ngram_size is None:
            no_repeat_ngram_size = SUMMARIZATION_NO_REPEAT_NGRAM if run.task == "summarization" else 0
        return cls(no_repeat_ngram_size=int(no_repeat_ngram_size), **options)


DEFAULTS = DecodeSettings()
