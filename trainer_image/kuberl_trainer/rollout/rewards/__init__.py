"""Reward functions: ``(response, label) -> float``, chosen by the RLJob's ``reward`` section,
the user's own (custom.py: one sample or, with reward.batch, the step's samples; plain or
async), the scorers that call them (scorer.py), the reward service's contract
(protocol.py; its HTTP client is rollout/reward_client.py) and a served reward model's requests
and answers (model_io.py: the same client's codec).

Built-ins return floats in ``[0, 1]`` and never raise on odd model output (a response that
cannot be parsed scores 0.0). Pure: no ray, network or I/O (import-linter enforces it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.rewards.custom import RewardFn, RewardLoadError, import_reward
from kuberl_trainer.rollout.rewards.scorer import RewardError, RewardInput
from kuberl_trainer.rollout.rewards.text import exact_match, token_f1

# The math reward is imported when asked for: math-verify brings sympy, half a second of every
# run's start-up on 2 cores that only a math reward needs.
TEXT: dict[str, RewardFn] = {"exact": exact_match, "f1": token_f1}

__all__ = ["TEXT", "RewardError", "RewardFn", "RewardInput", "RewardLoadError", "exact_match",
           "load", "math_reward", "token_f1"]


def __getattr__(name: str) -> Any:
    if name == "math_reward":
        from kuberl_trainer.rollout.rewards.math_answers import math_reward

        return math_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(spec: RewardSpec) -> Callable[..., Any] | None:
    """The reward function ``spec`` names (None: reward.type remote, model or environment,
    which call none). A custom one is imported here, at load time, so a bad ``module:function``
    (or one of the other form than reward.batch says) fails the job before any rollout
    instead of on the first reward.

    Raises:
        RewardLoadError: the custom function cannot be imported, is not callable or does not
            take its form's arguments.
    """
    if spec.type == "custom":
        if spec.function is None:  # the spec's validator forbids this; keep mypy honest
            raise RewardLoadError("reward type custom needs function: 'module:function'")
        return import_reward(spec.function, batch=spec.batch)
    if spec.type in ("environment", "remote", "model"):
        return None
    if spec.type == "math":
        from kuberl_trainer.rollout.rewards.math_answers import math_reward

        return math_reward
    return TEXT[spec.type]
