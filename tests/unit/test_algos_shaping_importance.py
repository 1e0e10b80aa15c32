"""DAPO's overlong penalty, truncated importance sampling and RLOO, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import advantages, importance, shaping


def test_overlong_penalty_by_hand() -> None:
    # max_len 10, buffer 4 -> the ramp starts after 6 tokens; factor 1:
    #   L=3 -> 0; L=6 -> 0; L=7 -> -(7-6)/4 = -0.25; L=9 -> -0.75; L=10 -> -1; L=12 -> -1.
    lengths = torch.tensor([3, 6, 7, 9, 10, 12])
    out = shaping.overlong_penalty(lengths, max_len=10, buffer=4, factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0]))
    # The factor scales it: L=8 with factor 0.5 -> -(2/4) * 0.5 = -0.25.
    half = shaping.overlong_penalty(torch.tensor([8]), max_len=10, buffer=4, factor=0.5)
    torch.testing.assert_close(half, torch.tensor([-0.25]))


@pytest.mark.parametrize(("buffer", "factor"), [(0, 1.0), (11, 1.0), (4, -1.0)])
def test_overlong_penalty_refuses_bad_settings(buffer: int, factor: float) -> None:
    with pytest.raises(ValueError, match="overlong"):
        shaping.overlong_penalty(torch.tensor([1]), max_len=10, buffer=buffer, factor=factor)


def test_rloo_by_hand() -> None:
    # Group [1, 0, 0, 1]: baselines are the others' means: [1/3, 2/3, 2/3, 1/3]
    #   -> [2/3, -2/3, -2/3, 2/3]. Group [3, 1]: [3-1, 1-3] = [2, -2].
    adv = advantages.rloo(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    torch.testing.assert_close(advantages.rloo(torch.tensor([3, 1]), 2),
                               torch.tensor([2.0, -2.0]))


def test_rloo_is_scaled_grpo_centring_and_sums_to_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(5 * 6, generator=gen, dtype=torch.float64)
    adv = advantages.rloo(rewards, 6)
    centred = advantages.grpo(rewards, 6, normalize_std=False)
    torch.testing.assert_close(adv, centred * 6 / 5)
    torch.testing.assert_close(adv.view(5, 6).sum(dim=1), torch.zeros(5, dtype=torch.float64))


def test_rloo_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        advantages.rloo(torch.tensor([1.0, 0.0]), 1)


def test_truncated_weights_by_hand() -> None:
    # Row: prompt, then 3 response tokens, then padding holding garbage (-inf).
    # old - rollout = [ln 0.5, 0, ln 3] -> weights [0.5, 1, min(3, 2) = 2].
    old = torch.tensor([[0.0, math.log(0.5), -1.0, math.log(3.0), 0.0]])
    rollout = torch.tensor([[0.0, 0.0, -1.0, 0.0, -math.inf]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    w, m = importance.truncated_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]]))
    assert m["tis_weight_mean"] == pytest.approx(3.5 / 3)
    assert m["tis_truncated_fraction"] == pytest.approx(1 / 3)
    assert set(m) == {"tis_weight_mean", "tis_truncated_fraction"}  # (the gap: gap_metrics)
    assert not w.requires_grad


def test_truncated_weights_are_one_when_engines_agree() -> None:
    logp = torch.randn(3, 7, requires_grad=True)
    mask = (torch.rand(3, 7) > 0.3).float()
    w, m = importance.truncated_weights(logp, logp.detach().clone(), mask, cap=2.0)
    torch.testing.assert_close(w, mask)
    assert m["tis_truncated_fraction"] == 0.0


def test_gap_metrics_by_hand() -> None:
    # Two responses after a prompt token; padding (and the masked-out token) hold garbage.
    # old - rollout: row 0 [0.5, -1.0], row 1 [0.0, -0.2]; a third row has no response tokens.
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -0.3, 0.0], [0.0, 7.0, 7.0, 7.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, -0.2, -0.1, -9.0],
                            [0.0, -7.0, -7.0, -7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    m = importance.gap_metrics(old, rollout, mask)
    assert m["rollout_logp_diff"] == pytest.approx((0.5 - 1.0 + 0.0 - 0.2) / 4)
    assert m["rollout_logp_abs_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.2) / 4)
    assert m["rollout_logp_abs_diff_max"] == pytest.approx(1.0)
    # per response, mean_t (old - rollout): row 0 -0.25, row 1 -0.1 (the empty row: none)
    assert m["rollout_seq_log_ratio_max"] == pytest.approx(-0.1)
    assert m["rollout_seq_log_ratio_min"] == pytest.approx(-0.25)
    assert all(v.dim() == 0 for v in m.values())


def test_gap_metrics_without_response_tokens_are_zero() -> None:
    old, rollout = torch.randn(2, 3), torch.randn(2, 3)
    for mask in (torch.zeros(2, 3), torch.zeros(0, 3)):
        rows = mask.shape[0]
        m = importance.gap_metrics(old[:rows], rollout[:rows], mask)
        assert all(float(v) == 0.0 for v in m.values()), m


def test_gap_metrics_are_zero_when_engines_agree() -> None:
    logp = torch.randn(3, 7)
    m = importance.gap_metrics(logp, logp.clone(), (torch.rand(3, 7) > 0.3).float())
    assert all(float(v) == 0.0 for v in m.values()), m


def test_truncated_weights_refuse_bad_cap() -> None:
    with pytest.raises(ValueError, match="cap"):
        importance.truncated_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0)


def test_masked_weights_by_token_by_hand() -> None:
    # ratios old/rollout: e^0 = 1 (kept), e^1 = 2.72 (above 2: dropped), e^-0.5 = 0.61 (kept),
    # e^-1 = 0.37 (below 0.5: dropped); the first column is the prompt (off the mask)
    old = torch.tensor([[0.0, -1.0, 0.0], [0.0, -1.5, -2.0]])
    rollout = torch.tensor([[5.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    w, m = importance.masked_weights(old, rollout, mask, level="token", low=0.5, high=2.0)
    assert w.tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert float(m["mis_masked_fraction"]) == pytest.approx(2 / 4)


def test_masked_weights_by_sequence_keep_or_drop_a_response_whole() -> None:
    # row 0: log-ratios 1.0 and -0.8, mean 0.1 -> e^0.1 inside [0.5, 2]: both kept although
    # the first token alone would leave the band; row 1: -0.5 and -1.0, mean -0.75 ->
    # e^-0.75 = 0.47 < 0.5: both dropped
    old = torch.tensor([[0.0, 0.0, -0.8], [0.0, -1.5, -2.0]])
    rollout = torch.tensor([[0.0, -1.0, 0.0], [0.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    w, m = importance.masked_weights(old, rollout, mask, level="sequence", low=0.5, high=2.0)
    assert w.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert float(m["mis_masked_fraction"]) == pytest.approx(0.5)
    assert math.exp(-0.75) < 0.5 < math.exp(0.1) < 2.0  # (the hand values above)


def test_masked_weights_refuse_a_band_without_one() -> None:
    x = torch.zeros(1, 2)
    for low, high in ((1.2, 2.0), (0.5, 0.9), (0.0, 2.0)):
        with pytest.raises(ValueError, match="band must hold 1"):
            importance.masked_weights(x, x, x, level="token", low=low, high=high)
