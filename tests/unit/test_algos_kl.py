"""KL estimators k1/k2/k3/low_var_kl against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import kl

LN2 = math.log(2)  # 0.693147...

# logp = 0 everywhere; ref - logp = r = [ln2, -ln2, 0] (reference twice / half as likely).
LOGP = torch.zeros(1, 3, dtype=torch.float64)
REF = torch.tensor([[LN2, -LN2, 0.0]], dtype=torch.float64)


def test_k1_is_log_ratio() -> None:
    # logp - ref = [-ln2, ln2, 0]
    expected = torch.tensor([[-LN2, LN2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl.estimate(LOGP, REF, "k1"), expected)


def test_k2_is_half_square() -> None:
    # 0.5 * ln2^2 = 0.5 * 0.480453 = 0.240227 (both signs)
    half_sq = 0.5 * LN2**2
    expected = torch.tensor([[half_sq, half_sq, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl.estimate(LOGP, REF, "k2"), expected)


def test_k3_by_hand() -> None:
    # r = ln2:  e^r - r - 1 = 2 - 0.693147 - 1 = 0.306853
    # r = -ln2: 0.5 + 0.693147 - 1 = 0.193147
    expected = torch.tensor([[1 - LN2, LN2 - 0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl.estimate(LOGP, REF, "k3"), expected)
    torch.testing.assert_close(kl.estimate(LOGP, REF, "low_var_kl"), expected)


def test_k3_nonnegative_and_accurate_near_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 64, generator=gen) * 3
    ref = torch.randn(4, 64, generator=gen) * 3
    assert (kl.estimate(logp, ref, "k3") >= 0).all()
    # r = 1e-4 in float32: k3 ~ r^2 / 2 = 5e-9; exp(r) - 1 - r would cancel to ~1e-8 noise.
    tiny = kl.estimate(torch.zeros(1, 1), torch.full((1, 1), 1e-4), "k3")
    torch.testing.assert_close(tiny, torch.full((1, 1), 5e-9), rtol=1e-3, atol=0)


def test_low_var_kl_clamps_output() -> None:
    # r = 3:  e^3 - 3 - 1 = 16.0855 -> clamped to 10; k3 keeps 16.0855.
    # r = -5: e^-5 + 5 - 1 = 4.006738 -> below 10, unchanged.
    # r = -30: log-ratio clamped to -20 first: e^-20 + 20 - 1 = 19.0 -> clamped to 10.
    logp = torch.zeros(1, 3, dtype=torch.float64)
    ref = torch.tensor([[3.0, -5.0, -30.0]], dtype=torch.float64)
    expected = torch.tensor([[10.0, math.exp(-5) + 4, 10.0]], dtype=torch.float64)
    torch.testing.assert_close(kl.estimate(logp, ref, "low_var_kl"), expected)
    torch.testing.assert_close(kl.estimate(logp, ref, "k3")[0, 0],
                               torch.tensor(math.exp(3) - 4, dtype=torch.float64))


def test_low_var_kl_log_ratio_clamp_keeps_gradients_finite() -> None:
    # r = 1000: exp overflows to inf. Unclamped, the output clamp gives 10 but its zero
    # gradient times d(exp)/dr = inf is NaN; clamping r to 20 first keeps it 0.
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[1000.0, 0.5]])
    out = kl.estimate(logp, ref, "low_var_kl")
    out.sum().backward()
    assert logp.grad is not None
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()
    assert out[0, 0].item() == 10.0 and logp.grad[0, 0].item() == 0.0
    # d/dlogp (e^r - r - 1) with r = ref - logp is -(e^r - 1) = -(e^0.5 - 1) = -0.648721.
    assert logp.grad[0, 1].item() == pytest.approx(-(math.exp(0.5) - 1), rel=1e-5)
    assert torch.isinf(kl.estimate(torch.zeros(1, 1), torch.full((1, 1), 1000.0), "k3")).all()


def test_rejects_unknown_kind_and_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="k4"):
        kl.estimate(LOGP, REF, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same shape"):
        kl.estimate(LOGP, REF[:, :2], "k1")


def test_kinds_match_the_api() -> None:
    assert kl.KINDS == ("k1", "k2", "k3", "low_var_kl")
