"""Critic (value-function) loss with PPO's value clipping, and explained variance.

Shapes: ``B`` sequences of ``T`` positions (right-padded), ``mask`` ``[B, T]`` 1 on response
tokens. The loss is returned per token, not reduced: the caller aggregates it (token-mean,
sequence-mean, ...) the same way as the policy loss. Padding may hold NaN or inf (a critic
head's output on pad tokens, a never-written target): it is replaced with ``torch.where``,
never multiplied by 0, so it can leak into neither the loss nor the gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kuberl_trainer.algos.returns import check_token_shapes


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token ``0.5 * (V - R)^2``, optionally with PPO's value clipping.

    With ``clip``, the new value is also taken no further than ``clip`` from the value the
    rollout was scored with, and the larger (pessimistic) of the two errors is kept::

        V_clipped = old_values + clamp(values - old_values, -clip, clip)
        loss      = max(0.5 * (V - R)^2, 0.5 * (V_clipped - R)^2)

    so a value that has already moved more than ``clip`` away from ``old_values`` and whose
    clipped error is the larger gets no gradient: the critic cannot move far from the
    rollout's values in one update, as the policy cannot under the PPO ratio clip. Note
    ``clip`` is in the units of the returns (unlike the policy's ratio clip): with unwhitened
    returns of scale ~1 a clip of 0.2 is typical, with larger rewards it must grow.

    Args:
        values: ``[B, T]`` the critic's current estimates (differentiable).
        old_values: ``[B, T]`` the estimates at rollout time (no gradient).
        returns: ``[B, T]`` targets, e.g. ``returns.gae(...)[1]`` (no gradient).
        mask: ``[B, T]`` 1 on response tokens.
        clip: ``> 0`` to clip, ``None`` for the plain squared error.

    Returns:
        ``(loss, metrics)``: ``loss`` is ``[B, T]`` float, 0 off the mask; ``metrics`` has
        ``vf_clipfrac``, the fraction of response tokens where the clipped error was strictly
        the larger (0.0 without ``clip`` or with an empty mask), a 0-d tensor on the
        inputs' device.
    """
    check_token_shapes(mask, values=values, old_values=old_values, returns=returns)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    on = mask.bool()
    v = torch.where(on, _float(values), 0.0)
    target = torch.where(on, _float(returns), 0.0)
    loss = 0.5 * (v - target).square()
    clipfrac = torch.zeros((), device=loss.device)
    if clip is not None:
        old = torch.where(on, _float(old_values), 0.0)
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped_loss = 0.5 * (v_clipped - target).square()
        # where(), not maximum(): on a tie (inside the clip range, where both terms are the
        # same function of V) the whole gradient goes to one term rather than half to each.
        larger = on & (clipped_loss > loss)
        loss = torch.where(larger, clipped_loss, loss)
        clipfrac = larger.sum() / on.sum().clamp(min=1)
    return torch.where(on, loss, 0.0), {"vf_clipfrac": clipfrac}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over the response tokens of the batch (a diagnostic).

    1 is a perfect critic, 0 one no better than predicting the batch mean, negative one
    worse than that. The population variance is used for both; the ratio is the same with
    the unbiased one.

    When ``Var[R]`` is 0 (all returns equal, one response token, or none) the ratio is
    undefined and this returns ``nan``, as stable-baselines3 does: 0.0 would read as "the
    critic explains nothing" and 1.0 as "perfect", both made up. Whoever logs it should
    expect ``nan`` on such a batch (``json.dumps`` writes it as the non-standard ``NaN``).
    Equality is tested exactly (max == min), not ``var == 0``, because the float variance
    of equal entries can come out a rounding error above 0 and make the ratio huge.

    Args:
        values: ``[B, T]`` critic estimates.
        returns: ``[B, T]`` targets.
        mask: ``[B, T]`` 1 on response tokens.
    """
    check_token_shapes(mask, values=values, returns=returns)
    on = mask.bool()
    with torch.no_grad():
        target = returns.detach()[on].double()
        if target.numel() == 0 or bool(target.max() == target.min()):
            return math.nan
        residual = target - values.detach()[on].double()
        return 1.0 - (residual.var(correction=0) / target.var(correction=0)).item()


def _float(x: Tensor) -> Tensor:
    """float32, or float64 if it already is (ints, bools, bf16 and fp16 are promoted)."""
    return x if x.dtype == torch.float64 else x.float()


