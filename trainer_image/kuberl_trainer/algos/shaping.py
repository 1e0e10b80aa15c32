"""Reward shaping applied to scores before advantages: DAPO's overlong penalty."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each response's
    reward: nothing up to ``max_len - buffer`` tokens, then a linear ramp down to ``-factor``
    at ``max_len`` (and beyond, i.e. truncated)::

        0                                        L <= max_len - buffer
        (max_len - buffer - L) / buffer * factor  max_len - buffer < L <= max_len
        -factor                                  L > max_len

    A response cut at the budget then gets a reward that says "too long" rather than the
    verifier's verdict on half an answer, and the ramp warns before the cliff.

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_len: the generation budget (``data.maxResponseLen``).
        buffer: the ramp's length in tokens, ``1 <= buffer <= max_len``.
        factor: the penalty at the budget, >= 0.

    Returns:
        ``[B]`` float penalties (<= 0).
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"the overlong buffer must be in [1, max_len={max_len}], got {buffer}")
    if factor < 0:
        raise ValueError(f"the overlong penalty factor must be >= 0, got {factor}")
    start = max_len - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0, max=float(buffer))
    return -over / buffer * factor
