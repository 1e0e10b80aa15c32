"""How per-token losses become one number: the loss-aggregation modes.

Shapes: ``per_token`` and ``mask`` are ``[B, T]``; ``mask`` is 1 on the tokens that count.
A mode is a pair (numerator, units) so the loss of a batch split into micro-batches (and
data-parallel ranks) is the same as the loss of the whole: each micro-batch contributes
``partial_sum(...) / units(whole batch)``. Sequences with no token in the mask (dropped groups)
count nowhere.

- ``token-mean``: all token losses / all tokens; each token weighs the same (DAPO).
- ``seq-mean-token-mean``: the mean over sequences of each sequence's token mean; each
  sequence weighs the same (the original GRPO; GSPO).
- ``seq-mean-token-sum``: the mean over sequences of each sequence's token sum; long
  sequences weigh more.
- ``seq-mean-token-sum-norm``: all token losses / (sequences * horizon), a constant
  normaliser with no length bias (Dr.GRPO, Liu et al. 2025).

``horizon`` is the generation budget (``data.maxResponseLen``), the constant Dr.GRPO divides by
instead of each sequence's own length.
"""

from __future__ import annotations

from typing import get_args

from torch import Tensor

from kuberl_api.spec import LossAggregation

MODES: tuple[str, ...] = get_args(LossAggregation)


def partial_sum(per_token: Tensor, mask: Tensor, mode: LossAggregation) -> Tensor:
    """The numerator of ``mode`` over these rows (a differentiable scalar)."""
    _check(per_token, mask, mode)
    weights = mask.to(per_token.dtype)
    # where(), not x * mask: padding may hold inf/NaN and inf * 0 = NaN.
    masked = per_token.where(weights != 0, per_token.new_zeros(())) * weights
    if mode == "seq-mean-token-mean":
        lengths = weights.sum(dim=1).clamp(min=1.0)
        return (masked.sum(dim=1) / lengths).sum()
    return masked.sum()


def units(mask: Tensor, mode: LossAggregation, horizon: int | None = None) -> float:
    """The denominator of ``mode`` over these rows; sum it over micro-batches and ranks."""
    _check(mask, mask, mode)
    if mode == "token-mean":
        return float(mask.sum())
    sequences = float((mask.sum(dim=1) > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon < 1:
            raise ValueError(f"{mode} needs the generation budget as horizon (>= 1), got "
                             f"{horizon}")
        return sequences * horizon
    return sequences


def aggregate(per_token: Tensor, mask: Tensor, mode: LossAggregation,
              horizon: int | None = None) -> Tensor:
    """The loss of one whole batch. An empty mask gives 0, not NaN."""
    return partial_sum(per_token, mask, mode) / max(units(mask, mode, horizon), 1.0)


def _check(per_token: Tensor, mask: Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of "
                         f"{', '.join(MODES)}")
    if per_token.dim() != 2 or per_token.shape != mask.shape:
        raise ValueError(f"expected per_token and mask of the same [B, T] shape, got "
                         f"{tuple(per_token.shape)} and {tuple(mask.shape)}")
