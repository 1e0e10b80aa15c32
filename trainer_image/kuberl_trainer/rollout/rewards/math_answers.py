"""Math answers checked with Hugging Face's math-verify (symbolic, via SymPy).

math-verify's timeouts use ``signal.alarm``, which only works in the main thread; called from
another thread (a threaded Ray actor, a thread pool) it raises instead of grading. So the
timeout is used in the main thread and switched off elsewhere; there a pathological
expression can take long, which the caller bounds (rewards run outside the training step).
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

TIMEOUT_SECONDS = 5
# A boxed answer wins over "the answer is ..." phrases and over bare numbers met earlier in
# the response (math-verify's default ranks boxed after the phrases).
_RESPONSE_TARGETS = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label mathematically, else 0.0.

    ``\\boxed{1/2}``, ``$\\frac12$`` and ``0.5`` all match a label ``\\frac{1}{2}``. Labels may
    be bare (``42``, ``x^2+1``) or LaTeX; a label or response that does not parse, a parse
    error and a timeout all score 0.0.
    """
    timeout = _timeout()
    try:
        gold = _parse_label(label, timeout)
        if not gold:
            return 0.0
        # parsing_timeout is annotated int, but math-verify documents None as "no timeout".
        answer = parse(response, _RESPONSE_TARGETS, parsing_timeout=timeout)
        return float(bool(answer) and verify(list(gold), answer, timeout_seconds=timeout))
    except (Exception, TimeoutException):
        # math-verify catches its own errors; this is the backstop for anything it lets out.
        return 0.0


def math_answer(response: str) -> str | None:
    """The response's final answer as math-verify extracts it (as math_reward does), printed
    by SymPy, or None when none parses: maj@k's vote (rewards/answers.py)."""
    try:
        answer = parse(response, _RESPONSE_TARGETS, parsing_timeout=_timeout())
    except (Exception, TimeoutException):
        return None
    return str(answer[0]) if answer else None


@lru_cache(maxsize=4096)
def _parse_label(label: str, timeout: int | None) -> tuple[Any, ...]:
    """Parsed label, cached: every label is graded once per response in its group.

    Bare LaTeX such as ``x^2+1`` is only found inside math delimiters, so the label is tried
    as written, then wrapped in ``$...$``.
    """
    for text in (label, f"${label}$"):
        parsed = parse(text, parsing_timeout=timeout)
        if parsed:
            return tuple(parsed)  # immutable: the cached value is shared between calls
    return ()


def _timeout() -> int | None:
    """Seconds for math-verify's signal-based timeout, or None where signals can't be used."""
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
