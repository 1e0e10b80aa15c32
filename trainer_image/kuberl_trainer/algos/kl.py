"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of sampled tokens.

Schulman's estimators (http://joschu.net/blog/kl-approx.html), with tokens sampled from the
current policy pi and ``r = log pi_ref(x) - log pi(x)``:

- ``k1 = -r = logp - ref_logp``: unbiased, high variance, can be negative per token;
- ``k2 = r**2 / 2``: biased, low variance, >= 0;
- ``k3 = exp(r) - r - 1``: unbiased, low variance, >= 0 (since e^r >= 1 + r);
- ``low_var_kl``: k3 made safe for training: ``r`` is clamped to ``[-20, 20]`` before ``exp``
  (so one token whose probabilities diverge cannot overflow to inf), and the result is clamped
  to ``[-10, 10]`` (so one such token cannot dominate the batch's KL gradient). Only the upper
  clamp can bite, since k3 >= 0; it bounds each token at 10 nats.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from kuberl_api.spec import KlType

KINDS: tuple[str, ...] = get_args(KlType)
LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


def estimate(logp: Tensor, ref_logp: Tensor, kind: KlType) -> Tensor:
    """Per-token KL estimate.

    Args:
        logp: ``[B, T]`` log pi(token) under the policy being trained.
        ref_logp: ``[B, T]`` log pi_ref(token) under the frozen reference.
        kind: ``"k1" | "k2" | "k3" | "low_var_kl"`` (see the module docstring).

    Returns:
        ``[B, T]`` estimates; padding is not masked here (``aggregation`` does).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} "
                         "must have the same shape")
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        return _k3(ref_logp - logp)
    if kind == "low_var_kl":
        log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return _k3(log_ratio).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KINDS)}")


def _k3(log_ratio: Tensor) -> Tensor:
    """``exp(r) - r - 1`` for ``r = ref_logp - logp``.

    Written as ``expm1(r) - r``: for the small ``r`` typical of a policy near its reference,
    ``exp(r) - 1`` would lose most significant digits to cancellation.
    """
    return torch.expm1(log_ratio) - log_ratio
