"""The trainer's start-up heartbeat (kuberl_trainer/report/heartbeat.py): it beats from the
start, with the phase the start-up is in, while a phase blocks; it goes silent once a phase
outlives its own limit (so a hung start-up is still caught as Stalled) and once stopped."""

from __future__ import annotations

import time

from kuberl_api.status import STARTUP_PHASES, Progress
from kuberl_trainer.report.heartbeat import PHASE_LIMITS_S, StartupHeartbeat
from kuberl_trainer.report.status import StatusReporter
from tests.unit.status_api import patch_recorder


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_start_up_phase_has_a_limit() -> None:
    # (and mode eval's Evaluating, which beats the same way: nothing else reports then)
    assert set(PHASE_LIMITS_S) == {*STARTUP_PHASES, "Evaluating"}


def test_beats_while_a_phase_is_within_its_limit_then_goes_silent() -> None:
    sent: list[str] = []
    clock = FakeClock()
    beat = StartupHeartbeat(sent.append, interval_s=3600, limits={"Loading": 100.0},
                            clock=clock)
    try:
        beat.enter("Loading")
        assert sent == ["Loading"]          # at once, on entering the phase
        clock.now += 99
        assert beat.beat() and sent == ["Loading"] * 2
        clock.now += 2                      # past the phase's limit: a hang goes silent
        assert not beat.beat() and len(sent) == 2
        beat.enter("FirstStep")             # a new phase has its own limit (unknown: one beat)
        assert sent[-1] == "FirstStep"
    finally:
        beat.stop()
    assert not beat.beat()                  # stopped: the steps report from now on


def test_the_thread_beats_while_the_caller_blocks_and_survives_errors() -> None:
    sent: list[str] = []
    calls = 0

    def send(phase: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("the API server is away")
        sent.append(phase)

    beat = StartupHeartbeat(send, interval_s=0.05, limits={"EnginesStarting": 60.0})
    beat.enter("EnginesStarting")
    time.sleep(0.5)                         # a phase that blocks: the thread beats on
    beat.stop()
    assert len(sent) >= 4 and set(sent) == {"EnginesStarting"}
    n = len(sent)
    time.sleep(0.2)
    assert len(sent) == n                   # nothing after stop


def test_reporter_beat_patches_only_the_time_and_the_phase() -> None:
    with patch_recorder() as (url, seen):
        StatusReporter(url, "tok", "team-a", "job").beat("Placing", total_steps=100)
    (body,) = seen
    progress = body["status"]["progress"]
    # the step (and reward) an earlier attempt reported stay as they were
    assert set(progress) == {"lastHeartbeatTime", "trainerPhase", "totalSteps"}
    parsed = Progress.model_validate(progress)
    assert parsed.trainer_phase == "Placing" and parsed.total_steps == 100
