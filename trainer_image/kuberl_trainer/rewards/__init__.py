"""Reward functions: ``(response, label) -> float``, chosen by the RLJob's ``reward`` section.

Built-ins return floats in ``[0, 1]`` and never raise on odd model output (a response that
cannot be parsed scores 0.0). Pure: no ray, network or I/O (import-linter enforces it).
"""

from __future__ import annotations

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rewards.custom import RewardFn, RewardLoadError, import_reward
from kuberl_trainer.rewards.math_reward import math_reward
from kuberl_trainer.rewards.text import exact_match, token_f1

BUILTINS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_match, "f1": token_f1}

__all__ = ["BUILTINS", "RewardFn", "RewardLoadError", "exact_match", "load", "math_reward",
           "token_f1"]


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
    return BUILTINS[spec.type]
