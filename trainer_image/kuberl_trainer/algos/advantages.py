"""Per-sequence advantages from scalar rewards, relative to the other samples of a prompt.

GRPO and Dr.GRPO (``grpo``) and RLOO (``rloo``). Token-level estimators (REINFORCE++, GAE) are
in ``returns``.

Shapes: B = prompts * group_size samples, laid out group by group (the group_size responses
to prompt 0 first, then prompt 1's, ...), T = tokens per (right-padded) sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo(rewards: Tensor, group_size: int, *, normalize_std: bool = True,
         eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: ``(r - mean(group)) / (std(group) + eps)``.

    Args:
        rewards: ``[B]`` one scalar per sample; groups are contiguous runs of ``group_size``.
        group_size: responses per prompt; must divide ``B``.
        normalize_std: divide by the group's standard deviation (GRPO). ``False`` only centres
            the rewards, which is Dr.GRPO: dividing by std up-weights groups that are nearly
            all right or all wrong, a bias Dr.GRPO removes.
        eps: keeps the division finite when a group's rewards are all equal (their
            advantages are then exactly 0, because the numerator is 0: see ``_grouped``).

    Returns:
        ``[B]`` float advantages, same order as ``rewards``.

    The std is the unbiased (Bessel-corrected) one, as ``torch.std`` and the GRPO reference
    implementations use. A group of one sample has no spread: its advantage is 0.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).to(_dtype_of(rewards))


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024): each sample's baseline
    is the mean reward of the *other* samples of its prompt::

        A_i = r_i - (sum(group) - r_i) / (k - 1) = k / (k - 1) * (r_i - mean(group))

    Unlike GRPO's own-group mean, the baseline does not include the sample, so it is an
    unbiased estimate. No std division.

    Args:
        rewards: ``[B]``, groups contiguous runs of ``group_size`` (see ``grpo``).
        group_size: responses per prompt, at least 2 (with one there is no "other" sample).

    Returns:
        ``[B]`` float advantages; each group sums to 0.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs at least 2 samples per prompt, got group_size "
                         f"{group_size}")
    groups = _grouped(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1).to(_dtype_of(rewards))


def to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages over the tokens that count in the loss.

    Args:
        adv: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` 1 on response tokens, 0 on prompt and padding.

    Returns:
        ``[B, T]`` with ``adv[b]`` on every masked-in token of row ``b`` and 0 elsewhere
        (zeros keep padding inert even where a caller forgets the mask downstream).
    """
    if adv.dim() != 1 or mask.dim() != 2 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"expected adv [B] and mask [B, T], got {tuple(adv.shape)} and "
                         f"{tuple(mask.shape)}")
    return adv.unsqueeze(1) * mask.to(adv.dtype)


def _dtype_of(rewards: Tensor) -> torch.dtype:
    """The advantages' dtype: the rewards', float32 for integer rewards."""
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``[B]`` -> ``[B / group_size, group_size]`` float64, after checking the layout.

    In float64 because a group of equal float32 rewards must centre to exactly 0: in float32
    the mean of 8 copies of 3.6875732 is one ulp off (2.4e-7), its std 2.5e-7, and GRPO's
    ``centred / (std + eps)`` gave each of them an advantage of +0.19, all of one sign,
    for a group that carries no signal (a reward model's scores hit this; 0/1 verifier
    rewards do not). In float64 the sum of up to 2**29 float32 values is exact, so is its
    division back to one of them: the mean of equal values is the value."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} must be >= 1 and divide the batch "
                         f"({rewards.shape[0]} rewards)")
    return rewards.to(torch.float64).view(-1, group_size)
