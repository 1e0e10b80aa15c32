"""A tiny random HF causal LM and a character-level tokenizer, built locally (no downloads).

`build_tiny_model(dir)` writes a Qwen2-config model (hidden 32, 2 layers) with tied embeddings
(as small Qwen checkpoints have, so weight sync must handle `lm_head.weight` aliasing
`model.embed_tokens.weight`) and a `PreTrainedTokenizerFast` over a WordLevel vocabulary of
single characters: every character is one token, so token counts are predictable in tests.
`build_tiny_classifier(dir)`: the same shape as a Qwen2ForSequenceClassification (a scalar
reward model's form), for the reference engine's --is-embedding mode.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = string.digits + string.ascii_lowercase + " +-*/=.,?!"
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARS])}
PAD_ID, EOS_ID = VOCAB[PAD], VOCAB[EOS]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK))
    # Every character (spaces included) is its own token; Fuse joins them back on decode.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   unk_token=UNK)


def tiny_config(vocab_size: int = len(VOCAB)) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None)


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write model + tokenizer into `path` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    return save_scaled(Qwen2ForCausalLM(tiny_config()), path)


def save_scaled(model: torch.nn.Module, path: Path) -> Path:
    """`model` with its matrices redrawn at std 0.5, saved with the tiny tokenizer into `path`.
    Random init at std 0.02 gives near-uniform next-token distributions; a larger scale
    makes greedy decoding and sampling visibly depend on the weights."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)  # type: ignore[operator]
    build_tokenizer().save_pretrained(path)
    return path


def build_tiny_classifier(path: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """A random Qwen2ForSequenceClassification (a reward model's form, `num_labels` outputs)
    over the same tokenizer, written into `path` (created); returns it."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_config()
    config.num_labels = num_labels
    config.tie_word_embeddings = False
    config.architectures = ["Qwen2ForSequenceClassification"]
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
