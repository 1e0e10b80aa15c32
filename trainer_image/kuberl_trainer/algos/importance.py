"""The rollout/trainer mismatch: how large it is (``gap_metrics``, every step) and importance
sampling to correct for it, truncated (TIS) and masked (MIS).

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
        ``(weights, metrics)``: ``tis_weight_mean`` and ``tis_truncated_fraction`` (tokens
        whose weight hit the cap), as 0-d tensors on the inputs' device (reading them is the
        caller's one host transfer). The gap itself is ``gap_metrics``', reported with or
        without TIS.
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap must be positive, got {cap}")
    on, diff = _log_ratios(old_logp, rollout_logp, mask)
    raw = torch.exp(diff)
    weights = torch.where(on, raw.clamp(max=cap), torch.zeros_like(raw))
    n = on.sum().clamp(min=1).to(weights.dtype)
    metrics = {"tis_weight_mean": weights.sum() / n,
               "tis_truncated_fraction": (on & (raw > cap)).sum() / n}
    return weights, metrics


def gap_metrics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engines' log-probs of the sampled tokens lie from the trainer's, for the
    same weights: the train-inference gap, reported every step whatever corrects for it.

    Token level, over the response tokens: ``rollout_logp_diff`` (mean ``old - rollout``,
    signed: the k1 estimate of KL(engine || trainer)), ``rollout_logp_abs_diff_mean`` and
    ``rollout_logp_abs_diff_max``. Sequence level, the per-token-mean variant: each response's
    ``r_i = mean_t (old - rollout)``, the log of the geometric-mean ratio
    ``exp(mean_t log(pi_old / pi_rollout))`` that ``importanceMask`` ``level: sequence``
    bands, and its extremes over the responses, ``rollout_seq_log_ratio_max`` and
    ``rollout_seq_log_ratio_min`` (their spread is how far apart the sequence-level weights
    of one batch lie; the token-sum variant would grow with a response's length). Means and
    extremes, because those are what combine exactly over micro-batches and ranks
    (``backends.step_metrics``): a standard deviation would not.

    Without response tokens every value is 0 (and the count 0 tells ``StepMetrics`` to leave
    its extremes out). 0-d tensors on the inputs' device, detached.
    """
    on, diff = _log_ratios(old_logp, rollout_logp, mask)
    n = on.sum().clamp(min=1).to(diff.dtype)
    counts = on.sum(dim=-1)
    rows = counts > 0
    seq = diff.sum(dim=-1) / counts.clamp(min=1).to(diff.dtype)  # [B]: r_i
    zero = diff.new_zeros(())
    seq_max = seq_min = abs_max = zero
    if diff.numel():  # (a shape, not a value: no device sync)
        none = ~rows.any()
        abs_max = diff.abs().max()
        seq_max = torch.where(none, zero, torch.where(rows, seq, -math.inf).max())
        seq_min = torch.where(none, zero, torch.where(rows, seq, math.inf).min())
    return {"rollout_logp_diff": diff.sum() / n,
            "rollout_logp_abs_diff_mean": diff.abs().sum() / n,
            "rollout_logp_abs_diff_max": abs_max,
            "rollout_seq_log_ratio_max": seq_max,
            "rollout_seq_log_ratio_min": seq_min}


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
