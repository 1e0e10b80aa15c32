"""The reward service's contract (reward.type remote, docs/rewards.md), as pure functions: the
request a batch becomes, how an answer is read and checked, which failures are worth another
try and how long to wait before it. The client that sends them is rollout/reward_client.py.

Request: ``POST url`` with ``{"items": [{"id", "prompt", "response", "label", "metadata"}]}``.
Answer (HTTP 2xx, JSON), either form:

- ``{"rewards": [r0, r1, ...]}``: one number per item, in the request's order;
- ``{"results": [{"id", "reward", "metrics"?}, ...]}``: one per item in any order, matched by
  id; `metrics` (optional) maps names to numbers, which kuberl averages into the step's
  metrics as ``reward/<name>``.

Retried (the same body, the same ids): a transport error or a timeout, HTTP 408, 429 and 5xx.
Anything else that is not a well-formed answer (another status, a body that is not the
contract's, a wrong count or ids, a reward that is not a finite number) fails the job with
the server's text: it would fail the same way again.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kuberl_trainer.rollout.rewards.scorer import RewardError, RewardInput

# Backoff before retry a (0: the first): a delay drawn from [d/2, d], d = min(CAP, BASE * 2**a)
# ("equal jitter": never much shorter than the exponential delay, so a server shedding load
# gets its relief, and spread so that a step's batches do not come back at one instant).
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
TEXT_LIMIT = 500  # characters of a server's text quoted in an error
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class AnswerError(RewardError):
    """The service answered 2xx with something that is not the contract's answer."""


@dataclass(frozen=True)
class Result:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


def request_body(items: Sequence[RewardInput]) -> dict[str, Any]:
    return {"items": [{"id": i.id, "prompt": i.prompt, "response": i.response,
                       "label": i.label, "metadata": dict(i.metadata)} for i in items]}


def retryable(status: int) -> bool:
    """Whether an HTTP status may go away by itself: a request timeout, too many requests,
    a server error (overloaded, restarting, a gateway without a backend yet)."""
    return status in (408, 429) or 500 <= status <= 599


def backoff_s(attempt: int, rng: random.Random, base: float = BACKOFF_BASE_S,
              cap: float = BACKOFF_CAP_S) -> float:
    """Seconds to wait before retry `attempt` (0: the first), see BACKOFF_BASE_S."""
    ceiling = min(cap, base * 2 ** attempt)
    return rng.uniform(ceiling / 2, ceiling)


def retry_after_s(header: str | None, cap: float = BACKOFF_CAP_S) -> float | None:
    """A Retry-After header given in seconds, at most `cap` (its HTTP-date form is not
    honoured: the backoff applies)."""
    if header is None:
        return None
    try:
        seconds = float(header.strip())
    except ValueError:
        return None
    return min(max(seconds, 0.0), cap) if math.isfinite(seconds) else None


def trimmed(text: str, limit: int = TEXT_LIMIT) -> str:
    """A server's text for an error line: whitespace collapsed, cut to `limit`."""
    flat = " ".join(text.split())
    if not flat:
        return "(empty body)"
    return flat if len(flat) <= limit else flat[:limit] + " ..."


def parse_answer(text: str, ids: Sequence[str]) -> list[Result]:
    """A 2xx answer's body as one Result per requested id, in the request's order, or
    AnswerError saying what is wrong (the caller adds the url and the server's text)."""
    try:
        body = json.loads(text)
    except ValueError:
        raise AnswerError("the answer is not JSON") from None
    if not isinstance(body, dict) or ("rewards" in body) == ("results" in body):
        raise AnswerError('the answer must be a JSON object with "rewards" (a list of '
                          'numbers) or "results" (a list of {"id", "reward", "metrics"})')
    if "rewards" in body:
        rewards = body["rewards"]
        if not isinstance(rewards, list):
            raise AnswerError('"rewards" is not a list')
        if len(rewards) != len(ids):
            raise AnswerError(f'"rewards" has {len(rewards)} values for {len(ids)} items')
        return [Result(_number(r, f"rewards[{k}]")) for k, r in enumerate(rewards)]
    results = body["results"]
    if not isinstance(results, list):
        raise AnswerError('"results" is not a list')
    found: dict[str, Result] = {}
    for k, entry in enumerate(results):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise AnswerError(f"results[{k}] is not an object with a string id")
        rid = entry["id"]
        if rid in found:
            raise AnswerError(f"results[{k}]: id {rid!r} answered twice")
        found[rid] = Result(_number(entry.get("reward"), f"results[{k}].reward"),
                            _metrics(entry.get("metrics"), f"results[{k}].metrics"))
    missing = [i for i in ids if i not in found]
    unknown = sorted(set(found) - set(ids))
    if missing or unknown:
        raise AnswerError(f'"results" do not answer the request\'s ids: missing '
                          f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unknown "
                          f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return [found[i] for i in ids]


def _number(value: Any, where: str) -> float:
    # (bool is an int to Python, not a reward to the contract)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AnswerError(f"{where} is {json.dumps(value)[:80]}, not a number")
    if not math.isfinite(value):
        raise AnswerError(f"{where} is {json.dumps(value)}, not a finite number")
    return float(value)


def _metrics(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AnswerError(f"{where} is not an object of numbers")
    out = {}
    for name, number in value.items():
        if not METRIC_NAME.match(name):
            raise AnswerError(f"{where}: {name!r} is not a metric name (letters, digits, "
                              "'_', '.', '-'; not starting with a digit)")
        out[name] = _number(number, f"{where}.{name}")
    return out
