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
from kuberl_trainer.agents import RolloutContext, Trajectory, TrajectoryError
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
    data.write_text("\n".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)})
                              for a in range(10, 14)))
    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"},
                           "data": {"prompts": str(data), "rolloutBatchSize": 2,
                                    "nSamplesPerPrompt": 2, "maxResponseLen": 12},
                           "reward": {"type": "exact"},
                           "training": {"backend": "fsdp", "gpusPerNode": 0},
                           "rollout": {"engine": "reference"}}}).spec
    return (SingleTurn(spec, engine, TOK, seed=5),  # type: ignore[arg-type]
            PromptSource(data, "prompt", "label", seed=0))


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
