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


# CISPO, SAPO and GPG. Their rows: a prompt token, two response tokens with log-probs
# [-0.5, -2.5], and padding whose log-probs are -inf in both policies (0 * -inf is NaN there
# for a loss that multiplies by logp itself: it must not reach the loss or the gradient).
def _rows(log_ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[0.0, -0.5, -2.5, -math.inf]])
    old = logp.clone()
    old[0, 1:3] -= torch.tensor(log_ratios)
    return logp.requires_grad_(True), old


def test_cispo_clips_the_weight_but_keeps_every_token_in_the_gradient() -> None:
    # Ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065, adv +1. Upper bound 1 + 0.28, no lower one
    # (MiniMax's practice): weights sg[1.28] and sg[0.6065].
    #   loss = -w * adv * logp = [-1.28 * -0.5, -0.6065 * -2.5] = [0.64, 1.5163]
    #   d loss / d logp = -w * adv = [-1.28, -0.6065]
    # PPO would give the first token no gradient at all (ratio above 1 + eps, adv > 0).
    logp, old = _rows([0.5, -0.5])
    adv = MASK.clone()
    per_token, flags = policy_loss.cispo(logp, old, adv, MASK, eps_high=0.28)
    w2 = math.exp(-0.5)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, 0.64, w2 * 2.5, 0.0]]))
    assert flags["clipped"].tolist() == [[False, True, False, False]]
    torch.testing.assert_close(flags["ratio"][0, 1:3], torch.tensor([math.exp(0.5), w2]))
    per_token.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.28, -w2, 0.0]]))
    ppo, _ = policy_loss.ppo_clip(logp, old, adv, MASK, 0.2, 0.28)
    ppo_grad = torch.autograd.grad(ppo.sum(), logp)[0]
    assert ppo_grad[0, 1] == 0  # the token CISPO keeps


def test_cispo_lower_bound_and_negative_advantage() -> None:
    # eps_low 0.2: the second weight is held at 0.8. adv -1: loss = w * logp,
    # [1.28 * -0.5, 0.8 * -2.5] = [-0.64, -2.0]; gradient +w = [1.28, 0.8].
    logp, old = _rows([0.5, -0.5])
    per_token, flags = policy_loss.cispo(logp, old, -MASK.clone(), MASK, eps_high=0.28,
                                         eps_low=0.2)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -0.64, -2.0, 0.0]]))
    assert flags["clipped"].tolist() == [[False, True, True, False]]
    per_token.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.28, 0.8, 0.0]]))


def test_sapo_gate_by_hand() -> None:
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss = -f(r) * adv, d loss / d logp =
    # -adv * 4 s (1 - s) * r with s = sigmoid(tau (r - 1)).
    # Token 1: r = 1, adv +1, tau_pos = 1: s = 0.5, f = 2, loss -2, gradient -4 * 0.25 = -1
    #   (the plain policy gradient: on-policy SAPO is REINFORCE).
    # Token 2: r = e^0.4 = 1.49182, adv -1, tau_neg = 2: s = sigmoid(0.98365) = 0.72783,
    #   f = 0.72783 * 2 = 1.45566, loss +1.45566, gradient 4 * 0.72783 * 0.27217 * 1.49182
    #   = 1.18207 (PPO would pass the full ratio, 1.49182, through).
    logp, old = _rows([0.0, 0.4])
    adv = torch.tensor([[0.0, 1.0, -1.0, 0.0]])
    per_token, flags = policy_loss.sapo(logp, old, adv, MASK, tau_pos=1.0, tau_neg=2.0)
    r = math.exp(0.4)
    s = 1 / (1 + math.exp(-2 * (r - 1)))
    assert s == pytest.approx(0.72783, abs=1e-5)
    torch.testing.assert_close(per_token, torch.tensor([[0.0, -2.0, 2 * s, 0.0]]))
    assert not flags["clipped"].any()
    per_token.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0, 4 * s * (1 - s) * r, 0.0]]))
    assert float(logp.grad[0, 2]) == pytest.approx(1.18207, abs=1e-4)


def test_sapo_fades_but_stays_finite_far_off_policy() -> None:
    # A log-ratio of 1000 would overflow exp; the gate is flat there, so the gradient is ~0,
    # not NaN, and the token is never cut off by a hard edge.
    logp, old = _rows([1000.0, -1000.0])
    per_token, _ = policy_loss.sapo(logp, old, MASK.clone(), MASK, 1.0, 1.05)
    per_token.sum().backward()
    assert logp.grad is not None
    assert torch.isfinite(per_token).all() and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().max() < 1e-6


def test_gpg_is_the_plain_policy_gradient_whatever_the_old_policy() -> None:
    # loss = -adv * logp with adv [2, -1]: [-2 * -0.5, 1 * -2.5] = [1.0, -2.5]; gradient
    # -adv = [-2, 1]. The old log-probs change only the reported ratio.
    adv = torch.tensor([[0.0, 2.0, -1.0, 0.0]])
    for log_ratios in ([0.0, 0.0], [3.0, -3.0]):
        logp, old = _rows(log_ratios)
        per_token, flags = policy_loss.gpg(logp, old, adv, MASK)
        torch.testing.assert_close(per_token, torch.tensor([[0.0, 1.0, -2.5, 0.0]]))
        assert not flags["clipped"].any()
        torch.testing.assert_close(flags["ratio"][0, 1:3],
                                   torch.tensor([math.exp(x) for x in log_ratios]))
        per_token.sum().backward()
        assert logp.grad is not None
        torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -2.0, 1.0, 0.0]]))


