"""The built-in environment loop (kuberl_trainer.agents.run_episode): observations out of the
loss, the turn limit and the budget, plain-dict answers, and failures that are never a
reward of 0."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl_trainer.agents import (
    EnvironmentFailure,
    Observation,
    RolloutContext,
    StepResult,
    Trajectory,
    run_episode,
)
from tests.unit.test_agents_trajectory import Engine


class Calculator:
    """Answers each action with its result's digits as ids; done after `turns` steps."""

    def __init__(self, turns: int = 2, plain: bool = False, fail_at: int | None = None,
                 observation: list[int] | None = None) -> None:
        self.turns, self.plain, self.fail_at = turns, plain, fail_at
        self.observation = observation or [50, 51]
        self.steps, self.closed, self.reset_with = 0, False, None  # type: int, bool, Any

    async def reset(self, sample: Any, **args: str) -> Any:
        self.reset_with = (sample, args)
        obs = {"ids": [20], "stop": ["="]}
        return obs if self.plain else Observation(ids=[20], stop=("=",))

    async def step(self, action_ids: list[int], action_text: str) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            raise ConnectionError("the calculator's backend is down")
        done = self.steps >= self.turns
        out = {"observation": {"ids": self.observation}, "reward": 0.5, "done": done,
               "metrics": {"calls": 1.0}}
        return out if self.plain else StepResult(Observation(ids=self.observation), 0.5, done,
                                                 {"calls": 1.0})

    async def close(self) -> None:
        self.closed = True


async def episode(env: Calculator, *, budget: int = 20, max_turns: int = 5,
                  turns: list[list[int]] | None = None) -> tuple[Trajectory, Any, Engine]:
    engine = Engine(turns or [[7, 8]] * 5)
    ctx = RolloutContext(engine, {"max_new_tokens": 99})  # type: ignore[arg-type]
    traj = Trajectory(prompt_ids=[1, 2], budget=budget)
    result = await run_episode(ctx, env, traj, "sample", max_turns=max_turns,  # type: ignore[arg-type]
                               args={"level": "1"}, name="calc:Calculator",
                               tokenize=lambda text: [ord(c) for c in text])
    return traj, result, engine


@pytest.mark.parametrize("plain", [False, True])
async def test_turns_alternate_with_observations_out_of_the_loss(plain: bool) -> None:
    env = Calculator(turns=2, plain=plain)
    traj, result, engine = await episode(env)
    # reset's observation after the prompt, then model, step's observation, model (done)
    assert traj.ids == [20, 7, 8, 50, 51, 7, 8]
    assert traj.loss_mask() == [0, 1, 1, 0, 0, 1, 1]
    assert engine.requests[1][0] == [1, 2, 20, 7, 8, 50, 51]  # the whole trajectory
    assert engine.requests[0][1]["stop"] == ["="]  # the observation's stop words
    assert result.rewards == [0.5, 0.5] and result.reward == 1.0 and result.done
    assert result.metrics == {"calls": [1.0, 1.0]}
    assert env.closed and env.reset_with == ("sample", {"level": "1"})
    traj.check("calc:Calculator")


async def test_the_turn_limit_ends_an_episode_the_environment_did_not() -> None:
    traj, result, _ = await episode(Calculator(turns=9), max_turns=3)
    assert traj.turns == 3 and not result.done and len(result.rewards) == 3


async def test_an_observation_that_does_not_fit_ends_the_episode_uncut() -> None:
    env = Calculator(turns=9, observation=[50] * 8)
    traj, result, engine = await episode(env, budget=12)
    # 1 (reset) + 2 (model) + 8 (observation) = 11; the second turn gets the 1 token left;
    # the second observation (8) does not fit: the episode ends there, nothing cut
    assert traj.ids == [20, 7, 8, *[50] * 8, 7]
    assert [r[1]["max_new_tokens"] for r in engine.requests] == [11, 1]
    assert traj.finish_reason == "length" and len(result.rewards) == 2 and env.closed


async def test_a_failing_environment_is_an_error_naming_it_never_a_reward() -> None:
    env = Calculator(turns=9, fail_at=2)
    with pytest.raises(EnvironmentFailure, match=r"^calc:Calculator.step failed: "
                                                 r"ConnectionError: the calculator's"):
        await episode(env)
    assert env.closed  # (its resources go back even so)


@pytest.mark.parametrize("answer, why", [
    ({"observation": {"txt": "5"}}, r"unknown observation fields \['txt'\]"),
    ({"reward": 1.0, "finished": True}, r"unknown fields \['finished'\]"),
    ({"reward": float("nan")}, "a reward of nan"),
    (3.0, "returned float; expected a StepResult"),
])
async def test_answers_outside_the_protocol_are_refused(answer: Any, why: str) -> None:
    class Odd(Calculator):
        async def step(self, action_ids: list[int], action_text: str) -> Any:
            return answer

    with pytest.raises(EnvironmentFailure, match=why):
        await episode(Odd())
