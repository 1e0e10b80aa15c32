"""async.runAhead's depth (loops/run_ahead.py): how far ahead of the trainers the engines may
generate, step by step, against hand-worked sequences."""

from __future__ import annotations

import pytest

from kuberl_trainer.loops.run_ahead import PATIENCE, STARVED_SHARE, RunAheadDepth


def test_adaptive_starts_one_rollout_ahead() -> None:
    ahead = RunAheadDepth(max_staleness=4)
    assert ahead.depth == 1  # one-step-off: a rollout starts under the version just before


def test_a_wait_deepens_at_once_up_to_the_bound() -> None:
    ahead = RunAheadDepth(max_staleness=3)
    starved = {"trainers_idle_s": 0.5, "train_s": 2.0, "waiting_after": 0}
    assert [ahead.observe(**starved) for _ in range(4)] == [2, 3, 3, 3]


def test_jitter_is_not_a_wait() -> None:
    ahead = RunAheadDepth(max_staleness=4)
    # idle for just under the share of the step's training: bookkeeping, not a starving buffer
    assert ahead.observe(trainers_idle_s=STARVED_SHARE * 2.0 * 0.99, train_s=2.0,
                         waiting_after=0) == 1
    assert ahead.observe(trainers_idle_s=STARVED_SHARE * 2.0 * 1.01, train_s=2.0,
                         waiting_after=0) == 2


def test_a_surplus_shallows_only_after_patience_steps_in_a_row() -> None:
    ahead = RunAheadDepth(max_staleness=4, depth=3)
    surplus = {"trainers_idle_s": 0.0, "train_s": 2.0, "waiting_after": 2}
    depths = [ahead.observe(**surplus) for _ in range(2 * PATIENCE)]
    assert depths == [3] * (PATIENCE - 1) + [2] + [2] * (PATIENCE - 1) + [1]
    # never below one rollout ahead
    assert [ahead.observe(**surplus) for _ in range(PATIENCE)][-1] == 1


def test_a_step_without_surplus_restarts_the_count() -> None:
    ahead = RunAheadDepth(max_staleness=4, depth=2)
    surplus = {"trainers_idle_s": 0.0, "train_s": 2.0, "waiting_after": 1}
    for _ in range(PATIENCE - 1):
        ahead.observe(**surplus)
    # the buffer ran dry exactly as the trainers came for it: the depth was just right
    ahead.observe(trainers_idle_s=0.0, train_s=2.0, waiting_after=0)
    assert [ahead.observe(**surplus) for _ in range(PATIENCE)][-1] == 1
    assert ahead.surplus_steps == 0


def test_a_wait_resets_the_surplus_count() -> None:
    ahead = RunAheadDepth(max_staleness=4, depth=2)
    for _ in range(PATIENCE - 1):
        ahead.observe(trainers_idle_s=0.0, train_s=2.0, waiting_after=1)
    assert ahead.observe(trainers_idle_s=1.0, train_s=2.0, waiting_after=0) == 3
    assert ahead.surplus_steps == 0


def test_bound_always_runs_to_max_staleness() -> None:
    ahead = RunAheadDepth(max_staleness=4, mode="bound")
    assert ahead.depth == 4
    assert ahead.observe(trainers_idle_s=0.0, train_s=2.0, waiting_after=3) == 4


def test_max_staleness_below_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RunAheadDepth(max_staleness=0)
