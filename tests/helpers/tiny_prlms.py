"""Tiny random-weight checkpoints of each family, saved like a real one (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

SENTENCES = [
    "In the beginning God created the heavens and the earth.",
    "Now the earth was formless and empty.",
    "God said, let there be light, and there was light.",
    "God saw the light, and saw that it was good.",
    "God called the light day, and the darkness he called night.",
    "There was evening and there was morning, the first day.",
    "Let the waters under the sky be gathered together to one place.",
    "The earth yielded grass, herbs yielding seeds after their kind.",
    "",
    "He made the stars also.",
    "a",
    "the light and the darkness and the waters and the earth and the sky and the seeds and the grass " * 3,
]


def _wordpiece_tokenizer(model_max_length: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(SENTENCES * 4, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=model_max_length,
    )


def _bpe_tokenizer(model_max_length: int, *, roberta_style: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta_style else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    if roberta_style:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
            cls_token="<s>", sep_token="</s>", model_max_length=model_max_length,
        )
    # GPT-2 style: no special tokens added, no pad token
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        model_max_length=model_max_length,
    )


FAMILIES = ("bert", "distilbert", "electra", "gpt2", "xlm-roberta", "llama")


def build_tiny(family: str, out: Path, *, layers: int = 3, width: int = 32, max_positions: int = 64, seed: int = 0) -> Path:
    """Save a random-weight checkpoint of `family` with its tokenizer into `out`; return `out`."""
    import transformers as tf

    torch.manual_seed(seed)
    heads = 4
    if family in ("bert", "distilbert", "electra"):
        tokenizer = _wordpiece_tokenizer(max_positions)
    elif family == "xlm-roberta":
        tokenizer = _bpe_tokenizer(max_positions, roberta_style=True)
    else:
        tokenizer = _bpe_tokenizer(max_positions, roberta_style=family == "llama")
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab)
    if family == "bert":
        config = tf.BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                               intermediate_size=2 * width, max_position_embeddings=max_positions, **common)
        model = tf.BertModel(config)
    elif family == "distilbert":
        config = tf.DistilBertConfig(dim=width, n_layers=layers, n_heads=heads, hidden_dim=2 * width,
                                     max_position_embeddings=max_positions, **common)
        model = tf.DistilBertModel(config)
    elif family == "electra":
        config = tf.ElectraConfig(embedding_size=16, hidden_size=width, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=2 * width,
                                  max_position_embeddings=max_positions, **common)
        model = tf.ElectraModel(config)
    elif family == "xlm-roberta":
        config = tf.XLMRobertaConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=2 * width, max_position_embeddings=max_positions + 2,
                                     pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **common)
        tokenizer.model_max_length = max_positions
        model = tf.XLMRobertaModel(config)
    elif family == "gpt2":
        config = tf.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=max_positions,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **common)
        model = tf.GPT2Model(config)
    elif family == "llama":
        config = tf.LlamaConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                                num_key_value_heads=2, intermediate_size=2 * width,
                                max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **common)
        model = tf.LlamaModel(config)
    else:
        raise ValueError(family)
    # random init leaves norms at 1/0; perturb them so a wrongly applied final norm would show
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_corpus(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def minilm_dir() -> Path:
    # Through the alias: importing the package itself would pull in sentence-transformers.
    from prlmfuse.prlms import resolve_checkpoint

    return Path(resolve_checkpoint("minilm-l6").path)
