"""A train step's metrics from its micro-batches' device scalars (both backends report
through StepMetrics; the scalars are read back once, when the step is summarised)."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.backends.step_metrics import StepMetrics


def test_micro_batch_reports_become_token_weighted_step_metrics() -> None:
    """Token-weighted stats, extremes kept as extremes, SFT NLL per SFT token, the loss summed
    over micro-batches and averaged over optimizer steps."""
    t = torch.tensor
    metrics = StepMetrics()
    metrics.add_micro(tokens=t(3), loss=t(0.25), stats={"pg_loss": t(1.0), "ratio_max": t(1.5)})
    metrics.add_micro(tokens=t(1), loss=t(0.5), stats={"pg_loss": t(2.0), "ratio_max": t(1.2)})
    metrics.add_micro(tokens=t(4), loss=t(0.125), sft_nll=t(6.0))
    metrics.add_step(0.5, 1e-6)
    out = metrics.summary()
    assert out["pg_loss"] == pytest.approx((1.0 * 3 + 2.0 * 1) / 4)
    assert out["ratio_max"] == 1.5
    assert out["sft_nll"] == pytest.approx(6.0 / 4)
    assert out["loss"] == pytest.approx(0.875)
    assert out["response_tokens"] == 4.0
    assert out["grad_norm"] == 0.5 and out["lr"] == 1e-6 and out["optimizer_steps"] == 1.0


def test_two_optimizer_steps_average_their_losses_and_grad_norms() -> None:
    t = torch.tensor
    metrics = StepMetrics()
    for loss, norm, lr in ((0.4, 1.0, 1e-6), (0.2, 3.0, 2e-6)):
        metrics.add_micro(tokens=t(2.0), loss=t(loss), stats={"ratio_min": t(norm / 4)})
        metrics.add_step(norm, lr)
    out = metrics.summary()
    assert out["loss"] == pytest.approx(0.3) and out["grad_norm"] == 2.0
    assert out["lr"] == 2e-6 and out["ratio_min"] == 0.25 and out["response_tokens"] == 4.0
    assert "sft_nll" not in out


def test_a_step_without_micro_batches_reports_zeros() -> None:
    out = StepMetrics().summary()
    assert out["loss"] == 0.0 and out["response_tokens"] == 0.0
    assert out["optimizer_steps"] == 0.0
