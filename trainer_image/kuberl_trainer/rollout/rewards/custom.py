"""User-supplied reward functions named ``"package.module:function"`` (reward.type custom).

Two forms, told apart by the job's spec (reward.batch), never by guessing from the function:
a function of one sample, ``fn(response, label) -> float``, or with reward.batch a function of
the step's samples, ``fn(samples: list[RewardInput]) -> list[float]``; either may be
``async def``. At load time the function must take the arguments its form passes, so that
a function of the other form fails the job before any rollout, naming reward.batch.

Custom rewards are not clamped to ``[0, 1]`` (their scale is the user's choice), and
exceptions they raise fail the job (rewards/scorer.py): a bug in user code should surface,
not read as reward 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kuberl_trainer.user_code import UserCodeError, import_object

RewardFn = Callable[[str, str], float]


class RewardLoadError(ImportError):
    """A reward function could not be loaded; the message names the import path."""


def import_reward(path: str, *, batch: bool = False) -> Callable[..., Any]:
    """Import ``module:function`` and check that it takes its form's arguments."""
    try:
        fn: Callable[..., Any] = import_object(path, "reward function")
    except UserCodeError as exc:
        raise RewardLoadError(str(exc)) from exc
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin without one: its call will tell)
        return fn
    args: tuple[None, ...] = (None,) if batch else (None, None)
    try:
        signature.bind(*args)
    except TypeError:
        form = ("fn(samples) with reward.batch: true" if batch
                else "fn(response, label) (a function of the step's samples needs "
                "reward.batch: true)")
        raise RewardLoadError(f"reward function {path!r} takes {_shown(fn, signature)}; it is "
                              f"called as {form}") from None
    return fn


def _shown(fn: Callable[..., Any], signature: inspect.Signature) -> inspect.Signature:
    """`fn`'s signature with its annotations as written, also in a module with
    `from __future__ import annotations` (whose annotations are strings: 'str' would show)."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # (an annotation that does not evaluate: shown as the string)
        return signature
