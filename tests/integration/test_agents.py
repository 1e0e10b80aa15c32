"""Multi-turn jobs end to end: `kuberl run` with rollout.function, with environment.class and
with environment.image (the class served over HTTP by a local subprocess) on the tiny job (real
Ray, a reference engine, weight sync): every trajectory has the model's turns and the
environment's tokens the manifest asks for, and the job trains to its end. The function returns
two rows per sample and sets their reward (reward.type environment) from a metadata column; the
in-process environment drops the groups of its failed episodes (onError drop) and rewards by
its steps. Then the tiny agent's learning arms."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration import learning
from tests.integration.local_run import failed, kuberl_run, manifest, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SMALL = {"data": {"rolloutBatchSize": 4, "nSamplesPerPrompt": 4, "maxResponseLen": 16},
         "training": {"microBatchSize": 16}, "schedule": {"numRollouts": 2}}


@pytest.mark.parametrize("name, agent, turns, env_tokens", [
    # a function: two rows a sample, each two turns of 4 tokens at most around a 3-token
    # note, exactly
    ("function", {"rollout": {"function": "tests.integration.agent_tasks:two_rows",
                              "functionArgs": {"note": "=7+"}, "maxTurns": 2,
                              "maxRowsPerSample": 2},
                  "reward": {"type": "environment"}, "data": {"metadataKeys": ["label"]}},
     (2.0, 2.0), (3.0, 3.0)),
    # the built-in loop: done after two steps, one "+" between the turns, unless the budget
    # ran out (a first turn that takes all 16 tokens ends its episode there: rare for the
    # tiny model, whose answers end with EOS, but sampled, so the bounds leave room for up to
    # half the trajectories on any machine; never more than 2 turns or 1 "+")
    ("environment", {"environment": {"class": "tests.integration.agent_tasks:FlakyChecker",
                                     "args": {"mode": "strict"}, "onError": "drop"},
                     "rollout": {"maxTurns": 3}, "reward": {"type": "environment"}},
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
    job = manifest(tiny, tmp_path, f"agent-{name}",
                   **{**SMALL, **agent, "data": {**SMALL["data"], **agent.get("data", {})}})
    res = kuberl_run(job, tmp_path / "out")
    assert res.returncode == 0, failed(res)
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert turns[0] <= row["turns_mean"] <= turns[1], row
        assert env_tokens[0] <= row["response_env_tokens_mean"] <= env_tokens[1], row
        assert row["response_model_tokens_mean"] > 0 and "pg_loss" in row
        if name == "function":  # one reward a sample (0 or 1), its two rows trained together
            assert row["rows_mean"] == 2.0 and row["env_errors"] == 0
            assert 0.0 <= row["reward_mean"] <= 1.0
        if name.startswith("environment"):  # its own metric, prefixed: steps 1 and 2, mean
            # 1.5 (1.0 for an episode the budget ended after one step)
            assert 1.0 <= row["env_steps"] <= 1.5 and row["env_step_s"] >= 0
            if row["turns_mean"] == 2.0:
                assert row["env_steps"] == pytest.approx(1.5)
        if name == "environment":
            # 2 of the step's 16 episodes fail: their groups (1 or 2 of 4) leave the step,
            # and the reward (a step's 1, summed) of the episodes that finished is 1 or 2,
            # never a failed one's 0
            assert row["env_errors"] == 2 and row["kept_group_fraction"] in (0.5, 0.75)
            assert 1.0 <= row["reward_mean"] <= 2.0
    if name == "environment-service":  # every episode went over HTTP, and was closed there
        log = (tmp_path / "out" / "logs" / "environment.log").read_text()
        assert "served 32 episodes (all closed)" in log, log


def test_an_async_multi_turn_job_bounds_every_token_and_resumes_to_the_same_turns(
        tiny: Path, tmp_path: Path) -> None:
    """Mode async, one-step-off with partial rollouts, a two-turn rollout function whose tool
    takes a second between the turns: each step's update lands between its trajectories'
    turns, so a trajectory's first turn is of the weights it was submitted under and its
    second of the next. Every token's version is recorded; a row's staleness is its oldest
    token's (the bound holds per token) and the rows count as partial rollouts. A run resumed
    from the checkpoint after step 2 sends the same seeds for the same samples, and a turn
    sampled under the same weights in both runs (step 3's first turns: version 2, restored
    exactly) is the same turn, token for token, with the same log-probs."""
    def run(name: str, out: Path) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
        record = tmp_path / f"{name}.jsonl"
        spec = {**SMALL, "placement": "disaggregated", "mode": "async",
                "async": {"maxStaleness": 1, "partialRollout": True},
                "schedule": {"numRollouts": 4, "saveInterval": 2},
                "rollout": {"gpus": 0, "function": "tests.integration.agent_tasks:"
                            "ask_twice_recorded", "maxTurns": 2,
                            "functionArgs": {"note": "=7+", "record": str(record),
                                             "pause": "1"}}}
        res = kuberl_run(manifest(tiny, tmp_path, "async-agent", **spec), out)
        assert res.returncode == 0, failed(res)
        trajs = [json.loads(line) for line in record.read_text().splitlines()]
        return metrics(out), {t["seed"]: t for t in trajs}

    whole, trajs = run("whole", tmp_path / "a")
    resumed_out = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_2",
                    resumed_out / "checkpoints" / "step_2")
    resumed, again = run("resumed", resumed_out)
    assert [r["step"] for r in whole] == [0, 1, 2, 3] and [r["step"] for r in resumed] == [2, 3]
    for t in [*trajs.values(), *again.values()]:  # each token's version, oldest first
        model = [int(v) for v, m in zip(t["versions"], t["trainable"], strict=True) if m]
        assert model == sorted(model) and len(t["turn_versions"]) == 2, t
    # Each step k after the first: submitted under k-1, trained at k. The rows' first turns
    # are k-1's, their second k's (the update came between): staleness 1, counted from the
    # oldest token, never more (the bound, per token), and the rows spanned an update.
    assert [r["staleness_max"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["dropped_stale_samples"] == 0 for r in whole + resumed)
    assert all(r["partial_rollout_fraction"] > 0 for r in whole[1:]), whole
    spans = [t for t in trajs.values() if len({v for v in t["versions"] if v}) == 2]
    assert spans, "no trajectory's turns were sampled under two versions"
    # resumed: the first rollout under the restored weights (2: fresher than the bound)
    assert resumed[0]["staleness_max"] == 0.0 and resumed[1]["staleness_max"] == 1.0
    assert [r["prompts_sha"] for r in resumed] == [r["prompts_sha"] for r in whole[2:]]
    assert set(again) <= set(trajs) and len(again) == 2 * 16  # the same seeds, 2 steps

    def first_turn(t: dict[str, Any]) -> tuple[list[int], list[float]]:
        n = t["trainable"].index(False)  # (the note follows the first turn)
        return t["ids"][:n], t["logprobs"][:n]

    same = [seed for seed, t in again.items()  # both first turns exactly of version 2
            if t["turn_versions"][0] == trajs[seed]["turn_versions"][0] == "2"
            and set(t["versions"][:t["trainable"].index(False)]) == {"2"}
            and set(trajs[seed]["versions"][:trajs[seed]["trainable"].index(False)]) == {"2"}]
    assert len(same) >= 8, same  # step 3's (the resumed run's step 2 had other seeds)
    for seed in same:
        ids, logprobs = first_turn(again[seed])
        assert ids == first_turn(trajs[seed])[0], seed
        assert logprobs == pytest.approx(first_turn(trajs[seed])[1], rel=1e-4, abs=1e-5)


@pytest.fixture(scope="session")
def tiny_tool() -> Path:
    """The tiny agent's build (`tiny build --variant tool`), cached per machine."""
    return learning.tiny_for("tool")


@pytest.mark.parametrize("arm", learning.TOOL_ARMS)
def test_the_tiny_agent_learns_to_call_a_truthful_calculator_only(
        tiny_tool: Path, tmp_path: Path, arm: str) -> None:
    """examples/tiny-agent.yaml, three arms on the same seeds: with a truthful calculator the
    policy learns to call it and its expected reward climbs; with a lying one it learns
    nothing from calling; with the environment's tokens trained (a test-only switch) it learns
    to write the calculator's results itself, which the loss mask prevents in the other arms
    (the thresholds: tests/integration/learning.py, from the sweep in bench/RESULTS.md)."""
    scenario = learning.TOOL_ARMS[arm]
    outcome = scenario.run(tiny_tool, tmp_path)
    assert [r["step"] for r in outcome.rows] == list(range(scenario.steps))
    calls = [r["env_calls"] for r in outcome.rows if "env_calls" in r]
    assert calls and all(0.0 <= c <= 1.0 for c in calls), calls  # at most one call counted
    assert all(1.0 <= r["turns_mean"] <= 2.0 for r in outcome.rows if "turns_mean" in r)
    assert not scenario.failures(outcome), scenario.failures(outcome)
