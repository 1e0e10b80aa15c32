"""Tiny random mixture-of-experts causal LMs over the tiny character tokenizer (tiny_model.py),
built locally for the reference engine's MoE tests.

`build_tiny_moe(dir)`: a Qwen3-MoE (3 decoder layers, the middle one dense through
`mlp_only_layers`, so route tables carry a NO_ROUTE layer; 8 experts, top 2). `family="qwen2"`:
the same as a Qwen2-MoE (which adds a shared expert). Weights at std 0.5, as the dense tiny
model's, so that greedy decoding and the routers' choices visibly depend on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.integration.tiny_model import EOS_ID, PAD_ID, VOCAB, save_scaled

EXPERTS, TOP_K, LAYERS, DENSE_LAYERS = 8, 2, 3, (1,)


def tiny_moe_config(family: str = "qwen3") -> Qwen3MoeConfig | Qwen2MoeConfig:
    common: dict[str, Any] = dict(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        mlp_only_layers=list(DENSE_LAYERS), decoder_sparse_step=1, norm_topk_prob=True,
        tie_word_embeddings=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        bos_token_id=None)
    if family == "qwen3":
        return Qwen3MoeConfig(**{**common, "head_dim": 8})
    if family == "qwen2":
        return Qwen2MoeConfig(shared_expert_intermediate_size=16, **common)
    raise ValueError(f"unknown family {family!r}")


def build_tiny_moe(path: Path, seed: int = 0, family: str = "qwen3") -> Path:
    """Write model + tokenizer into `path` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_moe_config(family)
    model = (Qwen3MoeForCausalLM(config) if family == "qwen3"  # type: ignore[arg-type]
             else Qwen2MoeForCausalLM(config))  # type: ignore[arg-type]
    return save_scaled(model, path)
