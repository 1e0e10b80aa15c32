"""A tiny Qwen2 causal LM saved as an HF directory, for backend tests (random weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 32


def save_tiny_qwen2(path: Path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=64, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)
