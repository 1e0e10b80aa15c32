"""Environments, in process: one instance per trajectory, and the built-in loop that runs
one (generate, step, append the observation, until done, the turn limit or the budget).

An environment needs no kuberl import: `reset` and `step` may return plain dicts with the
fields of `Observation` and `StepResult`.

    class Calculator:
        async def reset(self, sample, **args): return {"text": "", "stop": ["="]}
        async def step(self, action_ids, action_text):
            return {"observation": {"text": answer(action_text)}, "reward": 0.0, "done": False}
        async def close(self): ...
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from kuberl_env.protocol import takes_seed
from kuberl_trainer.agents.context import RolloutContext
from kuberl_trainer.agents.trajectory import Trajectory


class EnvironmentFailure(RuntimeError):
    """An environment failed or answered what the protocol does not allow; the message names
    the environment and the call. Never a reward of 0: the caller fails the job or drops the
    episode's group."""


@dataclass(frozen=True)
class Observation:
    """What the environment shows the model next: token ids, or text kuberl tokenizes (ids
    win when both are given); `stop` and `stop_token_ids` end the model's next turn."""

    ids: list[int] | None = None
    text: str | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepResult:
    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, sample: Any, **args: str) -> Observation | Mapping[str, Any] | None:
        ...

    async def step(self, action_ids: list[int], action_text: str
                   ) -> StepResult | Mapping[str, Any]: ...

    async def close(self) -> None: ...


def as_observation(value: Any, where: str) -> Observation | None:
    if value is None or isinstance(value, Observation):
        return value
    if not isinstance(value, Mapping):
        raise EnvironmentFailure(f"{where} returned {type(value).__name__}; expected an "
                                "Observation or a dict of its fields")
    known = {f.name for f in fields(Observation)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise EnvironmentFailure(f"{where} returned unknown observation fields {unknown}; "
                                f"allowed: {sorted(known)}")
    return Observation(ids=None if value.get("ids") is None else [int(t) for t in value["ids"]],
                       text=value.get("text"), stop=tuple(value.get("stop", ())),
                       stop_token_ids=tuple(int(t) for t in value.get("stop_token_ids", ())))


def as_step_result(value: Any, where: str) -> StepResult:
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, Mapping):
        known = {f.name for f in fields(StepResult)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EnvironmentFailure(f"{where} returned unknown fields {unknown}; allowed: "
                                    f"{sorted(known)}")
        result = StepResult(observation=as_observation(value.get("observation"), where),
                            reward=float(value.get("reward", 0.0)),
                            done=bool(value.get("done", False)),
                            metrics={str(k): float(v)
                                     for k, v in dict(value.get("metrics", {})).items()})
    else:
        raise EnvironmentFailure(f"{where} returned {type(value).__name__}; expected a "
                                "StepResult or a dict of its fields")
    if not math.isfinite(result.reward):
        raise EnvironmentFailure(f"{where} returned a reward of {result.reward}")
    return result


@dataclass
class Episode:
    """What the built-in loop leaves besides the trajectory: each step's reward, the
    environment's metrics (each a list over steps), the seconds its steps took, and whether
    the episode ended on the environment's word (`done`) rather than a limit."""

    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    step_s: float = 0.0
    done: bool = False

    @property
    def reward(self) -> float:
        return sum(self.rewards)


async def run_episode(ctx: RolloutContext, env: Environment, traj: Trajectory, sample: Any, *,
                      max_turns: int, args: Mapping[str, str], name: str,
                      tokenize: Callable[[str], list[int]]) -> Episode:
    """The built-in loop over `env` (`name`: its import path, for errors). The reset's
    observation follows the prompt; each model turn is followed by the step's observation,
    out of the loss. An observation that does not fit what is left of the budget ends the
    episode as truncated (finish_reason "length"), never cut. A reset that takes a `seed`
    keyword gets the trajectory's (`ctx.seed`)."""
    episode = Episode()
    try:
        try:
            seed: dict[str, Any] = {"seed": ctx.seed} if takes_seed(env.reset) else {}
            obs = as_observation(await env.reset(sample, **args, **seed), f"{name}.reset")
        except EnvironmentFailure:
            raise
        except Exception as exc:
            raise EnvironmentFailure(f"{name}.reset failed: {type(exc).__name__}: {exc}") \
                from exc
        if not _append(traj, obs, tokenize):
            traj.finish_reason = "length"
            return episode
        for _ in range(max_turns):
            if traj.remaining <= 0:
                break
            turn = await ctx.generate(traj, stop=obs.stop if obs else (),
                                      stop_token_ids=obs.stop_token_ids if obs else ())
            started = time.perf_counter()
            try:
                result = as_step_result(await env.step(turn.ids, turn.text), f"{name}.step")
            except EnvironmentFailure:
                raise
            except Exception as exc:
                raise EnvironmentFailure(f"{name}.step failed: {type(exc).__name__}: {exc}") \
                    from exc
            finally:
                episode.step_s += time.perf_counter() - started
            episode.rewards.append(result.reward)
            for key, value in result.metrics.items():
                episode.metrics.setdefault(key, []).append(value)
            if result.done:
                episode.done = True
                break
            obs = result.observation
            if not _append(traj, obs, tokenize):
                traj.finish_reason = "length"
                break
        return episode
    finally:
        await env.close()


def _append(traj: Trajectory, obs: Observation | None,
            tokenize: Callable[[str], list[int]]) -> bool:
    """The observation's tokens after the trajectory; False when they do not fit."""
    if obs is None:
        return True
    ids = obs.ids if obs.ids is not None else tokenize(obs.text) if obs.text else []
    if len(ids) > traj.remaining:
        return False
    traj.append_env(ids)
    return True
