"""GRPO / Dr.GRPO advantages and their broadcast to tokens, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import advantages


def test_grpo_by_hand() -> None:
    # Group 0 = [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25];
    #   unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5].
    # Group 1 = [2, 2, 2, 2]: deviations all 0 -> 0 / (0 + eps) = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = advantages.grpo(rewards, 4, eps=1e-12)  # ~exact division, still 0 / eps = 0
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("group_size", [8, 5, 16])
def test_a_group_of_equal_scores_has_no_advantage_whatever_the_value(group_size: int) -> None:
    """A reward model's score repeated over a group (the same answer 8 times): exactly 0,
    not the float32 mean's rounding divided by a std of the same size (+0.19 each)."""
    value = torch.tensor(3.687573194503784, dtype=torch.float32)
    other = torch.tensor([1.0, 0.0] + [0.5] * (group_size - 2))
    rewards = torch.cat([value.repeat(group_size), other])
    grpo = advantages.grpo(rewards, group_size)
    assert grpo.dtype == torch.float32
    assert grpo[:group_size].tolist() == [0.0] * group_size
    assert grpo[group_size:].abs().max() > 0.5  # (the other group keeps its spread)
    assert advantages.grpo(rewards, group_size, normalize_std=False)[:group_size].tolist() == (
        [0.0] * group_size)
    assert advantages.rloo(rewards, group_size)[:group_size].tolist() == [0.0] * group_size


def test_grpo_pair_by_hand() -> None:
    # [3, 1]: mean 2, deviations [1, -1], unbiased std = sqrt((1 + 1) / 1) = sqrt(2).
    adv = advantages.grpo(torch.tensor([3.0, 1.0]), 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))


def test_default_eps_barely_shrinks() -> None:
    # Deviation 0.75, std 0.5 -> divided by 0.500001 instead: 0.75 / 0.500001 = 1.499997.
    adv = advantages.grpo(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    torch.testing.assert_close(adv[0], torch.tensor(0.75 / 0.500001))


def test_dr_grpo_only_centres() -> None:
    # Same groups as above, no division: [0.75, -0.25, -0.25, -0.25] and zeros.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = advantages.grpo(rewards, 4, normalize_std=False)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)


def test_invariants_zero_mean_unit_std_per_group() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=gen, dtype=torch.float64)
    groups = advantages.grpo(rewards, 8).view(6, 8)
    torch.testing.assert_close(groups.mean(dim=1), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(groups.std(dim=1), torch.ones(6, dtype=torch.float64),
                               atol=1e-4, rtol=0)
    dr = advantages.grpo(rewards, 8, normalize_std=False).view(6, 8)
    torch.testing.assert_close(dr.mean(dim=1), torch.zeros(6, dtype=torch.float64))


def test_groups_are_contiguous_not_strided() -> None:
    # [1, 0 | 5, 5]: only the first pair has spread. A strided layout would pair (1, 5).
    adv = advantages.grpo(torch.tensor([1.0, 0.0, 5.0, 5.0]), 2, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_integer_rewards_and_group_of_one() -> None:
    # Ints (0/1 from a verifier) are promoted to float; a group of one has advantage 0.
    adv = advantages.grpo(torch.tensor([1, 0]), 2, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))
    torch.testing.assert_close(advantages.grpo(torch.tensor([3.0, 7.0]), 1), torch.zeros(2))


@pytest.mark.parametrize(("shape", "group_size"), [((6,), 4), ((2, 3), 3), ((4,), 0)])
def test_grpo_rejects_bad_layout(shape: tuple[int, ...], group_size: int) -> None:
    with pytest.raises(ValueError, match=r"group_size|1-D"):
        advantages.grpo(torch.zeros(shape), group_size)


def test_to_tokens_respects_mask() -> None:
    # Row 0: prompt token then 2 response tokens; row 1: 2 response tokens then padding.
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    expected = torch.tensor([[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]])
    torch.testing.assert_close(advantages.to_tokens(adv, mask), expected)


def test_to_tokens_rejects_mismatch() -> None:
    with pytest.raises(ValueError, match="adv"):
        advantages.to_tokens(torch.zeros(3), torch.ones(2, 4))
