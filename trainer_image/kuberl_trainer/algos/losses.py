"""Per-token entropy of the policy, for the entropy bonus and its metric.

Shapes: ``logits[B, T, V]`` -> ``[B, T]``. The policy losses are in ``policy_loss``, how the
terms combine in ``objective`` and how token values become one number in ``aggregation``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def token_entropy(logits: Tensor) -> Tensor:
    """``[B, T]`` entropy of the softmax over each position's ``logits[B, T, V]``.

    From ``log_softmax`` in float32 (bf16 logits lose the small probabilities of the tail, and
    ``softmax`` then ``log`` underflows to -inf); entries masked to -inf have probability 0
    and contribute 0, not NaN. The float32 copy costs ``B * T * V * 4`` bytes; callers with
    large vocabularies pass micro-batches.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, T, V], got {tuple(logits.shape)}")
    logp = F.log_softmax(logits.float(), dim=-1)
    # Clamping -inf to the lowest finite float keeps 0 * log 0 at 0 in value and gradient.
    finite = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite).sum(dim=-1)
