"""Per-token policy-gradient losses: PPO's clipped surrogate (with clip-higher and dual clip),
GSPO's sequence-level variant, CISPO's clipped importance weights, SAPO's soft gate and GPG's
plain policy gradient. Aggregation into one number is ``aggregation``'s job.

Shapes: ``[B, T]`` everywhere, ``mask`` 1 on response tokens. ``old_logp`` is the policy that
generated the samples (no gradient flows into it); ``adv`` per token (0 off the mask).
Masked-out positions get a log-ratio of 0 before any ``exp``: padding may hold arbitrary
log-probs, and an inf ratio there would become NaN gradients even though the mask drops it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# GSPO clamps the sequence log-ratio before exp (a sequence whose likelihood moved by more
# than e^10 is clipped anyway; the clamp keeps exp finite).
GSPO_LOG_RATIO_MAX = 10.0
# SAPO's gate reads the ratio itself: a token whose log-ratio overflowed exp would make its
# gradient 0 * inf = NaN. Beyond |20| the gate is flat (sigmoid saturated) either way.
SAPO_LOG_RATIO_MAX = 20.0


def ppo_clip(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_clip: float,
             eps_clip_high: float | None = None, *,
             clip_c: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token, ``ratio = exp(logp - old_logp)``::

        loss = max(-adv * ratio, -adv * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))

    The ratio is held in ``[1 - eps_clip, 1 + eps_clip_high]`` in the direction the advantage
    pushes it: a clipped token contributes no gradient. ``eps_clip_high`` defaults to
    ``eps_clip``; a larger one is DAPO's clip-higher (Yu et al. 2025), which leaves room for
    unlikely tokens to gain probability. ``clip_c`` (> 1) is dual-clip PPO (Ye et al. 2020):
    for ``adv < 0`` the loss is also capped at ``-adv * clip_c``, so a token whose ratio
    exploded cannot produce an unbounded loss.

    Returns:
        ``(per_token [B, T], flags)``: the loss per token (0 off the mask) and boolean
        ``[B, T]`` flags ``clipped`` (the clipped term was the larger: no gradient) and, with
        ``clip_c``, ``clipped_lower`` (the dual-clip cap bit), plus ``ratio`` (detached).
    """
    high = _check_clip(eps_clip, eps_clip_high)
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    flags = {"clipped": clipped > unclipped, "ratio": ratio.detach()}
    if clip_c is not None:
        capped = torch.minimum(per_token, -adv * clip_c)
        flags["clipped_lower"] = (adv < 0) & (capped < per_token)
        per_token = torch.where(adv < 0, capped, per_token)
    return _masked(per_token, mask), flags


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_clip: float,
         eps_clip_high: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clip on a *sequence-level* importance ratio, the
    geometric mean of the token ratios of a response::

        s_i = exp(mean_t (logp - old_logp))        over response i's tokens

    clipped to ``[1 - eps_clip, 1 + eps_clip_high]``. Every token of a response shares its
    value; its gradient is ``s_i`` times the token's own ``grad logp`` (the per-token form
    ``sg[s_i] * exp(logp - sg[logp])`` has exactly that value and gradient), so a response is
    kept or clipped as a whole, which is what makes GSPO stable for long responses and MoE
    routing noise. The paper's clip ranges are small (3e-4 / 4e-4), because a sequence's
    geometric-mean ratio moves far less than single tokens' ratios. Aggregate with
    ``seq-mean-token-mean``, as the paper does.

    Returns:
        ``(per_token [B, T], flags)`` as ``ppo_clip`` (``ratio`` is the sequence ratio on each
        of its tokens).
    """
    high = _check_clip(eps_clip, eps_clip_high)
    log_ratio = _log_ratio(logp, old_logp, mask)
    weights = mask.to(logp.dtype)
    seq_log_ratio = (log_ratio * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.where(mask.bool(), token_log_ratio, torch.zeros_like(logp))
                      .clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    return _masked(per_token, mask), {"clipped": clipped > unclipped, "ratio": ratio.detach()}


def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_high: float,
          eps_low: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the clipped importance
    ratio, the weight under stop-gradient::

        loss = -sg(clamp(ratio, 1 - eps_low, 1 + eps_high)) * adv * logp

    Unlike PPO's clip, no token leaves the gradient: a token whose ratio left the range keeps
    its ``adv * grad logp``, only with the weight held at the edge. This is what keeps the rare
    "fork" tokens (low probability, large ratio after one update) learning. ``eps_low`` None
    is the paper's practice: no lower bound on the weight (it tuned only the upper one).

    Returns:
        ``(per_token [B, T], flags)``: ``clipped`` marks tokens whose weight was held at an
        edge (they still carry gradient), ``ratio`` the unclipped ratio (detached).
    """
    if eps_high <= 0 or (eps_low is not None and not 0 < eps_low <= 1):
        raise ValueError(f"CISPO needs eps_high > 0 and eps_low in (0, 1], got {eps_high} "
                         f"and {eps_low}")
    ratio = torch.exp(_log_ratio(logp, old_logp, mask)).detach()
    weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    per_token = -weight * adv * logp
    return _masked(per_token, mask), {"clipped": weight != ratio, "ratio": ratio}


