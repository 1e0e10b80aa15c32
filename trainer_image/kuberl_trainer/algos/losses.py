"""Policy-gradient losses over masked token sequences.

Shapes: ``B`` sequences of ``T`` tokens (right-padded), ``V`` vocabulary entries. A ``mask``
is ``[B, T]`` with 1 on the tokens that count (response tokens) and 0 on prompt and padding.
All means are token-means over the whole batch: each response token weighs the same, so long
responses are not down-weighted per token (the DAPO / Dr.GRPO choice over a per-sequence mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kuberl_trainer.algos import policy_loss


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x[B, T]`` over positions where the 0/1 ``mask[B, T]`` is 1; a scalar.

    An all-zero mask gives 0 rather than NaN (0 / 0), so an empty micro-batch contributes no
    gradient instead of poisoning the step.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} must match")
    weights = mask.to(x.dtype)
    # where(), not x * mask: padding may hold inf/NaN (e.g. -inf log-probs) and inf * 0 = NaN.
    total = torch.where(weights != 0, x * weights, torch.zeros_like(x)).sum()
    return total / weights.sum().clamp(min=1.0)


def ppo_clip(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_clip: float,
             eps_clip_high: float | None = None, *,
             clip_c: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, token-mean over ``mask``.

    Per token, with ``ratio = exp(logp - old_logp)``::

        loss = max(-adv * ratio, -adv * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))

    so the ratio is held in ``[1 - eps_clip, 1 + eps_clip_high]`` in the direction the
    advantage pushes it: a clipped token contributes no gradient. ``eps_clip_high`` defaults
    to ``eps_clip`` (symmetric PPO); a larger value is DAPO's clip-higher.

    ``clip_c`` (optional, > 1) is dual-clip PPO: for ``adv < 0`` the loss is also capped at
    ``-adv * clip_c``, so a token whose ratio exploded cannot produce an unbounded loss.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained.
        old_logp: ``[B, T]`` log-probs under the policy that generated them (no gradient).
        adv: ``[B, T]`` advantages (see ``advantages.to_tokens``).
        mask: ``[B, T]`` 1 on tokens that count.

    Returns:
        ``(loss, metrics)``: the scalar loss, and floats ``pg_clipfrac`` (fraction of tokens
        where the clipped term was the larger, i.e. had no gradient), ``ratio_mean`` and
        ``approx_kl`` (the k1 estimate ``mean(old_logp - logp)`` of KL(old || new), what
        PPO implementations conventionally log), plus ``pg_clipfrac_lower`` with ``clip_c``.
    """
    per_token, flags = policy_loss.ppo_clip(logp, old_logp, adv, mask, eps_clip, eps_clip_high,
                                            clip_c=clip_c)
    metrics = {"pg_clipfrac": _fraction(flags["clipped"], mask)}
    if "clipped_lower" in flags:
        metrics["pg_clipfrac_lower"] = _fraction(flags["clipped_lower"], mask)
    metrics["ratio_mean"] = masked_mean(flags["ratio"], mask).item()
    with torch.no_grad():
        log_ratio = torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp))
        metrics["approx_kl"] = masked_mean(-log_ratio, mask).item()
    return masked_mean(per_token, mask), metrics


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


def entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Token-mean entropy of the softmax over ``logits[B, T, V]``; a differentiable scalar.

    Computed from ``log_softmax`` in float32 (bf16 logits would lose the small probabilities
    that make up the tail of the sum, and ``softmax`` then ``log`` underflows to -inf).
    Vocabulary entries masked to -inf have probability 0 and contribute 0, not NaN.
    The float32 copy costs ``B * T * V * 4`` bytes; callers with large vocabularies pass
    micro-batches.
    """
    if logits.dim() != 3 or logits.shape[:2] != mask.shape:
        raise ValueError(f"expected logits [B, T, V] and mask [B, T], got "
                         f"{tuple(logits.shape)} and {tuple(mask.shape)}")
    return masked_mean(token_entropy(logits), mask)


def _fraction(flags: Tensor, mask: Tensor) -> float:
    """Fraction of masked-in positions where ``flags`` is true."""
    return masked_mean(flags.float(), mask).item()
