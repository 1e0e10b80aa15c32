"""mode async's per-step measures against hand-computed values."""

from __future__ import annotations

import pytest

from kuberl_trainer.loops.staleness import behaviour_version, overlap_times, staleness_metrics


def test_reported_versions_are_read_as_update_counts() -> None:
    assert behaviour_version("7", fallback=3) == 7
    assert behaviour_version("default", fallback=3) == 0  # before any update: the base model
    assert behaviour_version(None, fallback=3) == 3  # not reported
    with pytest.raises(ValueError, match=r"'v2-final'.*integers"):
        behaviour_version("v2-final", fallback=3)


def test_one_step_off_lags_one_version_and_drops_nothing() -> None:
    got = staleness_metrics(5, [("4", "4")] * 4, submitted=4, max_staleness=1)
    assert got == {"staleness_mean": 1.0, "staleness_max": 1.0,
                   "partial_rollout_fraction": 0.0, "dropped_stale_samples": 0.0}


def test_staleness_counts_each_rows_oldest_token() -> None:
    # submitted under version 3, trained at 6. Rows as (oldest token's, newest reported):
    # one spanned updates to 5 (a partial rollout: its oldest tokens are 3's), one whose every
    # token is 4's (a second turn sent after the update to 4), one of 3 only, one unreported
    # (taken as the submitted version). Lags 3, 2, 3, 3.
    got = staleness_metrics(6, [("3", "5"), ("4", "4"), ("3", "3"), (None, None)],
                            submitted=3, max_staleness=3)
    assert got["staleness_max"] == 3.0
    assert got["staleness_mean"] == pytest.approx((3 + 2 + 3 + 3) / 4)
    assert got["partial_rollout_fraction"] == pytest.approx(1 / 4)
    # a trajectory whose first turn was 3's and second 4's spans an update too
    assert staleness_metrics(4, [("3", "4"), ("4", "4")], submitted=3)[
        "partial_rollout_fraction"] == 0.5


def test_versions_that_cannot_be_are_errors() -> None:
    with pytest.raises(ValueError, match="newer than the policy"):
        staleness_metrics(2, [("2", "3")], submitted=2)
    with pytest.raises(ValueError, match="did not land"):
        staleness_metrics(5, [("2", "3")], submitted=3)
    # one token past the bound, however new the rest of its row: the loop broke its rule
    with pytest.raises(ValueError, match=r"version 1, 3 versions behind.*maxStaleness 2"):
        staleness_metrics(4, [("3", "4"), ("1", "4")], submitted=1, max_staleness=2)


def test_overlap_when_generation_is_the_longer_side() -> None:
    # training took 4 s beside 6 s of generating (the trainers then waited 2 s for the next
    # rollout: counted in the next step), the sync 1 s: a 7 s step against max(6, 4 + 1) = 6
    got = overlap_times(train_s=4.0, sync_s=1.0, step_s=7.0, trainers_idle_s=2.0,
                        engines_idle_s=1.0, generating_s=6.0)
    assert (got["time_wait_rollout_s"], got["time_wait_train_s"]) == (2.0, 1.0)
    assert got["overlap_fraction"] == pytest.approx(4.0 / 7.0)
    assert got["overlap_efficiency"] == pytest.approx(7.0 / 6.0)
    assert (got["time_train_s"], got["time_sync_s"], got["time_step_s"]) == (4.0, 1.0, 7.0)


def test_overlap_of_a_step_with_nothing_generated_beside_it() -> None:
    got = overlap_times(train_s=5.0, sync_s=1.0, step_s=6.0, trainers_idle_s=0.0,
                        engines_idle_s=6.0, generating_s=0.0)
    assert got["overlap_fraction"] == 0.0 and got["overlap_efficiency"] == pytest.approx(1.0)
