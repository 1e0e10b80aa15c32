"""Multi-turn jobs end to end: `kuberl run` with rollout.function, with environment.class and
with environment.image (the class served over HTTP by a local subprocess) on the tiny job (real
Ray, a reference engine, weight sync): every trajectory has the model's turns and the
environment's tokens the manifest asks for, and the job trains to its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.local_run import failed, kuberl_run, manifest, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SMALL = {"data": {"rolloutBatchSize": 4, "nSamplesPerPrompt": 4, "maxResponseLen": 16},
         "training": {"microBatchSize": 16}, "schedule": {"numRollouts": 2}}


@pytest.mark.parametrize("name, agent, turns, env_tokens", [
    # a function: two turns of 4 tokens at most around a 3-token note, exactly
    ("function", {"rollout": {"function": "tests.integration.agent_tasks:ask_twice",
                              "functionArgs": {"note": "=7+"}, "maxTurns": 2}},
     (2.0, 2.0), (3.0, 3.0)),
    # the built-in loop: done after two steps, one "+" between the turns, unless the budget
    # ran out (a first turn that takes all 16 tokens ends its episode there: rare for the
    # tiny model, whose answers end with EOS, but sampled, so the bounds leave room for up to
    # half the trajectories on any machine; never more than 2 turns or 1 "+")
    ("environment", {"environment": {"class": "tests.integration.agent_tasks:Checker",
                                     "args": {"mode": "strict"}},
                     "rollout": {"maxTurns": 3}},
     (1.5, 2.0), (0.5, 1.0)),
    # the same environment as a service (environment.image): `kuberl run` serves the class
    # as a local subprocess, and every reset, step and close goes over HTTP
    ("environment-service", {"environment": {"class": "tests.integration.agent_tasks:Checker",
                                             "args": {"mode": "strict"},
                                             "image": "registry.example/checker:1"},
                             "rollout": {"maxTurns": 3}},
     (1.5, 2.0), (0.5, 1.0)),
])
def test_a_multi_turn_job_trains_on_its_trajectories(
        tiny: Path, tmp_path: Path, name: str, agent: dict[str, Any],
        turns: tuple[float, float], env_tokens: tuple[float, float]) -> None:
    job = manifest(tiny, tmp_path, f"agent-{name}", **SMALL, **agent)
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 0, failed(res)
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert turns[0] <= row["turns_mean"] <= turns[1], row
        assert env_tokens[0] <= row["response_env_tokens_mean"] <= env_tokens[1], row
        assert row["response_model_tokens_mean"] > 0 and "pg_loss" in row
        if name.startswith("environment"):  # its own metric, prefixed: steps 1 and 2, mean
            # 1.5 (1.0 for an episode the budget ended after one step)
            assert 1.0 <= row["env_steps"] <= 1.5 and row["env_step_s"] >= 0
            if row["turns_mean"] == 2.0:
                assert row["env_steps"] == pytest.approx(1.5)
    if name == "environment-service":  # every episode went over HTTP, and was closed there
        log = (tmp_path / "out" / "logs" / "environment.log").read_text()
        assert "served 32 episodes (all closed)" in log, log
