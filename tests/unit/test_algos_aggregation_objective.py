"""Loss aggregation modes, the objective's assembly of terms, and the estimator dispatch,
against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_api.spec import DISCOUNTED_ESTIMATORS, AlgorithmSpec
from kuberl_trainer.algos import aggregation, estimators, returns
from kuberl_trainer.algos.advantages import grpo, rloo, to_tokens
from kuberl_trainer.algos.objective import Objective

# Two rows: 1 prompt token then 3 response tokens; 1 prompt token, 1 response, 2 padding.
# A third row is empty (a dropped group): it must count nowhere. Padding holds NaN.
LOSS = torch.tensor([[9.0, 1.0, 2.0, 3.0],
                     [9.0, 4.0, math.nan, math.nan],
                     [9.0, 5.0, 5.0, 5.0]])
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0],
                     [0.0, 1.0, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (1 + 2 + 3 + 4) / 4),                 # 10 / 4 tokens
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # (2 + 4) / 2 sequences = 3
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),       # (6 + 4) / 2 = 5
    ("seq-mean-token-sum-norm", (1 + 2 + 3 + 4) / (2 * 8)),  # 10 / (2 sequences * horizon 8)
])
def test_aggregation_by_hand(mode: str, expected: float) -> None:
    got = aggregation.aggregate(LOSS, MASK, mode, horizon=8)  # type: ignore[arg-type]
    assert float(got) == pytest.approx(expected)


@pytest.mark.parametrize("mode", aggregation.MODES)
def test_partial_sums_over_row_splits_equal_the_whole(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).float()
    whole = aggregation.aggregate(loss, mask, mode, horizon=5)  # type: ignore[arg-type]
    units = sum(aggregation.units(mask[i:i + 2], mode, 5) for i in range(0, 6, 2))  # type: ignore[arg-type]
    parts = sum(aggregation.partial_sum(loss[i:i + 2], mask[i:i + 2], mode)  # type: ignore[arg-type]
                for i in range(0, 6, 2))
    torch.testing.assert_close(parts / units, whole)


def test_aggregation_errors() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregation.aggregate(LOSS, MASK, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="horizon"):
        aggregation.units(MASK, "seq-mean-token-sum-norm")
    assert float(aggregation.aggregate(LOSS, torch.zeros_like(MASK), "token-mean")) == 0.0


def test_objective_assembles_tis_kl_and_entropy_by_hand() -> None:
    # One row, two response tokens, ratio 1 (logp == old), adv +1:
    #   pg per token = -1; TIS weights exp(old - rollout) = [e^-0.5, min(e^1, 2) = 2];
    #   k1 KL = logp - ref = [0.1, 0.3]; entropy [1.0, 2.0].
    #   total = w * pg + 0.5 * kl - 0.1 * H = [-e^-0.5 + 0.05 - 0.1, -2 + 0.15 - 0.2]
    #   token-mean = the average of the two.
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -0.5, -3.0]])
    ref = torch.tensor([[0.0, -1.1, -2.3]])
    entropy = torch.tensor([[0.0, 1.0, 2.0]])
    adv = mask.clone()
    obj = Objective(kl_coef=0.5, kl_type="k1", entropy_coef=0.1, tis_cap=2.0)
    partial, m = obj.partial_loss(logp, logp, adv, mask, entropy=entropy, rollout_logp=rollout,
                                  ref_logp=ref)
    t1 = -math.exp(-0.5) + 0.5 * 0.1 - 0.1 * 1.0
    t2 = -2.0 + 0.5 * 0.3 - 0.1 * 2.0
    assert float(partial) / obj.units(mask) == pytest.approx((t1 + t2) / 2)
    assert m["pg_loss"] == pytest.approx((-math.exp(-0.5) - 2.0) / 2)
    assert m["kl_ref"] == pytest.approx(0.2)
    assert m["entropy"] == pytest.approx(1.5)
    assert m["tis_truncated_fraction"] == pytest.approx(0.5)
    assert m["ratio_max"] == m["ratio_min"] == pytest.approx(1.0)


def test_objective_from_spec_moves_kl_to_the_reward() -> None:
    spec = AlgorithmSpec.model_validate({"advantageEstimator": "reinforce_plus_plus",
                                         "klPenalty": "reward", "klCoef": 0.2})
    from kuberl_api.spec import RLJobSpec

    job = RLJobSpec.model_validate({"model": {"path": "/m"}, "data": {"prompts": "/p"},
                                    "algorithm": spec.model_dump(by_alias=True)})
    obj = Objective.from_spec(job)
    assert obj.kl_coef == 0.0 and estimators.kl_in_reward(job.algorithm)
    assert obj.horizon == job.data.max_response_len


@pytest.mark.parametrize(("mode", "async_", "algorithm", "cap"), [
    ("sync", {}, {}, None),                                   # on-policy: nothing to correct
    ("async", {}, {}, 2.0),                                   # async: TIS at 2 by default
    ("async", {"offPolicyCorrection": "none"}, {}, None),     # turned off
    ("async", {}, {"tisCap": 5.0}, 5.0),                      # the user's own cap
    ("async", {}, {"importanceMask": {}}, None),              # the user's own correction
    ("sync", {}, {"tisCap": 3.0}, 3.0),                       # engine mismatch in sync mode
], ids=["sync", "async-default", "async-off", "async-own-cap", "async-own-mask", "sync-tis"])
def test_async_corrects_stale_samples_with_tis_by_default(
        mode: str, async_: dict[str, object], algorithm: dict[str, object],
        cap: float | None) -> None:
    from kuberl_api.spec import RLJobSpec

    job = RLJobSpec.model_validate({
        "model": {"path": "/m"}, "data": {"prompts": "/p"}, "placement": "disaggregated",
        "rollout": {"engine": "reference", "gpus": 0}, "mode": mode, "async": async_,
        "algorithm": algorithm})
    assert Objective.from_spec(job).tis_cap == cap


def test_objective_needs_its_inputs() -> None:
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="rollout_logp"):
        Objective(tis_cap=2.0).partial_loss(mask, mask, mask, mask, entropy=mask)
    with pytest.raises(ValueError, match="reference"):
        Objective(kl_coef=0.1).partial_loss(mask, mask, mask, mask, entropy=mask)


def test_objective_reports_the_train_inference_gap_without_any_correction() -> None:
    # No tisCap, no importanceMask: the gap between the trainer's pi_old and the engines'
    # log-probs is still reported (old - rollout = [0.5, -1.0]); the loss is the plain PPO.
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.0]])
    obj = Objective()
    partial, m = obj.partial_loss(logp, logp, mask.clone(), mask,
                                  entropy=torch.zeros_like(mask), rollout_logp=rollout)
    assert float(partial) / obj.units(mask) == pytest.approx(-1.0)  # ratio 1, adv 1
    assert m["rollout_logp_diff"] == pytest.approx(-0.25)
    assert m["rollout_logp_abs_diff_mean"] == pytest.approx(0.75)
    assert m["rollout_logp_abs_diff_max"] == pytest.approx(1.0)
    assert m["rollout_seq_log_ratio_max"] == m["rollout_seq_log_ratio_min"] == pytest.approx(
        -0.25)
    assert "tis_weight_mean" not in m and "mis_masked_fraction" not in m
    # without the engines' log-probs there is no gap to report
    _, m = obj.partial_loss(logp, logp, mask.clone(), mask, entropy=torch.zeros_like(mask))
    assert not any(k.startswith("rollout_") for k in m)


def test_objective_with_engine_old_logprobs_takes_the_ratio_against_the_engines() -> None:
    # oldLogprobs: engine: pi_old is the engines' log-probs, so the ratio is
    # exp(logp - rollout) = [e^0.5, e^-1] (clipped at 1.2 and 0.8: with adv +1 the loss is
    # -min(r, clip(r)) = [-1.2, -e^-1]); the gap is measured against the trainer's old_logp,
    # and with none given (a later optimizer step) it is left out.
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.0]])
    obj = Objective(old_logprobs="engine")
    partial, m = obj.partial_loss(logp, logp, mask.clone(), mask,
                                  entropy=torch.zeros_like(mask), rollout_logp=rollout)
    assert float(partial) / obj.units(mask) == pytest.approx((-1.2 - math.exp(-1.0)) / 2)
    assert m["ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["approx_kl"] == pytest.approx(((-1.5 + 1.0) + (-1.0 + 2.0)) / 2)
    assert m["rollout_logp_abs_diff_mean"] == pytest.approx(0.75)
    partial2, m = obj.partial_loss(logp, None, mask.clone(), mask,
                                   entropy=torch.zeros_like(mask), rollout_logp=rollout)
    assert float(partial2) == pytest.approx(float(partial))
    assert not any(k.startswith("rollout_") for k in m)
    with pytest.raises(ValueError, match="oldLogprobs: engine needs"):
        obj.partial_loss(logp, logp, mask, mask, entropy=mask)
    with pytest.raises(ValueError, match="oldLogprobs: trainer needs"):
        Objective().partial_loss(logp, None, mask, mask, entropy=mask, rollout_logp=rollout)


SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0])
TOKENS = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])


@pytest.mark.parametrize(("name", "expected"), [
    ("grpo", lambda: to_tokens(grpo(SCORES, 2), TOKENS)),
    ("dr_grpo", lambda: to_tokens(grpo(SCORES, 2, normalize_std=False), TOKENS)),
    ("rloo", lambda: to_tokens(rloo(SCORES, 2), TOKENS)),
    ("reinforce_plus_plus", lambda: returns.reinforce_plus_plus(SCORES, TOKENS, gamma=0.9)),
    ("reinforce_plus_plus_baseline",
     lambda: returns.reinforce_plus_plus_baseline(SCORES, 2, TOKENS)),
])
def test_estimators_dispatch(name: str, expected: object) -> None:
    # gamma only where it discounts (the spec refuses it elsewhere)
    gamma = {"gamma": 0.9} if name in DISCOUNTED_ESTIMATORS else {}
    algo = AlgorithmSpec.model_validate({"advantageEstimator": name, **gamma})
    got = estimators.token_advantages(algo, SCORES, 2, TOKENS)
    torch.testing.assert_close(got, expected())  # type: ignore[operator]


def test_kl_in_reward_reaches_reinforce_plus_plus() -> None:
    algo = AlgorithmSpec.model_validate({"advantageEstimator": "reinforce_plus_plus",
                                         "klPenalty": "reward", "klCoef": 0.5})
    kl = torch.full((4, 3), 0.2) * TOKENS
    got = estimators.token_advantages(algo, SCORES, 2, TOKENS, kl=kl)
    torch.testing.assert_close(got, returns.reinforce_plus_plus(SCORES, TOKENS, kl=kl,
                                                                kl_coef=0.5))
    assert not torch.allclose(got, estimators.token_advantages(
        AlgorithmSpec.model_validate({"advantageEstimator": "reinforce_plus_plus"}),
        SCORES, 2, TOKENS))
    with pytest.raises(ValueError, match="per-token KL"):
        estimators.token_advantages(algo, SCORES, 2, TOKENS)


def test_ppo_targets_are_whitened_gae_and_raw_returns() -> None:
    # Row 0: one response token (position 1), score 1, V = 0.5 -> delta = 1 - 0.5 = 0.5,
    #   A = 0.5, R = A + V = 1. Row 1: two tokens, score 0, V = [0.2, 0.4], gamma = lam = 1:
    #   delta_2 = 0 - 0.4 = -0.4, delta_1 = 0 + 0.4 - 0.2 = 0.2, A = [0.2 - 0.4, -0.4]
    #   = [-0.2, -0.4], R = [0, 0]. The advantages are then whitened over the 3 tokens.
    algo = AlgorithmSpec.model_validate({"advantageEstimator": "ppo", "gamma": 1.0,
                                         "gaeLambda": 1.0})
    mask = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.2, 0.4]])
    adv, ret = estimators.ppo_targets(algo, torch.tensor([1.0, 0.0]), mask, values)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    raw = torch.tensor([0.5, -0.2, -0.4])
    torch.testing.assert_close(adv[mask.bool()], (raw - raw.mean()) / raw.std())
    with pytest.raises(ValueError, match="ppo_targets"):
        estimators.token_advantages(algo, torch.zeros(2), 1, mask)


def test_objective_masked_importance_drops_the_policy_loss_of_tokens_outside_the_band() -> None:
    # two response tokens, advantages 1, logp = old (ratio 1, pg = -1 each); the engines'
    # log-probs put token 2's ratio old/rollout at e^1 > 2: its policy loss leaves, and the
    # token-mean still divides by both tokens (-1 + 0) / 2; with tisCap 1.5 the kept token's
    # weight e^0 = 1 stays 1
    from kuberl_api.spec import ImportanceMaskSpec

    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -1.0, -3.0]])
    for tis in (None, 1.5):
        obj = Objective(importance_mask=ImportanceMaskSpec(), tis_cap=tis)
        partial, m = obj.partial_loss(logp, logp, mask.clone(), mask,
                                      entropy=torch.zeros_like(mask), rollout_logp=rollout)
        assert float(partial) / obj.units(mask) == pytest.approx(-0.5)
        assert m["mis_masked_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="importanceMask needs"):
        Objective(importance_mask=ImportanceMaskSpec()).partial_loss(
            mask, mask, mask, mask, entropy=mask)
