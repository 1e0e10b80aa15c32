"""Whitening, discounted returns, KL-penalised rewards, REINFORCE++(-baseline) and GAE, against
hand-computed values and invariants."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from kuberl_trainer.algos import returns as R

NAN = float("nan")


def _rows(prompt_lens: list[int], response_lens: list[int], t: int) -> Tensor:
    """``[B, T]`` mask with each row's response after its prompt, right-padded to ``t``."""
    mask = torch.zeros(len(prompt_lens), t, dtype=torch.long)
    for b, (p, n) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[b, p:p + n] = 1
    return mask


def _random_batch(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rewards, values, mask) in float64, 6 rows of unequal prompt and response lengths."""
    gen = torch.Generator().manual_seed(seed)
    mask = _rows([0, 2, 3, 1, 4, 0], [5, 3, 1, 6, 0, 9], 10)
    rewards = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    return rewards, values, mask


def _masked_moments(x: Tensor, mask: Tensor) -> tuple[float, float]:
    picked = x[mask.bool()]
    return picked.mean().item(), picked.var().item()  # unbiased


# --- whiten ---------------------------------------------------------------------------------

# Masked-in: 1, 2 (row 0, after a prompt token) and 3, 6 (row 1, before padding).
#   mean = 12 / 4 = 3, deviations [-2, -1, 0, 3], squares 4 + 1 + 0 + 9 = 14,
#   unbiased var = 14 / 3 -> whitened = deviations / sqrt(14 / 3).
WX = torch.tensor([[NAN, 1.0, 2.0, float("inf")], [3.0, 6.0, NAN, 100.0]])
WMASK = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])


def test_whiten_by_hand() -> None:
    s = math.sqrt(14 / 3)
    expected = torch.tensor([[0.0, -2 / s, -1 / s, 0.0], [0.0, 3 / s, 0.0, 0.0]])
    torch.testing.assert_close(R.whiten(WX, WMASK, eps=0.0), expected)
    # The default eps = 1e-8 on a variance of 4.67 is far below float32 resolution.
    torch.testing.assert_close(R.whiten(WX, WMASK), expected)


def test_whiten_without_shift_keeps_the_mean() -> None:
    # Same deviations / std, plus the mean 3 back; padding still 0.
    s = math.sqrt(14 / 3)
    expected = torch.tensor([[0.0, 3 - 2 / s, 3 - 1 / s, 0.0], [3.0, 3 + 3 / s, 0.0, 0.0]])
    torch.testing.assert_close(R.whiten(WX, WMASK, shift_mean=False, eps=0.0), expected)


def test_whiten_invariants_mean_zero_variance_one() -> None:
    x, _, mask = _random_batch(0)
    out = R.whiten(3.0 * x + 7.0, mask, eps=0.0)
    mean, var = _masked_moments(out, mask)
    assert mean == pytest.approx(0.0, abs=1e-12) and var == pytest.approx(1.0)
    assert (out[mask == 0] == 0).all()
    kept = R.whiten(3.0 * x + 7.0, mask, shift_mean=False, eps=0.0)
    mean, var = _masked_moments(kept, mask)
    assert mean == pytest.approx(_masked_moments(3.0 * x + 7.0, mask)[0])
    assert var == pytest.approx(1.0)


def test_whiten_without_spread_is_zero_not_nan() -> None:
    one = torch.tensor([[NAN, 5.0, NAN]])
    single = torch.tensor([[0, 1, 0]])
    # One masked entry: no spread, the deviation from the mean is 0.
    assert R.whiten(one, single).tolist() == [[0.0, 0.0, 0.0]]
    assert R.whiten(one, single, eps=0.0).tolist() == [[0.0, 0.0, 0.0]]
    assert R.whiten(one, single, shift_mean=False).tolist() == [[0.0, 5.0, 0.0]]
    # All entries equal, even with eps = 0 (rsqrt(0) = inf must not meet 0 * inf).
    equal = torch.full((2, 3), 0.1)
    assert R.whiten(equal, torch.ones(2, 3), eps=0.0).abs().max().item() == 0.0
    # Empty mask.
    assert R.whiten(one, torch.zeros(1, 3)).tolist() == [[0.0, 0.0, 0.0]]


def test_whiten_promotes_integers_and_keeps_float64() -> None:
    # [0, 2]: mean 1, deviations [-1, 1], unbiased var 2 -> [-1, 1] / sqrt(2).
    out = R.whiten(torch.tensor([[0, 2]]), torch.ones(1, 2), eps=0.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0]]) / math.sqrt(2))
    assert R.whiten(torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)).dtype == \
        torch.float64
    with pytest.raises(ValueError, match="eps"):
        R.whiten(out, torch.ones(1, 2), eps=-1.0)


# --- discounted_returns ---------------------------------------------------------------------

# Row 0: 2 prompt tokens, rewards [1, 0, 2], 1 padding token.
#   gamma 0.5: [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1, 2]
# Row 1: no prompt, rewards [3, -2], then 4 padding tokens (the 5 and NaN must not flow back).
#   gamma 0.5: [3 + 0.5 * -2, -2] = [2, -2]
DR = torch.tensor([[7.0, 7.0, 1.0, 0.0, 2.0, 9.0], [3.0, -2.0, 5.0, NAN, 0.0, 0.0]])
DMASK = _rows([2, 0], [3, 2], 6)


def test_discounted_returns_by_hand() -> None:
    expected = torch.tensor([[0.0, 0.0, 1.5, 1.0, 2.0, 0.0], [2.0, -2.0, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(R.discounted_returns(DR, DMASK, 0.5), expected)


def test_discounted_returns_gamma_one_and_zero() -> None:
    # gamma 1: reward-to-go [3, 2, 2] and [1, -2]; gamma 0: the rewards themselves.
    undiscounted = torch.tensor([[0.0, 0.0, 3.0, 2.0, 2.0, 0.0], [1.0, -2.0, 0, 0, 0, 0]])
    torch.testing.assert_close(R.discounted_returns(DR, DMASK, 1.0), undiscounted)
    myopic = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0], [3.0, -2.0, 0, 0, 0, 0]])
    torch.testing.assert_close(R.discounted_returns(DR, DMASK, 0.0), myopic)


def test_discounted_returns_integer_rewards_and_bad_gamma() -> None:
    out = R.discounted_returns(torch.tensor([[1, 1]]), torch.ones(1, 2), 0.5)
    assert out.dtype == torch.float32 and out.tolist() == [[1.5, 1.0]]
    for gamma in (-0.1, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            R.discounted_returns(DR, DMASK, gamma)


# --- kl_penalised_rewards -------------------------------------------------------------------

def test_kl_penalised_rewards_by_hand() -> None:
    # kl_coef 0.1.
    # Row 0: prompt, 3 response tokens, padding. kl [0.5, -1, 2] -> [-0.05, 0.1, -0.2],
    #   score 2 on the last response token: -0.2 + 2 = 1.8.
    # Row 1: 2 response tokens, then padding: kl [1, 2] -> [-0.1, -0.2 + -1 = -1.2].
    # Row 2: response runs to the last position: kl [0, 0, 1] -> score 5 at t = 4: 4.9.
    # Row 3: no response token: all zeros, its score (NaN here) dropped.
    scores = torch.tensor([2.0, -1.0, 5.0, NAN])
    kl = torch.tensor([[9.0, 0.5, -1.0, 2.0, NAN],
                       [1.0, 2.0, NAN, NAN, NAN],
                       [9.0, 9.0, 0.0, 0.0, 1.0],
                       [NAN, NAN, NAN, NAN, NAN]])
    mask = _rows([1, 0, 2, 0], [3, 2, 3, 0], 5)
    expected = torch.tensor([[0.0, -0.05, 0.1, 1.8, 0.0],
                             [-0.1, -1.2, 0.0, 0.0, 0.0],
                             [0.0, 0.0, 0.0, 0.0, 4.9],
                             [0.0, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(R.kl_penalised_rewards(scores, kl, mask, 0.1), expected)


def test_kl_penalised_rewards_without_penalty_is_the_score_at_the_end() -> None:
    # Integer scores (a verifier's 0/1) are promoted; kl_coef 0 leaves only the scores.
    mask = _rows([1, 0], [2, 1], 4)
    out = R.kl_penalised_rewards(torch.tensor([1, 0]), torch.ones(2, 4), mask, 0.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="kl_coef"):
        R.kl_penalised_rewards(torch.ones(2), torch.ones(2, 4), mask, -0.1)


# --- REINFORCE++ ----------------------------------------------------------------------------

def test_reinforce_plus_plus_by_hand() -> None:
    # kl_coef 0.5, gamma 0.5.
    # Row 0: tokens 0-1, kl [1, 0.5], score 1: rewards [-0.5, -0.25 + 1 = 0.75],
    #   returns [-0.5 + 0.5 * 0.75, 0.75] = [-1/8, 3/4].
    # Row 1: token 1 only, kl 2, score 2: reward -1 + 2 = 1, return 1.
    # Whiten [-1/8, 3/4, 1]: mean (-3 + 18 + 24) / 24 / 3 = 13/24,
    #   deviations [-16, 5, 11] / 24, squares (256 + 25 + 121) / 576 = 402 / 576,
    #   unbiased var 201 / 576, std sqrt(201) / 24 -> advantages [-16, 5, 11] / sqrt(201).
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[1.0, 0.5, NAN], [NAN, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    adv = R.reinforce_plus_plus(scores, mask, kl=kl, kl_coef=0.5, gamma=0.5)
    s = math.sqrt(201)
    torch.testing.assert_close(adv, torch.tensor([[-16 / s, 5 / s, 0.0], [0.0, 11 / s, 0.0]]))


def test_reinforce_plus_plus_without_kl() -> None:
    # Scores [1, 0], gamma 1: returns [1, 1] (row 0, after a prompt token) and [0] (row 1).
    # mean 2/3, deviations [1/3, 1/3, -2/3], squares 6/9, unbiased var 1/3, std 1/sqrt(3)
    # -> [1/sqrt(3), 1/sqrt(3), -2/sqrt(3)].
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    adv = R.reinforce_plus_plus(torch.tensor([1.0, 0.0]), mask)
    r3 = math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1 / r3, 1 / r3], [-2 / r3, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="kl_coef"):
        R.reinforce_plus_plus(torch.ones(2), mask, kl_coef=0.1)


def test_reinforce_plus_plus_is_the_composition() -> None:
    rewards, _, mask = _random_batch(1)
    scores, kl = rewards[:, 0], rewards.abs()
    adv = R.reinforce_plus_plus(scores, mask, kl=kl, kl_coef=0.05, gamma=0.9)
    token_rewards = R.kl_penalised_rewards(scores, kl, mask, 0.05)
    torch.testing.assert_close(adv, R.whiten(R.discounted_returns(token_rewards, mask, 0.9),
                                             mask))


# --- REINFORCE++-baseline -------------------------------------------------------------------

def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # Groups of 2: [1, 0] -> centred [0.5, -0.5]; [3, 3] -> centred [0, 0].
    # No KL, gamma 1: every token's return is its row's centred score.
    # Lengths 3, 1, 2, 2 (8 tokens): returns 0.5 x3, -0.5 x1, 0 x4; mean (1.5 - 0.5) / 8 = 1/8.
    # Deviations 3/8 x3, -5/8, -1/8 x4; squares (27 + 25 + 4) / 64 = 7/8;
    # unbiased var 7/8 / 7 = 1/8, std 1 / (2 sqrt 2) -> advantages 3 sqrt2 / 4, -5 sqrt2 / 4,
    # and -sqrt2 / 4 for the group whose scores were all equal: the whitening's batch mean is
    # not 0 when lengths differ, so that group is pushed down, not left at 0.
    mask = _rows([1, 0, 2, 0], [3, 1, 2, 2], 5)
    adv = R.reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, mask)
    q = math.sqrt(2) / 4
    expected = torch.tensor([[0.0, 3 * q, 3 * q, 3 * q, 0.0],
                             [-5 * q, 0.0, 0.0, 0.0, 0.0],
                             [0.0, 0.0, -q, -q, 0.0],
                             [-q, -q, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_baseline_equal_group_is_zero_with_equal_lengths() -> None:
    # Equal lengths: each group's centred scores sum to 0 over its tokens, the batch mean is
    # 0, so the all-equal group stays exactly at 0 (and the others are +-1 / std).
    mask = _rows([0, 1, 0, 1], [2, 2, 2, 2], 3)
    adv = R.reinforce_plus_plus_baseline(torch.tensor([1, 0, 1, 1]), 2, mask)
    assert (adv[2:] == 0).all()
    # Returns 0.5 x2, -0.5 x2, 0 x4: squares 4 * 0.25 = 1, var 1/7 -> +-0.5 * sqrt(7).
    assert adv[0, 0].item() == pytest.approx(0.5 * math.sqrt(7))
    assert adv[1, 1].item() == pytest.approx(-0.5 * math.sqrt(7))


def test_reinforce_plus_plus_baseline_is_the_composition() -> None:
    # Centre the scores per group first; the KL penalty is not centred.
    rewards, _, mask = _random_batch(2)
    scores, kl = rewards[:, 0], rewards.abs()
    adv = R.reinforce_plus_plus_baseline(scores, 3, mask, kl=kl, kl_coef=0.1)
    groups = scores.view(2, 3)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    token_rewards = R.kl_penalised_rewards(centred, kl, mask, 0.1)
    torch.testing.assert_close(adv, R.whiten(R.discounted_returns(token_rewards, mask, 1.0),
                                             mask))


@pytest.mark.parametrize(("shape", "group_size"), [((6,), 4), ((2, 3), 3), ((4,), 0)])
def test_reinforce_plus_plus_baseline_rejects_bad_layout(shape: tuple[int, ...],
                                                         group_size: int) -> None:
    with pytest.raises(ValueError, match=r"group_size|scores"):
        R.reinforce_plus_plus_baseline(torch.zeros(shape), group_size, torch.ones(shape[0], 2))


# --- GAE ------------------------------------------------------------------------------------

def test_gae_by_hand() -> None:
    # gamma 0.5, lam 0.5 (gamma * lam = 0.25).
    # Row 0: prompt, 3 response tokens r [0, 0, 1], V [0.5, 0.5, 0.5], padding V 9 (unused).
    #   t3: delta = 1 + 0.5 * 0 - 0.5 = 0.5                 A = 0.5
    #   t2: delta = 0 + 0.5 * 0.5 - 0.5 = -0.25             A = -0.25 + 0.25 * 0.5 = -0.125
    #   t1: delta = -0.25                                   A = -0.25 + 0.25 * -0.125 = -0.28125
    #   returns = A + V = [0.21875, 0.375, 1.0]
    # Row 1: 2 response tokens r [1, 2], V [1, 1], then padding.
    #   t1: delta = 2 + 0 - 1 = 1                           A = 1
    #   t0: delta = 1 + 0.5 * 1 - 1 = 0.5                   A = 0.5 + 0.25 * 1 = 0.75
    #   returns = [1.75, 2.0]
    rewards = torch.tensor([[NAN, 0.0, 0.0, 1.0, NAN], [1.0, 2.0, 4.0, NAN, NAN]])
    values = torch.tensor([[NAN, 0.5, 0.5, 0.5, 9.0], [1.0, 1.0, 9.0, NAN, 9.0]])
    mask = _rows([1, 0], [3, 2], 5)
    adv, ret = R.gae(rewards, values, mask, 0.5, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.28125, -0.125, 0.5, 0.0],
                                                  [0.75, 1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.21875, 0.375, 1.0, 0.0],
                                                  [1.75, 2.0, 0.0, 0.0, 0.0]]))


def test_gae_lambda_one_is_discounted_return_minus_value() -> None:
    rewards, values, mask = _random_batch(3)
    adv, ret = R.gae(rewards, values, mask, 0.9, 1.0)
    g = R.discounted_returns(rewards, mask, 0.9)
    torch.testing.assert_close(adv, torch.where(mask.bool(), g - values, 0.0))
    torch.testing.assert_close(ret, g)


def test_gae_undiscounted_zero_values_is_reward_to_go() -> None:
    rewards, _, mask = _random_batch(4)
    adv, ret = R.gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, R.discounted_returns(rewards, mask, 1.0))
    torch.testing.assert_close(ret, adv)


def test_gae_lambda_zero_is_one_step_td_error() -> None:
    # delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 after the last response token.
    rewards, values, mask = _random_batch(5)
    adv, ret = R.gae(rewards, values, mask, 0.9, 0.0)
    on = mask.bool()
    next_on = torch.cat([on[:, 1:], torch.zeros_like(on[:, :1])], dim=1)
    next_v = torch.where(next_on, torch.cat([values[:, 1:], values[:, :1]], dim=1), 0.0)
    torch.testing.assert_close(adv, torch.where(on, rewards + 0.9 * next_v - values, 0.0))
    torch.testing.assert_close(ret, torch.where(on, adv + values, 0.0))


def test_gae_rejects_bad_coefficients() -> None:
    rewards, values, mask = _random_batch(6)
    with pytest.raises(ValueError, match="lam"):
        R.gae(rewards, values, mask, 1.0, 1.1)
    with pytest.raises(ValueError, match="gamma"):
        R.gae(rewards, values, mask, -1.0, 0.9)


# --- all functions --------------------------------------------------------------------------

Calls = dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]
CALLS: Calls = {
    "whiten": lambda r, v, m: R.whiten(r, m),
    "discounted_returns": lambda r, v, m: R.discounted_returns(r, m, 0.9),
    "kl_penalised_rewards": lambda r, v, m: R.kl_penalised_rewards(v[:, 0], r, m, 0.1),
    "reinforce_plus_plus": lambda r, v, m: R.reinforce_plus_plus(v[:, 0], m, kl=r,
                                                                 kl_coef=0.1, gamma=0.9),
    "reinforce_plus_plus_baseline": lambda r, v, m: R.reinforce_plus_plus_baseline(
        v[:, 0], 2, m, kl=r, kl_coef=0.1),
    "gae_advantages": lambda r, v, m: R.gae(r, v, m, 0.9, 0.95)[0],
    "gae_returns": lambda r, v, m: R.gae(r, v, m, 0.9, 0.95)[1],
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_padding_does_not_leak_and_inputs_are_untouched(name: str) -> None:
    rewards, values, mask = _random_batch(7)
    off = mask == 0
    off[:, 0] = False  # column 0 of values carries the scores: keep them finite
    clean = CALLS[name](rewards, values, mask)
    poisoned_r = rewards.masked_fill(off, NAN)
    poisoned_v = values.masked_fill(off, float("inf"))
    kept_r, kept_v = poisoned_r.clone(), poisoned_v.clone()
    out = CALLS[name](poisoned_r, poisoned_v, mask)
    assert torch.isfinite(out).all() and (out[mask == 0] == 0).all()
    torch.testing.assert_close(out, clean)
    torch.testing.assert_close(poisoned_r, kept_r, equal_nan=True)
    torch.testing.assert_close(poisoned_v, kept_v)


def test_shape_errors_name_the_argument() -> None:
    mask = torch.ones(2, 3)
    good, bad = torch.zeros(2, 3), torch.zeros(2, 4)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("x", lambda: R.whiten(bad, mask)),
        ("mask", lambda: R.whiten(torch.zeros(3), torch.ones(3))),
        ("token_rewards", lambda: R.discounted_returns(bad, mask, 1.0)),
        ("scores", lambda: R.kl_penalised_rewards(torch.zeros(3), good, mask, 0.1)),
        ("scores", lambda: R.kl_penalised_rewards(torch.zeros(2, 1), good, mask, 0.1)),
        ("kl", lambda: R.kl_penalised_rewards(torch.zeros(2), bad, mask, 0.1)),
        ("scores", lambda: R.reinforce_plus_plus(torch.zeros(3), mask)),
        ("kl", lambda: R.reinforce_plus_plus(torch.zeros(2), mask, kl=bad)),
        ("mask", lambda: R.reinforce_plus_plus_baseline(torch.zeros(2), 2, torch.ones(2))),
        ("kl", lambda: R.reinforce_plus_plus_baseline(torch.zeros(2), 2, mask, kl=bad)),
        ("token_rewards", lambda: R.gae(bad, good, mask, 1.0, 1.0)),
        ("values", lambda: R.gae(good, bad, mask, 1.0, 1.0)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            call()
