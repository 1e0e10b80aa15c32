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
            advantages are then exactly 0, because the numerator is 0).

    Returns:
        ``[B]`` float advantages, same order as ``rewards``.

    The std is the unbiased (Bessel-corrected) one, as ``torch.std`` and the GRPO reference
    implementations use. A group of one sample has no spread: its advantage is 0.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


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
    return (groups - others).reshape(-1)


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


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``[B]`` -> ``[B / group_size, group_size]`` float, after checking the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} must be >= 1 and divide the batch "
                         f"({rewards.shape[0]} rewards)")
    # Integer rewards (0/1 from a verifier) would make mean/std fail or truncate.
    values = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    return values.view(-1, group_size)
