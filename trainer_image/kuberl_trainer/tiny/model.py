"""The tiny policy: a Qwen2-config causal LM sized like DESIGN.md's reference (~0.66M params),
or (the moe variant) a Qwen3-MoE one of the same width and depth whose experts' active
parameters match the dense MLP's.

Qwen2 (not a bespoke module) so the trainer backends and the reference engine run it through the
same `AutoModelForCausalLM` path as a real checkpoint. hidden 128 x 4 layers is the smallest
shape we found that learns carries within a minute of SFT on 2 cores; hidden 64 at 2-4 layers
(a quarter of the parameters) plateaus lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kuberl_trainer.tiny.tokenizer import EOS, PAD, VOCAB


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 256
    # prompt (6) + answer (<= 3) + eos, with room to spare for longer prompts in tests.
    max_positions: int = 64
    # Init std ~ 1/sqrt(hidden) instead of HF's 0.02. RL starts with a fresh AdamW whose
    # first steps move every weight by about lr (sign-like, before its second moments settle);
    # on a model grown from 0.02-scale weights one such step at lr 5e-4 took sampled accuracy
    # from 0.24 to 0.01 and GRPO never recovered. From 0.08 the same step costs ~0.05.
    init_std: float = 0.08


def _settings(shape: ModelShape) -> dict[str, Any]:
    """What the dense and the moe configs share: the vocabulary, the attention and width, the
    special tokens, the init scale."""
    return {
        "vocab_size": len(VOCAB),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": True,
        "pad_token_id": VOCAB[PAD],
        "eos_token_id": VOCAB[EOS],
        "bos_token_id": None,
        # (moe: the routers' weights draw from it too)
        "initializer_range": shape.init_std,
    }


def make_config(shape: ModelShape) -> Qwen2Config:
    return Qwen2Config(**_settings(shape))


@dataclass(frozen=True)
class Experts:
    """The moe variant's sparse MLPs (every layer's), on ModelShape's attention and width.
    Top-2 of 4 experts of half the dense MLP's width: the active MLP parameters per token
    (2 x 3 x 128 x 128) equal the dense model's (3 x 128 x 256), so a step costs about the
    same; the total is ~1.05M (the experts hold twice the dense MLP's weights)."""

    experts: int = 4
    per_token: int = 2
    intermediate: int = 128
    # Qwen3-MoE's own: the top-k weights renormalised to sum to 1 (each token's MLP output
    # keeps the dense scale whichever experts it goes to).
    norm_topk_prob: bool = True
    # HF's default; the saved config leaves output_router_logits off, so the load-balancing
    # loss is added only where a trainer asks for it (the SFT warm start does).
    router_aux_loss_coef: float = 0.001


def make_moe_config(shape: ModelShape, experts: Experts) -> Qwen3MoeConfig:
    # (intermediate_size goes unused: every layer is sparse)
    return Qwen3MoeConfig(
        **_settings(shape),
        moe_intermediate_size=experts.intermediate,
        num_experts=experts.experts,
        num_experts_per_tok=experts.per_token,
        norm_topk_prob=experts.norm_topk_prob,
        router_aux_loss_coef=experts.router_aux_loss_coef,
        output_router_logits=False,
    )


def make_model(shape: ModelShape, seed: int, experts: Experts | None = None
               ) -> Qwen2ForCausalLM | Qwen3MoeForCausalLM:
    """A freshly initialised model, dense or (`experts` given) Qwen3-MoE; the weights depend
    only on `seed` (and torch's version)."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(make_config(shape)) if experts is None \
        else Qwen3MoeForCausalLM(make_moe_config(shape, experts))
    # generation_config.json is written by save_pretrained; without eos/pad there, HF
    # `generate` would run to max_new_tokens and warn about a missing pad token.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=VOCAB[EOS], pad_token_id=VOCAB[PAD], max_new_tokens=4)
    return model


def n_params(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor; parameters() already yields it once.
    return sum(p.numel() for p in model.parameters())