def test_gpg_alpha_is_dropping_constant_groups_from_the_token_mean() -> None:
    # GPG scales the advantages by alpha = B / (B - M), M the responses of groups whose
    # rewards are all equal (their advantage is 0), so they do not dilute the mean. Two
    # groups of two equally long responses, the second group constant: alpha = 4 / 2 = 2.
    # Under token-mean that is the loss kuberl computes with dropConstantGroups (the constant
    # group's tokens out of the mask, so out of the denominator).
    gen = torch.Generator().manual_seed(5)
    logp = (torch.randn(4, 3, generator=gen) - 2).requires_grad_(True)
    mask = torch.ones(4, 3)
    adv = torch.tensor([[0.5], [-0.5], [0.0], [0.0]]).expand(4, 3)
    gpg = Objective(policy_loss="gpg")
    zero = torch.zeros_like(logp)
    paper, _ = gpg.partial_loss(logp, logp.detach(), 2.0 * adv, mask, entropy=zero)
    kept = mask.clone()
    kept[2:] = 0.0
    ours, _ = gpg.partial_loss(logp, logp.detach(), adv, kept, entropy=zero)
    torch.testing.assert_close(paper / gpg.units(mask), ours / gpg.units(kept))


@pytest.mark.parametrize(("loss", "clipfrac"), [("cispo", 0.25), ("sapo", 0.0), ("gpg", 0.0)])
def test_objective_dispatches_each_loss(loss: str, clipfrac: float) -> None:
    # One of the four response tokens has a ratio above 1.28 (cispo's default bound).
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0], [-1.0, -1.1]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    obj = Objective(policy_loss=loss)  # type: ignore[arg-type]
    partial, metrics = obj.partial_loss(logp, old, adv, mask, entropy=torch.zeros_like(logp))
    direct = {"cispo": lambda: policy_loss.cispo(logp, old, adv, mask, 0.28),
              "sapo": lambda: policy_loss.sapo(logp, old, adv, mask, 1.0, 1.05),
              "gpg": lambda: policy_loss.gpg(logp, old, adv, mask)}[loss]()[0]
    torch.testing.assert_close(partial, direct.sum())
    assert float(metrics["pg_clipfrac"]) == pytest.approx(clipfrac)
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(0.5))


def test_parameters_checked() -> None:
    z, m = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="eps_high > 0"):
        policy_loss.cispo(z, z, z, m, 0.0)
    with pytest.raises(ValueError, match="eps_low in"):
        policy_loss.cispo(z, z, z, m, 0.2, 1.5)
    with pytest.raises(ValueError, match="positive"):
        policy_loss.sapo(z, z, z, m, 1.0, 0.0)
    with pytest.raises(ValueError, match="shape"):
        policy_loss.gpg(z, torch.zeros(1, 3), z, m)


@pytest.mark.parametrize(("algorithm", "settings"), [
    ({"policyLoss": "cispo", "cispoEpsHigh": 5.0, "cispoEpsLow": 1.0},
     {"cispo_eps_high": 5.0, "cispo_eps_low": 1.0}),
    ({"policyLoss": "sapo", "sapoTauPos": 2.0, "sapoTauNeg": 3.0},
     {"sapo_tau_pos": 2.0, "sapo_tau_neg": 3.0}),
])
def test_objective_from_spec_takes_each_loss_settings(algorithm: dict[str, object],
                                                      settings: dict[str, float]) -> None:
    from kuberl_api.spec import RLJobSpec

    job = RLJobSpec.model_validate({"model": {"path": "/m"}, "data": {"prompts": "/p"},
                                    "algorithm": algorithm})
    obj = Objective.from_spec(job)
    assert obj.policy_loss == algorithm["policyLoss"]
    assert {k: getattr(obj, k) for k in settings} == settings


def test_every_policy_loss_has_a_function() -> None:
    """Every built-in one in the table; custom is the job's own (its lossFunction)."""
    from typing import get_args

    from kuberl_api.spec import PolicyLoss
    from kuberl_trainer.algos.objective import POLICY_LOSSES

    assert set(POLICY_LOSSES) | {"custom"} == set(get_args(PolicyLoss))


def test_objective_from_spec_imports_a_custom_loss_with_its_args() -> None:
    from kuberl_api.spec import RLJobSpec
    from tests import user_losses

    job = RLJobSpec.model_validate({"model": {"path": "/m"}, "data": {"prompts": "/p"},
                                    "algorithm": {"policyLoss": "custom",
                                                  "lossFunction": "tests.user_losses:ppo_clip",
                                                  "lossArgs": {"eps_high": 0.3}}})
    obj = Objective.from_spec(job)
    assert obj.custom_loss is not None and obj.custom_loss.fn is user_losses.ppo_clip
    assert obj.custom_loss.args == {"eps_high": 0.3}
    with pytest.raises(ValueError, match="policyLoss custom needs its loss function"):
        Objective(policy_loss="custom")
