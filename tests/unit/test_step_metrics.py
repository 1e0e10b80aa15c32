"""A train step's metrics from its micro-batches' device scalars (both backends report
through StepMetrics; the scalars are read back once, when the step is summarised)."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.backends.step_metrics import StepMetrics, combine_ranks


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


def test_a_stat_only_some_micro_batches_report_is_their_token_mean() -> None:
    """The train-inference gap with oldLogprobs: engine is measured in the rollout's first
    optimizer step only: its mean is over the tokens that reported it, not diluted by the
    later steps' tokens; an extreme's max is a max over micro-batches, never a mean."""
    t = torch.tensor
    metrics = StepMetrics()
    for tokens, pg, gap, gap_max in ((3, 1.0, 0.2, 0.5), (1, 2.0, 0.6, 0.9)):
        metrics.add_micro(tokens=t(tokens), loss=t(0.0), stats={
            "pg_loss": t(pg), "rollout_logp_abs_diff_mean": t(gap),
            "rollout_logp_abs_diff_max": t(gap_max)})
    metrics.add_step(1.0, 1e-6)
    metrics.add_micro(tokens=t(4), loss=t(0.0), stats={"pg_loss": t(3.0)})
    metrics.add_step(1.0, 1e-6)
    out = metrics.summary()
    assert out["rollout_logp_abs_diff_mean"] == pytest.approx((0.2 * 3 + 0.6 * 1) / 4)
    assert out["rollout_logp_abs_diff_max"] == pytest.approx(0.9)
    assert out["pg_loss"] == pytest.approx((1.0 * 3 + 2.0 * 1 + 3.0 * 4) / 8)


def test_extremes_of_micro_batches_without_response_tokens_do_not_win() -> None:
    """A micro-batch of rows out of the loss reports placeholders (ratio 1, a gap of 0); the
    extremes come from the micro-batches with tokens, or the placeholder when none has any."""
    t = torch.tensor
    metrics = StepMetrics()
    metrics.add_micro(tokens=t(0), loss=t(0.0), stats={"ratio_max": t(1.0),
                                                       "rollout_seq_log_ratio_max": t(0.0)})
    metrics.add_micro(tokens=t(2), loss=t(0.0), stats={"ratio_max": t(0.9),
                                                       "rollout_seq_log_ratio_max": t(-0.3)})
    metrics.add_micro(tokens=t(0), loss=t(0.0), stats={"ratio_max": t(1.0),
                                                       "rollout_seq_log_ratio_max": t(0.0)})
    out = metrics.summary()
    assert out["ratio_max"] == pytest.approx(0.9)
    assert out["rollout_seq_log_ratio_max"] == pytest.approx(-0.3)
    empty = StepMetrics()
    empty.add_micro(tokens=t(0), loss=t(0.0), stats={"ratio_max": t(1.0)})
    assert empty.summary()["ratio_max"] == 1.0


def test_ranks_combine_token_means_by_their_tokens_and_keep_extremes() -> None:
    """Data-parallel ranks hold equal samples, not equal tokens: a token-mean over the whole
    batch weighs each rank's by its response tokens; extremes stay extremes; the loss, grad
    norm and the other per-step values are the ranks' mean."""
    ranks = [{"rollout_logp_abs_diff_mean": 0.1, "rollout_logp_abs_diff_max": 0.5,
              "ratio_min": 0.9, "grad_norm": 2.0, "response_tokens": 300.0},
             {"rollout_logp_abs_diff_mean": 0.5, "rollout_logp_abs_diff_max": 0.7,
              "ratio_min": 0.8, "grad_norm": 2.0, "response_tokens": 100.0}]
    out = combine_ranks(ranks)
    assert out["rollout_logp_abs_diff_mean"] == pytest.approx((0.1 * 300 + 0.5 * 100) / 400)
    assert out["rollout_logp_abs_diff_max"] == 0.7 and out["ratio_min"] == 0.8
    assert out["grad_norm"] == 2.0 and out["response_tokens"] == 200.0
    # no response tokens anywhere: plain means (nothing to weigh by)
    empty = [{"pg_loss": 1.0, "response_tokens": 0.0}, {"pg_loss": 3.0, "response_tokens": 0.0}]
    assert combine_ranks(empty)["pg_loss"] == 2.0
