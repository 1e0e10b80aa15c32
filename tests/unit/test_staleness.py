"""mode async's per-step measures against hand-computed values."""

from __future__ import annotations

import pytest

from kuberl_trainer.staleness import Phases, behaviour_version, overlap_times, staleness_metrics


def test_reported_versions_are_read_as_update_counts() -> None:
    assert behaviour_version("7", fallback=3) == 7
    assert behaviour_version("default", fallback=3) == 0  # before any update: the base model
    assert behaviour_version(None, fallback=3) == 3  # not reported: what the loop last sent
    with pytest.raises(ValueError, match=r"'v2-final'.*integers"):
        behaviour_version("v2-final", fallback=3)


def test_one_step_off_lags_one_version_and_drops_nothing() -> None:
    got = staleness_metrics(5, ["4", "4", "4", "4"])
    assert got == {"staleness_mean": 1.0, "staleness_max": 1.0, "dropped_stale_samples": 0.0}


def test_staleness_mean_and_max_over_mixed_versions() -> None:
    # trained at version 6; samples from versions 6, 5, 3 and one unreported (sent: 5)
    got = staleness_metrics(6, ["6", "5", "3", None], fallback=5)
    assert got["staleness_mean"] == pytest.approx((0 + 1 + 3 + 1) / 4)
    assert got["staleness_max"] == 3.0


def test_a_sample_newer_than_the_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="newer than the policy"):
        staleness_metrics(2, ["3"])


def test_overlap_when_generation_is_the_longer_side() -> None:
    # training took 4 s, the next rollout 6 s (the trainers waited 2 s), the sync 1 s: a
    # 7.5 s step against max(6, 4 + 1) = 6
    got = overlap_times(Phases(train_s=4.0, generate_s=6.0), sync_s=1.0, step_s=7.5)
    assert got["time_wait_rollout_s"] == 2.0 and got["time_wait_train_s"] == 0.0
    assert got["overlap_fraction"] == pytest.approx(4.0 / 7.5)
    assert got["overlap_efficiency"] == pytest.approx(7.5 / 6.0)
    assert (got["time_train_s"], got["time_sync_s"], got["time_step_s"]) == (4.0, 1.0, 7.5)


def test_overlap_when_training_is_the_longer_side_and_on_the_last_step() -> None:
    got = overlap_times(Phases(train_s=5.0, generate_s=3.0), sync_s=1.0, step_s=6.0)
    assert got["time_wait_train_s"] == 2.0 and got["time_wait_rollout_s"] == 0.0
    assert got["overlap_efficiency"] == pytest.approx(1.0)
    last = overlap_times(Phases(train_s=5.0), sync_s=1.0, step_s=6.0)  # nothing generated
    assert last["overlap_fraction"] == 0.0 and last["time_wait_train_s"] == 5.0
