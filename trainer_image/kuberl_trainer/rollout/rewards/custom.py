"""User-supplied reward functions named ``"package.module:function"``."""

from __future__ import annotations

from collections.abc import Callable

from kuberl_trainer.user_code import UserCodeError, import_object

RewardFn = Callable[[str, str], float]


class RewardLoadError(ImportError):
    """A reward function could not be loaded; the message names the import path."""


def import_reward(path: str) -> RewardFn:
    """Import ``module:function`` and return it, wrapped to return a ``float``.

    Custom rewards are not clamped to ``[0, 1]`` (their scale is the user's choice), and
    exceptions they raise propagate: a bug in user code should surface, not read as reward 0.
    """
    try:
        fn = import_object(path, "reward function")
    except UserCodeError as exc:
        raise RewardLoadError(str(exc)) from exc

    def reward(response: str, label: str) -> float:
        return float(fn(response, label))

    _, _, attr = path.partition(":")
    # (its answer extractor, for maj@k: rewards/answers.py)
    if callable(answer := getattr(fn, "answer", None)):
        reward.answer = answer  # type: ignore[attr-defined]
    reward.__name__ = attr
    reward.__qualname__ = path
    return reward
