"""A tiny Qwen2 causal LM saved as an HF directory, for backend tests (random weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB = 32


def save_tiny_qwen2(path: Path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=64, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def tiny_qwen3_moe_config(**overrides: object) -> Qwen3MoeConfig:
    """Three decoder layers, the middle one dense (``mlp_only_layers``), the others 4 experts,
    top-2 (renormalised)."""
    settings: dict[str, object] = dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.01,
        tie_word_embeddings=False, initializer_range=0.2)
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


def save_tiny_qwen3_moe(path: Path, seed: int = 0, **overrides: object) -> str:
    """A tiny random Qwen3-MoE (``tiny_qwen3_moe_config``) as an HF directory. The router
    weights get a larger scale than HF's init so that the top-k is decided by margins wider
    than float noise (a replay test must not pass by luck of ties)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)
