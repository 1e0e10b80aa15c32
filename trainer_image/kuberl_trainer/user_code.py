"""Importing what a user names as ``"package.module:attribute"`` (a reward function, a rollout
function, an environment class): at load time, before any rollout, with errors that name the
path and what went wrong."""

from __future__ import annotations

import importlib
from typing import Any


class UserCodeError(ImportError):
    """User code could not be loaded; the message names its import path."""


def import_object(path: str, what: str) -> Any:
    """The attribute `path` names. `what` says what it is for, in the errors ("reward
    function", "environment class")."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        kind = what.split()[-1]  # "function", "class"
        raise UserCodeError(f"{what} {path!r} must look like "
                            f"'module:{'Class' if kind == 'class' else kind}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code: syntax, deps, ...
        raise UserCodeError(f"cannot import module {module_name!r} of {what} {path!r}: "
                            f"{type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        raise UserCodeError(f"{what} {path!r}: module {module_name!r} has no attribute "
                            f"{attr!r}")
    if not callable(found):
        raise UserCodeError(f"{what} {path!r} is not callable (got an object of type "
                            f"{type(found).__name__})")
    return found
