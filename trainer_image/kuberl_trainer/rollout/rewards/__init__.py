"""Reward functions: ``(response, label) -> float``, chosen by the RLJob's ``reward`` section.

Built-ins return floats in ``[0, 1]`` and never raise on odd model output (a response that
cannot be parsed scores 0.0). Pure: no ray, network or I/O (import-linter enforces it).
"""

from __future__ import annotations

from typing import Any

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.rewards.custom import RewardFn, RewardLoadError, import_reward
from kuberl_trainer.rollout.rewards.text import exact_match, token_f1

# The math reward is imported when asked for: math-verify brings sympy, half a second of every
# run's start-up on 2 cores that only a math reward needs.
TEXT: dict[str, RewardFn] = {"exact": exact_match, "f1": token_f1}

__all__ = ["TEXT", "RewardFn", "RewardLoadError", "environment_reward", "exact_match", "load",
           "math_reward", "token_f1"]


def __getattr__(name: str) -> Any:
    if name == "math_reward":
        from kuberl_trainer.rollout.rewards.math_answers import math_reward

        return math_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def environment_reward(response: str, label: str) -> float:
    """reward.type environment: the trajectory's reward comes from its environment (or its
    rollout function), never from grading its text."""
    raise RuntimeError("reward.type environment: a trajectory's reward is its environment's "
                       "(Episode.reward, or the Trajectory.reward its rollout function set), "
                       "not a grade of its text")


def load(spec: RewardSpec) -> RewardFn:
    """The reward function ``spec`` names. A custom one is imported here, at load time, so a
    bad ``module:function`` fails the job before any rollout instead of on the first reward.

    Raises:
        RewardLoadError: the custom function cannot be imported or is not callable.
    """
    if spec.type == "custom":
        if spec.function is None:  # the spec's validator forbids this; keep mypy honest
            raise RewardLoadError("reward type custom needs function: 'module:function'")
        return import_reward(spec.function)
    if spec.type == "environment":
        return environment_reward
    if spec.type == "math":
        from kuberl_trainer.rollout.rewards.math_answers import math_reward

        return math_reward
    return TEXT[spec.type]
