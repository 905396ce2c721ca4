"""The joint source+target BPE of a run, trained with Hugging Face `tokenizers` and saved as bpe.json.

Pre-tokenization is Metaspace (spaces become "▁" and start a new word) after NFKC, so text
without spaces (Japanese, Chinese) is still segmented by the learned merges inside one long
"word". The 256 byte tokens <0x00>..<0xFF> sit right after the special tokens and the model
falls back to them for characters never seen in training, so every NFKC-normalised line
decodes back to itself exactly (no <unk> in practice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from prlmfuse.errors import UserError
from prlmfuse.fileio import atomic_write_text, read_lines

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
# Smallest vocabulary that still leaves room for merges beyond specials, bytes and characters.
MIN_VOCAB = len(SPECIAL_TOKENS) + len(BYTE_TOKENS) + 64


def normalize_line(text: str) -> str:
    """What the tokenizer sees, and therefore what decode() gives back: NFKC, outer whitespace stripped."""
    return unicodedata.normalize("NFKC", text).strip()


def _empty_tokenizer(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)]
    )
    return tok


class BPE:
    """A trained joint BPE: ids without specials in, text out; <pad>=0 <s>=1 </s>=2 <unk>=3."""

    def __init__(self, tokenizer: Tokenizer):
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != token_id:
                raise UserError(
                    f"BPE vocabulary has {token} at id {tokenizer.token_to_id(token)}, expected {token_id}; "
                    "retrain bpe.json with prlmfuse"
                )
        self.tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Subword ids of one line, no <s> or </s>."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a hypothesis: stops at the first </s>, drops <pad>/<s>."""
        kept: list[int] = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            kept.append(i)
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.tokenizer.to_str(pretty=False))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPE":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"BPE model not found: {path}; train the run again or point at its run directory")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise UserError(f"BPE model {path} is corrupt ({e}); delete it and retrain the run") from None
        return cls(tok)


def _alphabet(texts: Sequence[str], limit: int) -> list[str] | None:
    """The `limit` most frequent characters as the tokenizer sees them, or None when all fit.

    Chosen here rather than by the trainer's own limit_alphabet, which breaks ties among equally
    frequent characters in hash order, so two trainings on the same text kept different
    characters: ties go to the smaller code point. Forced into the trainer's alphabet, they are
    exactly what it keeps when the limit equals their number.
    """
    counts: Counter[str] = Counter()
    for text in texts:
        line = normalize_line(text)
        counts.update(line.replace(" ", "▁"))
        counts["▁"] += 1  # Metaspace prepends one to every line
    if len(counts) <= limit:
        return None
    return sorted(counts, key=lambda c: (-counts[c], c))[:limit]


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPE:
    """Learn a joint BPE of at most `vocab_size` ids (specials + 256 bytes + learned pieces).

    The alphabet keeps at most half of the learned pieces, the most frequent characters; rarer
    ones are spelled in byte tokens. Why: `tokenizers` otherwise keeps every character it sees,
    and a Japanese or Chinese side brings thousands (3,767 on the Bible's Japanese), which left a
    4,000-id vocabulary no merges at all, so English came out letter by letter.
    Fewer ids come out when the text runs out of pairs worth merging (tiny corpora).
    """
    if vocab_size < MIN_VOCAB:
        raise UserError(f"bpe_vocab={vocab_size} is too small; use at least {MIN_VOCAB} (8000 is typical)")
    texts = list(texts)
    alphabet = _alphabet(texts, (vocab_size - len(SPECIAL_TOKENS) - len(BYTE_TOKENS)) // 2)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        **({} if alphabet is None else {"initial_alphabet": alphabet, "limit_alphabet": len(alphabet)}),
    )
    tok = _empty_tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(texts, trainer)
    learned = json.loads(tok.to_str())["model"]
    # Re-number: specials, then the byte-fallback tokens, then every learned piece in training order.
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
    for piece, _ in pieces:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    final = _empty_tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    final.add_special_tokens(SPECIAL_TOKENS)
    return BPE(final)


def train_bpe_files(src_path: str, tgt_path: str, limit: int | None, vocab_size: int, out: str) -> None:
    """train_bpe over the first `limit` pairs (all for None) of two line-aligned files, saved to `out`.

    What train_run's BPE child process runs: this module imports no torch, so neither does the child.
    """
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if limit is not None:
        src, tgt = src[:limit], tgt[:limit]
    train_bpe(src + tgt, vocab_size).save(out)


def train_bpe_in_child(src_path: str, tgt_path: str, limit: int | None, vocab_size: int, out: str) -> None:
    """train_bpe_files in a child Python process: the `tokenizers` trainer's pair counts stay in the
    heap of the process that ran it, which would leave a trainer larger by an amount that grows with
    the corpus. The child reports a UserError or an OSError as one JSON line on stderr (no pickling),
    raised here again as the same type."""
    request = json.dumps({"src": src_path, "tgt": tgt_path, "limit": limit, "vocab_size": vocab_size, "out": out})
    code = "import sys; from prlmfuse.train_fused.bpe import _child_main; _child_main(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, request], capture_output=True, text=True)
    if done.returncode == 0:
        return
    lines = done.stderr.strip().splitlines()
    try:
        error = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the BPE training process failed (exit {done.returncode}): {done.stderr[-2000:]}") from None
    if error["type"] == "UserError":
        raise UserError(error["message"])
    raise OSError(error["errno"], error["strerror"], error["filename"])


def _child_main(request: str) -> None:
    args = json.loads(request)
    try:
        train_bpe_files(args["src"], args["tgt"], args["limit"], args["vocab_size"], args["out"])
    except UserError as e:
        print(json.dumps({"type": "UserError", "message": str(e)}), file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        print(json.dumps({"type": "OSError", "errno": e.errno, "strerror": e.strerror, "filename": e.filename}),
              file=sys.stderr)
        sys.exit(2)
