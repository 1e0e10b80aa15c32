"""Per-token log-probs from a causal LM's logits: the shift convention, in one place.

A causal LM's ``logits[:, t]`` is the distribution of the *next* token, ``input_ids[:, t+1]``.
The trainer stores everything aligned to ``input_ids`` positions (see ``base.py``), so the
log-prob of token ``t`` comes from ``logits[:, t-1]`` and position 0, which nothing predicts,
gets 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def next_token_logits(logits: Tensor, temperature: float) -> Tensor:
    """``logits[B, T, V]`` -> ``[B, T-1, V]`` float32, row ``t`` predicting token ``t+1``.

    Divided by the sampling temperature so log-probs match what the engines sampled from
    (SGLang reports log-probs of the temperature-scaled distribution). Float32 because
    bf16 log-softmax loses the small probabilities the PPO ratio depends on.
    """
    return logits[:, :-1].float() / temperature


def gather_logprobs(shifted: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob of each actual token, aligned to ``input_ids`` positions.

    Args:
        shifted: ``[B, T-1, V]`` from ``next_token_logits``.
        input_ids: ``[B, T]`` long.

    Returns:
        ``[B, T]``: column ``t >= 1`` is ``log softmax(shifted[:, t-1])[input_ids[:, t]]``;
        column 0 is 0.
    """
    targets = input_ids[:, 1:].unsqueeze(-1)
    # log_softmax(x)[y] = x[y] - logsumexp(x): gathers one value instead of keeping a second
    # [B, T-1, V] log-softmax tensor alive for backward.
    picked = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return F.pad(picked, (1, 0), value=0.0)


def response_mask(loss_mask: Tensor) -> Tensor:
    """``loss_mask[B, T]`` as float with column 0 cleared (it has no log-prob to train)."""
    mask = loss_mask.to(torch.float32).clone()
    mask[:, 0] = 0.0
    return mask


def used_width(attention_mask: Tensor) -> int:
    """Columns up to the last real token of any row; for right padding the rest is padding.

    Trimming those columns before the forward pass changes no result (attention is causal,
    so padding after a token never affects it) and saves compute on short micro-batches.
    """
    real = attention_mask.bool().any(dim=0).nonzero()
    return int(real[-1].item()) + 1 if real.numel() else 1
