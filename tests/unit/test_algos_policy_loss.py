"""Per-token PPO clip and GSPO against hand-computed values, gradients included."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import policy_loss
from kuberl_trainer.algos.objective import Objective

# One row: a prompt token (position 0), two response tokens, one padding position.
MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0]])


def _logp(log_ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp (with grad) and old_logp whose response log-ratios are `log_ratios`."""
    old = torch.tensor([[0.0, -1.0, -2.0, -math.inf]])  # -inf in padding must not leak
    logp = old.clone()
    logp[0, 1:3] += torch.tensor(log_ratios)
    logp[0, 3] = 0.0
    return logp.requires_grad_(True), old


def test_gspo_shares_the_sequence_ratio_by_hand() -> None:
    # Token log-ratios [0.2, 0.0] -> sequence log-ratio 0.1, s = e^0.1 = 1.10517 (inside
    # [0.8, 1.2]); adv = 1 -> loss -s on both tokens; d loss / d logp_t = -adv * s.
    logp, old = _logp([0.2, 0.0])
    adv = MASK.clone()
    per_token, flags = policy_loss.gspo(logp, old, adv, MASK, 0.2)
    s = math.exp(0.1)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -s, -s, 0.0]]))
    torch.testing.assert_close(flags["ratio"][0, 1:3], torch.tensor([s, s]))
    per_token.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -s, -s, 0.0]]))
    assert not flags["clipped"][MASK.bool()].any()


def test_gspo_clips_the_whole_sequence() -> None:
    # Log-ratios [0.6, 0.2] -> s = e^0.4 = 1.4918 > 1.2. adv = +1: the clipped term -1.2 is
    # the larger, so both tokens are clipped (no gradient), although token 2's own ratio
    # (e^0.2 = 1.22) is only just outside and a token-level PPO would treat them differently.
    logp, old = _logp([0.6, 0.2])
    per_token, flags = policy_loss.gspo(logp, old, MASK.clone(), MASK, 0.2)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -1.2, -1.2, 0.0]]))
    assert flags["clipped"][0, 1:3].all()
    per_token.sum().backward()
    assert logp.grad is not None and torch.count_nonzero(logp.grad) == 0
    # adv = -1: pushing the ratio down is never clipped from above: loss +s, gradient +s.
    logp, old = _logp([0.6, 0.2])
    per_token, _ = policy_loss.gspo(logp, old, -MASK.clone(), MASK, 0.2)
    s = math.exp(0.4)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, s, s, 0.0]]))


def test_gspo_equals_ppo_for_one_token_responses() -> None:
    # With a single response token the geometric mean is that token's ratio.
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 3, generator=gen) * 0.3
    old = logp + torch.randn(6, 3, generator=gen) * 0.3
    mask = torch.zeros(6, 3)
    mask[:, 1] = 1.0
    adv = torch.randn(6, 1, generator=gen) * mask
    g, _ = policy_loss.gspo(logp, old, adv, mask, 0.2, 0.28)
    p, _ = policy_loss.ppo_clip(logp, old, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(g, p)


def test_ppo_per_token_matches_the_token_mean_loss() -> None:
    gen = torch.Generator().manual_seed(4)
    logp = torch.randn(4, 5, generator=gen) * 0.5
    old = logp + torch.randn(4, 5, generator=gen) * 0.5
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    adv = torch.randn(4, 5, generator=gen) * mask
    per_token, flags = policy_loss.ppo_clip(logp, old, adv, mask, 0.2, 0.3, clip_c=3.0)
    obj = Objective(eps_clip=0.2, eps_clip_high=0.3, clip_c=3.0)
    partial, metrics = obj.partial_loss(logp, old, adv, mask, entropy=torch.zeros_like(logp))
    mean = partial / obj.units(mask)
    torch.testing.assert_close(per_token.sum() / mask.sum(), mean)
    assert metrics["pg_clipfrac"] == pytest.approx(
        float((flags["clipped"] & mask.bool()).sum() / mask.sum()))
    assert (per_token[mask == 0] == 0).all()


@pytest.mark.parametrize("fn", [policy_loss.ppo_clip, policy_loss.gspo])
def test_shapes_and_clip_ranges_checked(fn: object) -> None:
    with pytest.raises(ValueError, match="shape"):
        fn(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3), 0.2)  # type: ignore[operator]
    with pytest.raises(ValueError, match="positive"):
        fn(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.0)  # type: ignore[operator]
