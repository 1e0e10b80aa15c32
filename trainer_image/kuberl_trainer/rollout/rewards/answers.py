"""A response's answer, as its reward compares it: what maj@k votes on (algos/eval_metrics.py).

Two samples agree when their answers are equal strings:

- exact: the response with whitespace collapsed and case folded (what exact_match compares);
- f1: its SQuAD-normalised tokens (what token_f1 compares);
- math: the final answer math-verify extracts (a boxed answer first), as SymPy prints it, so
  ``\\boxed{\\frac12}`` and ``1/2`` agree (``0.5`` prints as a float and does not: a vote
  is stricter than the reward); None when none parses;
- custom: the reward function's own ``answer(response) -> str | None`` attribute, if it has
  one (``grade.answer = extract``; a batch function's too); else there is no answer and no
  maj@k;
- environment: none (its reward is the episode's, not a grade of an answer): no maj@k;
- remote: none (the service grades; kuberl cannot read its answers): no maj@k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.rewards.text import normalised_tokens, squash

AnswerFn = Callable[[str], str | None]


def answer_fn(spec: RewardSpec, reward_fn: Callable[..., Any] | None) -> AnswerFn | None:
    """How to read a response's answer under `spec`'s reward, or None when answers cannot be
    compared (no maj@k)."""
    if spec.type == "exact":
        return squash
    if spec.type == "f1":
        return lambda response: " ".join(normalised_tokens(response))
    if spec.type == "math":
        from kuberl_trainer.rollout.rewards.math_answers import math_answer

        return math_answer
    if spec.type == "custom":
        answer = getattr(reward_fn, "answer", None)
        return answer if callable(answer) else None
    return None
