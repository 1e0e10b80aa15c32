"""Scorers: what grades a batch of samples, behind one call, ``await scorer.score(items)``.

A step's samples reach a scorer as `RewardInput`s (the grading stage, rollout/grading.py,
makes them) and come back as a `Scored`: one reward per item in their order, or None where a
reward could not be had and the job drops that sample's group (reward.onError drop: the
service's batch failed after its retries). An error is never a reward of 0: a scorer that
cannot grade raises `RewardError`, which fails the job with its message.

The user's functions (reward.type custom, and the built-ins) are scorers here; the reward
service's client (rollout/reward_client.py, HTTP) is another, and a reward model the job
serves itself can be one more: the grading stage only calls ``score``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RewardInput:
    """One sample as a reward sees it: `id` names it for the step (the same on every retry:
    a service may cache by it), `prompt` is the data file's prompt, `response` the text of
    its last model turn, `label` and `metadata` the sample's (data.labelKey,
    data.metadataKeys)."""

    id: str
    prompt: str
    response: str
    label: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Scored:
    """A scorer's answer for its items, in their order: `rewards` (None: no reward, its
    group is dropped), why an item has none (`errors`), each item's own `metrics` (a
    service's), and the requests sent again (`retries`)."""

    rewards: list[float | None]
    metrics: list[dict[str, float]]
    errors: list[str | None]
    retries: int = 0

    @classmethod
    def of(cls, rewards: list[float | None]) -> Scored:
        """Every item rewarded, without metrics."""
        return cls(rewards, [{} for _ in rewards], [None] * len(rewards))


class Scorer(Protocol):
    async def score(self, items: Sequence[RewardInput]) -> Scored: ...


class RewardError(RuntimeError):
    """Grading failed; the message names the reward (its function or url) and why."""


def as_reward(value: Any, where: str) -> float:
    """`value` as a finite reward, or RewardError naming `where` (a NaN or an infinity
    would poison every advantage of its group; a string is a bug, not a score)."""
    if isinstance(value, str | bytes):
        raise RewardError(f"{where} returned {value!r}, not a number")
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"{where} returned {type(value).__name__} {value!r:.80}, not a "
                          "number") from None
    if not math.isfinite(reward):
        raise RewardError(f"{where} returned {reward}, not a finite number")
    return reward


async def all_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all, in their order; on the first exception the others are cancelled (a job
    that fails stops grading at once) and it is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


class FunctionScorer:
    """A function of one sample, ``fn(response, label) -> float``, plain or ``async def``
    (it may also return an awaitable): every item's call started at once, the awaitables
    awaited together. `name`: what errors call it (the built-in's name or the user's
    ``module:function``)."""

    def __init__(self, fn: Callable[[str, str], Any], name: str) -> None:
        self.fn, self.name = fn, name

    async def score(self, items: Sequence[RewardInput]) -> Scored:
        values = [self._call(item) for item in items]
        if any(inspect.isawaitable(v) for v in values):
            values = await all_or_cancel(self._resolved(v, item)
                                         for v, item in zip(values, items, strict=True))
        rewards: list[float | None] = [
            as_reward(value, f"reward function {self.name} (sample {item.id})")
            for value, item in zip(values, items, strict=True)]
        return Scored.of(rewards)

    def _call(self, item: RewardInput) -> Any:
        try:
            return self.fn(item.response, item.label)
        except Exception as exc:
            raise self._failed(item, exc) from exc

    async def _resolved(self, value: Any, item: RewardInput) -> Any:
        if not inspect.isawaitable(value):
            return value
        try:
            return await value
        except Exception as exc:
            raise self._failed(item, exc) from exc

    def _failed(self, item: RewardInput, exc: Exception) -> RewardError:
        return RewardError(f"reward function {self.name} raised on sample {item.id}: "
                           f"{type(exc).__name__}: {exc}")


class BatchFunctionScorer:
    """A function of all the samples graded at once (reward.batch), ``fn(samples) ->
    list[float]``, plain or ``async def``: one call with every item, one reward back for
    each, in their order."""

    def __init__(self, fn: Callable[[list[RewardInput]], Any], name: str) -> None:
        self.fn, self.name = fn, name

    async def score(self, items: Sequence[RewardInput]) -> Scored:
        where = f"reward function {self.name}"
        try:
            out = self.fn(list(items))
            if inspect.isawaitable(out):
                out = await out
        except Exception as exc:
            raise RewardError(f"{where} raised on a batch of {len(items)} samples: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(out, Sequence) or isinstance(out, str | bytes):
            raise RewardError(f"{where} returned {type(out).__name__}, not a list of "
                              f"{len(items)} rewards (reward.batch: one per sample)")
        if len(out) != len(items):
            raise RewardError(f"{where} returned {len(out)} rewards for {len(items)} samples "
                              "(reward.batch: one per sample, in their order)")
        rewards: list[float | None] = [as_reward(v, f"{where} (sample {item.id})")
                                       for v, item in zip(out, items, strict=True)]
        return Scored.of(rewards)
