"""Dynamic sampling: drop groups that carry no learning signal.

When every response to a prompt gets the same reward, its group-relative advantages are all
0, so the group only dilutes the token-mean loss. DAPO's filter keeps only groups with some
spread. It is optional: it changes the effective batch size from step to step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def nonconstant_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which groups have at least two different rewards.

    Args:
        rewards: ``[B]``, groups contiguous (``B = num_groups * group_size``).
        group_size: responses per prompt; must divide ``B``.

    Returns:
        ``BoolTensor[num_groups]``. Equality is exact: built-in rewards are exactly 0.0 or
        1.0, and a tolerance would need a scale that custom rewards do not share.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size "
                         f"{group_size}, got shape {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def expand_to_samples(keep: Tensor, group_size: int) -> Tensor:
    """``BoolTensor[num_groups]`` -> ``BoolTensor[num_groups * group_size]``, per sample."""
    return torch.repeat_interleave(keep, group_size)
