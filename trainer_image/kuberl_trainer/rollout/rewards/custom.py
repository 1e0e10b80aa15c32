"""User-supplied reward functions named ``"package.module:function"``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


class RewardLoadError(ImportError):
    """A reward function could not be loaded; the message names the import path."""


def import_reward(path: str) -> RewardFn:
    """Import ``module:function`` and return it, wrapped to return a ``float``.

    Custom rewards are not clamped to ``[0, 1]`` (their scale is the user's choice), and
    exceptions they raise propagate: a bug in user code should surface, not read as reward 0.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardLoadError(f"reward function {path!r} must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code: syntax, deps, ...
        raise RewardLoadError(f"cannot import module {module_name!r} of reward function "
                              f"{path!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardLoadError(f"reward function {path!r}: module {module_name!r} has no "
                              f"attribute {attr!r}")
    if not callable(fn):
        raise RewardLoadError(f"reward function {path!r} is not callable (got an "
                              f"object of type {type(fn).__name__})")

    def reward(response: str, label: str) -> float:
        return float(fn(response, label))

    reward.__name__ = attr
    reward.__qualname__ = path
    return reward
