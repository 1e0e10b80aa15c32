"""Importance sampling for the rollout/trainer mismatch: truncated (TIS) and masked (MIS).

The engines sample with their own kernels (and often lower precision), so the probability a
response had when it was generated, ``rollout_logp``, is not exactly the trainer's ``old_logp``
for the same weights. The policy gradient assumes samples from ``old``; reweighting each token
by ``old / rollout`` corrects for the engine's distribution, and truncating the weight at
``cap`` bounds the variance (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; the same truncation as IMPALA's V-trace).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor


def truncated_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                      cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights ``min(exp(old_logp - rollout_logp), cap)``, detached, 0 off the mask.

    Args:
        old_logp: ``[B, T]`` trainer log-probs of the sampled tokens under the sampling policy.
        rollout_logp: ``[B, T]`` the engines' log-probs of the same tokens.
        mask: ``[B, T]`` 1 on response tokens.
        cap: the truncation, > 0 (2 is the paper's choice).

    Returns:
        ``(weights, metrics)``: ``tis_weight_mean``, ``tis_truncated_fraction`` (tokens whose
        weight hit the cap) and ``rollout_logp_diff`` (mean ``old_logp - rollout_logp``, the
        k1 estimate of the mismatch; near 0 when engines and trainer agree), as 0-d tensors
        on the inputs' device (reading them is the caller's one host transfer).
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap must be positive, got {cap}")
    on, diff = _log_ratios(old_logp, rollout_logp, mask)
    raw = torch.exp(diff)
    weights = torch.where(on, raw.clamp(max=cap), torch.zeros_like(raw))
    n = on.sum().clamp(min=1).to(weights.dtype)
    metrics = {"tis_weight_mean": weights.sum() / n,
               "tis_truncated_fraction": (on & (raw > cap)).sum() / n,
               "rollout_logp_diff": diff.sum() / n}
    return weights, metrics


def masked_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *,
                   level: Literal["token", "sequence"], low: float, high: float
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling: 1 where the ratio ``pi_old / pi_rollout`` lies within
    ``[low, high]``, 0 where it leaves the band (and off the mask), detached. Where TIS
    shrinks a far-off token's weight, this drops the token: samples the trainer's policy
    would almost never have drawn (stale ones in async training, or an engine's numerical
    outliers) stop pushing the gradient at all.

    ``level`` token judges each token's own ratio; sequence judges a response as a whole by
    its geometric-mean ratio ``exp(mean_t (old_logp - rollout_logp))`` and keeps or drops all
    its tokens together (a long response's product of ratios would leave any band).

    Returns ``(weights, metrics)``: ``mis_masked_fraction``, the share of response tokens
    dropped, as a 0-d tensor on the inputs' device.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"the band must hold 1: 0 < low <= 1 <= high, got [{low}, {high}]")
    on, diff = _log_ratios(old_logp, rollout_logp, mask)
    if level == "token":
        log_ratio = diff
    else:
        counts = on.sum(dim=-1, keepdim=True).clamp(min=1).to(diff.dtype)
        log_ratio = (diff.sum(dim=-1, keepdim=True) / counts).expand_as(diff)
    inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    weights = (on & inside).to(old_logp.dtype)
    n = on.sum().clamp(min=1).to(weights.dtype)
    return weights, {"mis_masked_fraction": (on & ~inside).sum() / n}


def _log_ratios(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(the response tokens as booleans, ``old_logp - rollout_logp`` there and 0 elsewhere,
    detached)."""
    if not old_logp.shape == rollout_logp.shape == mask.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, rollout_logp "
                         f"{tuple(rollout_logp.shape)} and mask {tuple(mask.shape)} must match")
    on = mask.bool()
    return on, torch.where(on, (old_logp - rollout_logp).detach(), torch.zeros_like(old_logp))