def sapo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, tau_pos: float,
         tau_neg: float) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, arXiv:2511.20347): PPO's hard clip replaced by a smooth gate of the ratio::

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,     loss = -f(ratio) * adv

    with ``tau = tau_pos`` where ``adv > 0`` and ``tau_neg`` elsewhere. Its gradient is
    ``4 s (1 - s) * ratio * grad logp * adv`` with ``s = sigmoid(tau (ratio - 1))``: at
    ``ratio = 1`` exactly the plain policy gradient, fading smoothly (never cut) as the ratio
    moves away, faster for a larger ``tau``. A larger ``tau_neg`` damps negative updates more,
    which the paper found steadier (they spread probability over the whole vocabulary).

    Returns:
        ``(per_token [B, T], flags)``: ``clipped`` is all False (nothing is clipped),
        ``ratio`` (detached).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be positive, got {tau_pos} and {tau_neg}")
    log_ratio = _log_ratio(logp, old_logp, mask).clamp(-SAPO_LOG_RATIO_MAX, SAPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(logp.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gate * adv
    return _masked(per_token, mask), {"clipped": torch.zeros_like(mask, dtype=torch.bool),
                                      "ratio": ratio.detach()}


def gpg(logp: Tensor, old_logp: Tensor, adv: Tensor,
        mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): the plain policy gradient, no ratio and no
    clip::

        loss = -adv * logp

    Its gradient is ``-adv * grad logp`` at the current policy, whatever ``old_logp`` is, so
    it is exact on the first optimizer step of a rollout and uncorrected on later ones. GPG's
    normalisation is in the advantages and the aggregation, not here (docs/algorithms.md).

    Returns:
        ``(per_token [B, T], flags)``: ``clipped`` all False, ``ratio`` (detached, for the
        metrics only).
    """
    ratio = torch.exp(_log_ratio(logp, old_logp, mask)).detach()
    per_token = -adv * logp
    return _masked(per_token, mask), {"clipped": torch.zeros_like(mask, dtype=torch.bool),
                                      "ratio": ratio}


def _check_clip(eps_clip: float, eps_clip_high: float | None) -> float:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip <= 0 or high <= 0:
        raise ValueError(f"clip ranges must be positive, got {eps_clip} and {high}")
    return high


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    if not logp.shape == old_logp.shape == mask.shape or logp.dim() != 2:
        raise ValueError(f"expected logp, old_logp and mask of one [B, T] shape, got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    return torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp))


def _masked(per_token: Tensor, mask: Tensor) -> Tensor:
    # A select, not a product: padding's loss may be NaN (0 * -inf where a loss multiplies by
    # logp itself), and the select passes neither it nor a gradient through.
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
