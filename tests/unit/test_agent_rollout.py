"""Trajectories as the manager's responses (kuberl_trainer.rollout.agentic.AgentRollout): a
rollout function or an environment per sample and seed, groups kept consecutive, each row's
environment tokens out of the loss, and user mistakes refused naming the user's code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_api import parse
from kuberl_trainer.agents import EnvironmentFailure, RolloutContext, Trajectory, TrajectoryError
from kuberl_trainer.engines.client import GenerateResult
from kuberl_trainer.rollout.agentic import AgentRollout
from kuberl_trainer.rollout.batch import pack
from kuberl_trainer.rollout.generate import SingleTurn
from kuberl_trainer.rollout.prompts import PromptSource
from tests.integration.tiny_model import build_tokenizer

TOK = build_tokenizer()


class Engine:
    """Each turn answers "7" and EOS; records what it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], dict[str, Any]]] = []

    async def generate_one(self, input_ids: list[int], params: dict[str, Any], *,
                           url: str | None = None) -> GenerateResult:
        self.sent.append((list(input_ids), dict(params)))
        ids = [*TOK("7", add_special_tokens=False)["input_ids"], TOK.eos_token_id]
        ids = ids[:params["max_new_tokens"]]
        return GenerateResult(output_ids=ids, text="7", finish_reason="stop",
                              prompt_tokens=len(input_ids), completion_tokens=len(ids),
                              logprobs=[-0.25] * len(ids), weight_version="2",
                              engine_url=url or "http://e1")


def single(tmp_path: Path, engine: Engine) -> tuple[SingleTurn, PromptSource]:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1),
                                          "tool": f"={a}"})
                              for a in range(10, 14)))
    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"},
                           "data": {"prompts": str(data), "rolloutBatchSize": 2,
                                    "nSamplesPerPrompt": 2, "maxResponseLen": 12},
                           "reward": {"type": "exact"},
                           "training": {"backend": "fsdp", "gpusPerNode": 0},
                           "rollout": {"engine": "reference"}}}).spec
    return (SingleTurn(spec, engine, TOK, seed=5),  # type: ignore[arg-type]
            PromptSource(data, "prompt", "label", seed=0, metadata_keys=["tool"]))


async def calculator(ctx: RolloutContext, *, bonus: str) -> Trajectory:
    """A user's function: ask, read a tool's answer (out of the loss), answer."""
    traj = ctx.trajectory()
    await ctx.generate(traj)
    traj.append_env(ctx.tokenize(f"={bonus}"))
    await ctx.generate(traj)
    return traj


