"""Trajectories as the manager's responses: a user rollout function (rollout.function), or an
environment (environment.class) in the built-in loop, run once per sample and seed
(docs/agents.md). The other side of the seam in generate.py:
called like `SingleTurn`, groups consecutive, so grading, shaping, filtering and advantages
stay the manager's."""

from __future__ import annotations

import asyncio
import inspect
import os
import statistics
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kuberl_trainer.agents import RolloutContext, Trajectory, TrajectoryError, run_episode
from kuberl_trainer.rollout.generate import Response, SingleTurn
from kuberl_trainer.rollout.prompts import Sample

RolloutFunction = Callable[..., Awaitable[Any]]

# Test-only, not an API: "1" puts the environment's tokens in the loss, the mistake the peers'
# users make, so that the tiny agent's learning test can show what masking them prevents
# (tests/integration/test_agents.py: the policy learns to produce the tool's output).
TRAIN_ENV_TOKENS = "KUBERL_TEST_TRAIN_ENV_TOKENS"


class AgentRollout:
    """`function` (async, `run(ctx, **function_args) -> Trajectory | [Trajectory]`) or
    `environment` (a class: one instance per trajectory, `environment_args` to its reset),
    not both; `name`: the import path the user gave, which every error names."""

    def __init__(self, single: SingleTurn, *, name: str,
                 function: RolloutFunction | None = None,
                 function_args: Mapping[str, str] | None = None,
                 environment: Callable[[], Any] | None = None,
                 environment_args: Mapping[str, str] | None = None,
                 max_turns: int = 1) -> None:
        if (function is None) == (environment is None):
            raise ValueError("an agent rollout takes a rollout function or an environment")
        if function is not None and not inspect.iscoroutinefunction(function):
            raise TrajectoryError(f"{name}: a rollout function must be `async def`")
        self.single, self.name, self.max_turns = single, name, max_turns
        self.function, self.function_args = function, dict(function_args or {})
        self.environment, self.environment_args = environment, dict(environment_args or {})

    async def __call__(self, step: int, samples: list[Sample], n: int, *,
                       greedy: bool = False) -> list[Response]:
        """`n` responses per sample, groups consecutive, each its own trajectory."""
        tok, cut = self.single.tokenizer, self.single.spec.data.max_prompt_len
        encoded = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
        return list(await asyncio.gather(*(
            self._one(step, sample, list(ids[-cut:]), k, greedy)
            for sample, ids in zip(samples, encoded, strict=True) for k in range(n))))

    async def _one(self, step: int, sample: Sample, prompt_ids: list[int], k: int,
                   greedy: bool) -> Response:
        params = self.single.sampling_params(step, sample, k)
        if greedy:
            params["temperature"] = 0.0
        tok = self.single.tokenizer
        ctx = RolloutContext(self.single.client, params, sample=sample, prompt_ids=prompt_ids,
                             budget=self.single.spec.data.max_response_len,
                             tokenize=lambda text: list(tok.encode(text,
                                                                   add_special_tokens=False)),
                             max_turns=self.max_turns)
        if self.function is not None:
            traj = self._one_trajectory(await self.function(ctx, **self.function_args))
        else:
            assert self.environment is not None
            traj = ctx.trajectory()
            episode = await run_episode(ctx, self.environment(), traj, sample,
                                        max_turns=self.max_turns, args=self.environment_args,
                                        name=self.name, tokenize=ctx.tokenize)
        row = Response.from_trajectory(sample, traj, traj.texts[-1] if traj.texts else "",
                                       where=self.name)
        row.engine = ctx.url or ""
        if os.environ.get(TRAIN_ENV_TOKENS) == "1":
            row.loss_mask = [1.0] * len(traj.ids)
        if self.environment is not None:
            row.env_step_s = episode.step_s
            row.env_metrics = {k: statistics.fmean(v) for k, v in episode.metrics.items() if v}
        return row

    def _one_trajectory(self, out: Any) -> Trajectory:
        trajs: list[Any] = [out] if isinstance(out, Trajectory) else out
        if not isinstance(trajs, list) or not all(isinstance(t, Trajectory) for t in trajs):
            raise TrajectoryError(f"{self.name} returned {type(out).__name__}; expected a "
                                  "Trajectory (or a list of them)")
        if len(trajs) != 1:
            raise TrajectoryError(f"{self.name} returned {len(trajs)} trajectories for one "
                                  "sample; one per sample is supported so far")
        first: Trajectory = trajs[0]
        return first


def agent_rollout(single: SingleTurn, function: RolloutFunction | None,
                  environment: Callable[[], Any] | None) -> AgentRollout | None:
    """The job's agent rollout (its user code loaded by preflight), or None: one turn per
    sample."""
    rollout, env = single.spec.rollout, single.spec.environment
    if function is not None:
        return AgentRollout(single, name=str(rollout.function), function=function,
                            function_args=rollout.function_args,
                            max_turns=rollout.max_turns)
    if environment is not None:
        return AgentRollout(single, name=str(env.class_), environment=environment,
                            environment_args=env.args, max_turns=rollout.max_turns)
    return None
