"""Trajectories as the manager's responses: a user rollout function (rollout.function), or an
environment (environment.class) in the built-in loop, run once per sample and seed
(docs/agents.md). The other side of the seam in generate.py:
called like `SingleTurn`, groups consecutive, so grading, shaping, filtering and advantages
stay the manager's.

Each sample and seed (a trajectory of its GRPO group) takes `rows` consecutive rows: the
trajectories its function returned, then filler rows (out of the loss) up to `rows`, so the
batch's shape is the same every step. An episode that fails with `EnvironmentFailure` under
environment.onError drop is `rows` fillers, the first carrying the error: the manager drops
its whole group (never a reward of 0)."""

from __future__ import annotations

import asyncio
import inspect
import os
import statistics
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kuberl_trainer.agents import (
    EnvironmentFailure,
    RolloutContext,
    Trajectory,
    TrajectoryError,
    run_episode,
)
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
    not both; `name`: the import path the user gave, which every error names. `rows`: the
    rows of each sample (rollout.maxRowsPerSample); `drop`: an episode that fails is dropped
    rather than failing the job (environment.onError); `env_reward`: the trajectory's reward
    is its environment's (reward.type environment), so a function must set one."""

    def __init__(self, single: SingleTurn, *, name: str,
                 function: RolloutFunction | None = None,
                 function_args: Mapping[str, str] | None = None,
                 environment: Callable[[], Any] | None = None,
                 environment_args: Mapping[str, str] | None = None,
                 max_turns: int = 1, rows: int = 1, drop: bool = False,
                 env_reward: bool = False) -> None:
        if (function is None) == (environment is None):
            raise ValueError("an agent rollout takes a rollout function or an environment")
        if function is not None and not inspect.iscoroutinefunction(function):
            raise TrajectoryError(f"{name}: a rollout function must be `async def`")
        self.single, self.name, self.max_turns = single, name, max_turns
        self.function, self.function_args = function, dict(function_args or {})
        self.environment, self.environment_args = environment, dict(environment_args or {})
        self.rows, self.drop, self.env_reward = rows, drop, env_reward

    async def __call__(self, step: int | str, samples: list[Sample], n: int, *,
                       greedy: bool = False,
                       held: Callable[[], int] | None = None) -> list[Response]:
        """`n` trajectories per sample, groups consecutive, each `rows` rows. `held`: the
        weight version the engines hold at least, now (as SingleTurn's), for each token's."""
        tok, cut = self.single.tokenizer, self.single.spec.data.max_prompt_len
        encoded = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
        out = await asyncio.gather(*(
            self._one(step, sample, list(ids[-cut:]), k, greedy, held)
            for sample, ids in zip(samples, encoded, strict=True) for k in range(n)))
        return [row for rows in out for row in rows]

    async def _one(self, step: int | str, sample: Sample, prompt_ids: list[int], k: int,
                   greedy: bool, held: Callable[[], int] | None = None) -> list[Response]:
        params = self.single.sampling_params(step, sample, k)
        if greedy:
            params["temperature"] = 0.0
        tok = self.single.tokenizer
        ctx = RolloutContext(self.single.client, params, sample=sample, prompt_ids=prompt_ids,
                             budget=self.single.spec.data.max_response_len,
                             tokenize=lambda text: list(tok.encode(text,
                                                                   add_special_tokens=False)),
                             max_turns=self.max_turns, held=held)
        try:
            rows = await (self._function(ctx) if self.function is not None
                          else self._episode(ctx, sample))
        except EnvironmentFailure as exc:
            if not self.drop:
                raise
            return [Response.filler_row(sample, tok.pad_token_id, error=str(exc) or
                                        type(exc).__name__),
                    *(Response.filler_row(sample, tok.pad_token_id)
                      for _ in range(self.rows - 1))]
        for row in rows:
            row.engine = ctx.url or ""
            if os.environ.get(TRAIN_ENV_TOKENS) == "1":
                row.loss_mask = [1.0] * len(row.output_ids)
        return rows + [Response.filler_row(sample, tok.pad_token_id)
                       for _ in range(self.rows - len(rows))]

    async def _episode(self, ctx: RolloutContext, sample: Sample) -> list[Response]:
        """The built-in loop over a new instance of the environment: one row."""
        assert self.environment is not None
        traj = ctx.trajectory()
        episode = await run_episode(ctx, self.environment(), traj, sample,
                                    max_turns=self.max_turns, args=self.environment_args,
                                    name=self.name, tokenize=ctx.tokenize)
        row = Response.from_trajectory(sample, traj, traj.texts[-1] if traj.texts else "",
                                       where=self.name)
        row.env_step_s = episode.step_s
        row.env_metrics = {k: statistics.fmean(v) for k, v in episode.metrics.items() if v}
        row.env_reward = episode.reward
        return [row]

    async def _function(self, ctx: RolloutContext) -> list[Response]:
        """The user's function's trajectories, checked, as rows; the sample's reward (what
        they set under reward.type environment, summed) on each."""
        assert self.function is not None
        trajs = self._trajectories(await self.function(ctx, **self.function_args))
        rows = [Response.from_trajectory(ctx.sample, t, t.texts[-1] if t.texts else "",
                                         where=self.name) for t in trajs]
        rewards = [t.reward for t in trajs if t.reward is not None]
        if self.env_reward and not rewards:
            raise TrajectoryError(f"{self.name}: reward.type is environment, and none of the "
                                  "trajectories it returned has a reward (set traj.reward)")
        if rewards and not self.env_reward:
            raise TrajectoryError(f"{self.name} set Trajectory.reward, which only reward.type "
                                  "environment grades with (this job grades the answer)")
        for row in rows:
            row.env_reward = float(sum(rewards)) if rewards else None
        return rows

    def _trajectories(self, out: Any) -> list[Trajectory]:
        trajs: list[Any] = [out] if isinstance(out, Trajectory) else out
        if not isinstance(trajs, list) or not all(isinstance(t, Trajectory) for t in trajs):
            raise TrajectoryError(f"{self.name} returned {type(out).__name__}; expected a "
                                  "Trajectory (or a list of them)")
        if not 1 <= len(trajs) <= self.rows:
            raise TrajectoryError(f"{self.name} returned {len(trajs)} trajectories for one "
                                  f"sample; rollout.maxRowsPerSample is {self.rows}"
                                  + (" (at least one)" if not trajs else ""))
        return trajs


def agent_rollout(single: SingleTurn, function: RolloutFunction | None,
                  environment: Callable[[], Any] | None) -> AgentRollout | None:
    """The job's agent rollout (its user code loaded by preflight), or None: one turn per
    sample."""
    spec = single.spec
    rollout, env = spec.rollout, spec.environment
    common: dict[str, Any] = {"max_turns": rollout.max_turns, "drop": env.on_error == "drop",
                              "env_reward": spec.reward.type == "environment"}
    if function is not None:
        return AgentRollout(single, name=str(rollout.function), function=function,
                            function_args=rollout.function_args,
                            rows=rollout.max_rows_per_sample, **common)
    if environment is not None:
        return AgentRollout(single, name=str(env.class_), environment=environment,
                            environment_args=env.args, **common)
    return None
