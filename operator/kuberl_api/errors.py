"""Turn pydantic's errors into messages a user can act on: the field path as written in the
manifest (camelCase), the bad value, and what is allowed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kuberl_api.base import FieldError

_ALLOWED = {
    "literal_error": "allowed: {expected}",
    "enum": "allowed: {expected}",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "string_too_short": "must be at least {min_length} characters",
    "string_too_long": "must be at most {max_length} characters",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
    "string_pattern_mismatch": "must match {pattern}",
}


class InvalidRLJob(ValueError):
    """An RLJob that fails validation; `problems` holds one line per offending field."""

    def __init__(self, problems: Sequence[str], source: str = "RLJob") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is invalid:\n{lines}")


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: Any) -> tuple[str, str]:
    """(path, message) for one pydantic error dict."""
    loc = list(err["loc"])
    ctx = err.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, FieldError):
        parts = cause.field.split(".")
        if loc and loc[-1] == parts[0]:  # a field validator's: pydantic's loc names the field
            parts = parts[1:]
        return _path([*loc, *parts]), cause.text
    kind = err["type"]
    if kind == "missing":
        return _path(loc), "is required"
    if kind == "extra_forbidden":
        return _path(loc), "is not a known field (check spelling; fields are camelCase)"
    allowed = _ALLOWED.get(kind, "").format(**ctx) if kind in _ALLOWED else ""
    message = allowed or err["msg"]
    return _path(loc), f"{message} (got {err.get('input')!r})"


def format_errors(exc: ValidationError) -> list[str]:
    """One line per error, e.g. "spec.training.parallelism.tp: must be >= 1 (got 0)"."""
    return [": ".join(_describe(e)) for e in exc.errors()]