async def test_a_function_makes_each_response_of_each_group(tmp_path: Path) -> None:
    engine = Engine()
    turn, source = single(tmp_path, engine)
    rows = await AgentRollout(turn, name="agent:calculator", function=calculator,
                              function_args={"bonus": "5"}, max_turns=2)(
        3, source.next_batch(2), 2)
    assert len(rows) == 4 and [r.sample.index for r in rows] == [rows[0].sample.index] * 2 + \
        [rows[2].sample.index] * 2  # groups consecutive
    seeds = [params["sampling_seed"] for _, params in engine.sent[::2]]  # each first turn
    assert seeds == [turn.sampling_params(3, r.sample, k)["sampling_seed"]
                     for r, k in zip(rows, [0, 1, 0, 1], strict=True)]
    assert len(set(seeds)) == 4
    answer = TOK("7", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    tool = TOK("=5", add_special_tokens=False)["input_ids"]
    for r in rows:
        assert r.output_ids == [*answer, *tool, *answer]
        assert r.loss_mask == [1.0] * len(answer) + [0.0] * len(tool) + [1.0] * len(answer)
        assert (r.turns, r.env_tokens, r.text) == (2, len(tool), "7")
    batch = pack(rows, torch.zeros(4), TOK.pad_token_id)
    assert batch.loss_mask.sum().item() == 4 * 2 * len(answer)  # the tool's tokens: none


class Echo:
    """An environment: the reset's observation is "?", each step's is "ok"; done at step 2."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, sample: Any, **args: str) -> dict[str, Any]:
        return {"text": args["greeting"]}

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        self.steps += 1
        return {"observation": {"text": "ok"}, "reward": 1.0, "done": self.steps == 2}

    async def close(self) -> None:
        pass


async def test_an_environment_runs_in_the_built_in_loop(tmp_path: Path) -> None:
    engine = Engine()
    turn, source = single(tmp_path, engine)
    rows = await AgentRollout(turn, name="envs:Echo", environment=Echo,
                              environment_args={"greeting": "?"}, max_turns=5)(
        0, source.next_batch(2), 2)
    greeting, ok = (TOK(t, add_special_tokens=False)["input_ids"] for t in ("?", "ok"))
    answer = TOK("7", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    assert all(r.output_ids == [*greeting, *answer, *ok, *answer] and r.turns == 2
               for r in rows)
    assert sum(rows[0].loss_mask or []) == 2 * len(answer)


@pytest.mark.parametrize("returned, why", [
    (lambda ctx: "7", r"^agent:bad returned str; expected a Trajectory"),
    (lambda ctx: [ctx.trajectory(), ctx.trajectory()], "returned 2 trajectories"),
    (lambda ctx: ctx.trajectory(), "^agent:bad: the trajectory has no model token"),
])
async def test_what_a_function_returns_is_checked_naming_it(tmp_path: Path, returned: Any,
                                                            why: str) -> None:
    async def bad(ctx: RolloutContext) -> Any:
        return returned(ctx)

    turn, source = single(tmp_path, Engine())
    with pytest.raises(TrajectoryError, match=why):
        await AgentRollout(turn, name="agent:bad", function=bad)(0, source.next_batch(1), 1)


async def test_a_function_gets_at_most_max_turns(tmp_path: Path) -> None:
    turn, source = single(tmp_path, Engine())
    agent = AgentRollout(turn, name="agent:calculator", function=calculator,
                         function_args={"bonus": "5"}, max_turns=1)
    with pytest.raises(TrajectoryError, match=r"rollout\.maxTurns is 1: the trajectory has had"):
        await agent(0, source.next_batch(1), 1)


def test_a_rollout_function_must_be_async(tmp_path: Path) -> None:
    turn, _ = single(tmp_path, Engine())
    with pytest.raises(TrajectoryError, match="agent:sync: a rollout function must be `async"):
        AgentRollout(turn, name="agent:sync", function=lambda ctx: None)


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


ANSWER = [*ids("7"), TOK.eos_token_id]


async def two_agents(ctx: RolloutContext) -> list[Trajectory]:
    """Two rows of one sample: a solver, then a checker that reads the sample's tool column
    (data.metadataKeys) after the prompt; each with a reward (reward.type environment)."""
    solver = ctx.trajectory()
    await ctx.generate(solver)
    solver.reward = 0.25
    checker = ctx.trajectory()
    checker.append_env(ctx.tokenize(ctx.sample.metadata["tool"]))
    await ctx.generate(checker)
    checker.reward = 0.5
    return [solver, checker]


async def test_a_functions_rows_of_one_sample_stay_together_padded(tmp_path: Path) -> None:
    engine = Engine()
    turn, source = single(tmp_path, engine)
    samples = source.next_batch(2)
    rows = await AgentRollout(turn, name="agent:two", function=two_agents, rows=3,
                              env_reward=True)(0, samples, 2)
    assert len(rows) == 2 * 2 * 3  # samples x seeds x rows, trajectory by trajectory
    for t in range(4):
        solver, checker, filler = rows[3 * t:3 * t + 3]
        sample = samples[t // 2]
        assert solver.sample is checker.sample is filler.sample is sample
        assert (solver.output_ids, solver.loss_mask) == (ANSWER, [1.0] * len(ANSWER))
        tool = ids(sample.metadata["tool"])
        assert checker.output_ids == [*tool, *ANSWER]
        assert checker.loss_mask == [0.0] * len(tool) + [1.0] * len(ANSWER)
        assert filler.filler and filler.output_ids == [] and filler.error is None
        assert not solver.filler and not checker.filler
        # one reward for the sample: what its trajectories set, added up, on every real row
        assert solver.env_reward == checker.env_reward == 0.75
    batch = pack(rows, torch.zeros(12), TOK.pad_token_id)
    assert batch.loss_mask[2::3].sum() == 0  # the fillers: out of the loss
    assert batch.loss_mask.sum() == 4 * 2 * len(ANSWER)


@pytest.mark.parametrize("rows, env_reward, why", [
    (1, True, r"^agent:two returned 2 trajectories for one sample; rollout\.maxRowsPerSample "
              r"is 1$"),
    (2, False, r"^agent:two set Trajectory\.reward, which only reward\.type environment"),
])
async def test_rows_and_rewards_a_function_may_not_return(tmp_path: Path, rows: int,
                                                         env_reward: bool, why: str) -> None:
    turn, source = single(tmp_path, Engine())
    with pytest.raises(TrajectoryError, match=why):
        await AgentRollout(turn, name="agent:two", function=two_agents, rows=rows,
                           env_reward=env_reward)(0, source.next_batch(1), 1)


@pytest.mark.parametrize("reward, why", [
    (None, r"^agent:r: reward\.type is environment, and none of the trajectories it returned "
           r"has a reward"),
    (float("nan"), r"^agent:r: the trajectory's reward is nan; expected a finite number"),
    ("1", r"^agent:r: the trajectory's reward is '1'"),
])
async def test_an_environment_reward_a_function_must_set(tmp_path: Path, reward: Any,
                                                        why: str) -> None:
    async def r(ctx: RolloutContext) -> list[Trajectory]:
        traj = ctx.trajectory()
        await ctx.generate(traj)
        traj.reward = reward
        return [traj]

    turn, source = single(tmp_path, Engine())
    with pytest.raises(TrajectoryError, match=why):
        await AgentRollout(turn, name="agent:r", function=r, env_reward=True)(
            0, source.next_batch(1), 1)
    empty = AgentRollout(turn, name="agent:r", function=lambda_async([]), rows=2)
    with pytest.raises(TrajectoryError, match=r"returned 0 trajectories .*\(at least one\)"):
        await empty(0, source.next_batch(1), 1)


def lambda_async(value: Any) -> Any:
    async def run(ctx: RolloutContext) -> Any:
        return value
    return run


class Flaky:
    """An environment that fails where the sample's tool column says: at reset for "=10",
    at its first step for "=11" (a bug of its own: a KeyError); fine otherwise (a reward of
    1 a step, done after 2)."""

    def __init__(self) -> None:
        self.tool, self.steps = "", 0

    async def reset(self, sample: Any, **args: str) -> None:
        self.tool = sample.metadata["tool"]  # data.metadataKeys reach the reset
        if self.tool == "=10":
            raise ConnectionError("tool server down")

    async def step(self, action_ids: list[int], action_text: str) -> dict[str, Any]:
        if self.tool == "=11":
            raise KeyError("calls")
        self.steps += 1
        return {"reward": 1.0, "done": self.steps == 2, "observation": {"text": "+"}}

    async def close(self) -> None:
        pass


async def test_a_failed_episode_is_dropped_as_fillers_or_fails_the_job(tmp_path: Path) -> None:
    turn, source = single(tmp_path, Engine())
    samples = sorted(source.samples(), key=lambda s: s.index)  # tools =10, =11, =12, =13
    rows = await AgentRollout(turn, name="envs:Flaky", environment=Flaky, max_turns=4,
                              drop=True, env_reward=True)(0, samples[:3], 2)
    assert len(rows) == 6
    assert [r.error for r in rows[:4]] == [
        "envs:Flaky.reset failed: ConnectionError: tool server down"] * 2 + [
        "envs:Flaky.step failed: KeyError: 'calls'"] * 2
    assert all(r.filler and r.output_ids == [] and r.env_reward is None for r in rows[:4])
    assert [r.env_reward for r in rows[4:]] == [2.0, 2.0]  # the episode's step rewards, summed
    assert not any(r.filler or r.error for r in rows[4:])
    with pytest.raises(EnvironmentFailure, match=r"^envs:Flaky\.reset failed: ConnectionError"):
        await AgentRollout(turn, name="envs:Flaky", environment=Flaky, max_turns=4)(
            0, samples[:1], 1)  # onError: fail


async def test_a_function_drops_its_episode_only_by_raising_environment_failure(
        tmp_path: Path) -> None:
    async def tool_down(ctx: RolloutContext) -> Trajectory:
        traj = ctx.trajectory()
        await ctx.generate(traj)
        raise EnvironmentFailure("search: 503")

    async def buggy(ctx: RolloutContext) -> Trajectory:
        raise ZeroDivisionError("a bug of the function's own")

    turn, source = single(tmp_path, Engine())
    rows = await AgentRollout(turn, name="agent:tool_down", function=tool_down, rows=2,
                              drop=True)(0, source.next_batch(1), 2)
    assert [(r.filler, r.error) for r in rows] == [(True, "search: 503"), (True, None)] * 2
    with pytest.raises(ZeroDivisionError):  # never hidden as a dropped episode
        await AgentRollout(turn, name="agent:buggy", function=buggy, drop=True)(
            0, source.next_batch(1), 1)
