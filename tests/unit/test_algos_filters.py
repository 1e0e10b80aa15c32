"""The dynamic-sampling filter: keep groups whose rewards are not all equal."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.algos import filters


def test_nonconstant_groups_by_hand() -> None:
    # Groups of 3: all right, mixed, all wrong, all 0.5 -> only the mixed group has signal.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    keep = filters.nonconstant_groups(rewards, 3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, False, False]
    assert filters.expand_to_samples(keep, 3).tolist() == [False] * 3 + [True] * 3 + [False] * 6


def test_a_single_different_reward_counts() -> None:
    # Exact comparison: a tiny spread still yields nonzero GRPO advantages, so it is kept.
    assert filters.nonconstant_groups(torch.tensor([0.25, 0.25, 0.2500001]), 3).tolist() == [True]
    assert filters.nonconstant_groups(torch.tensor([7.0]), 1).tolist() == [False]


def test_rejects_bad_layout() -> None:
    with pytest.raises(ValueError, match="group_size"):
        filters.nonconstant_groups(torch.zeros(5), 2)
