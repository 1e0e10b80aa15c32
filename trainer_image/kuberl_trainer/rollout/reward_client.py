"""The reward service's client (reward.type remote): a scorer over HTTP, `RemoteScorer`.

A call to `score` cuts the items into batches of at most `batch_size`, in their order (a
batch may hold samples of several prompts), and sends them all at once, at most
`max_concurrent` in flight (the others wait for a slot; a batch waiting out its backoff holds
none). Each batch is retried as rewards/protocol.py says, with the same body, so the same
ids; a batch whose retries run out fails the job (`RewardError` naming the url and the last
answer) or, with `drop`, leaves its items without a reward (None: the grading stage drops
their groups). One aiohttp session per call: it belongs to the event loop that runs the call,
and needs no teardown when the run ends.

`urls`: where batches go, batch i to urls[i % len(urls)] and each retry to the next one. A
job's reward service has one; a reward model the job serves itself (reward.model) a replica
each. `codec`: what a batch's request is and how its answer is read: the reward service's
contract (rewards/protocol.py), or a served reward model's (rewards/model_io.py: SGLang's
/classify or /generate), which may leave an item without a reward (a judge's answer without a
score), failing the job or, with drop, that item's group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kuberl_api.runtime import ENV_REWARD_AUTH
from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.rewards.model_io import ChatRender, Codec, codec_for
from kuberl_trainer.rollout.rewards.protocol import (
    BACKOFF_BASE_S,
    AnswerError,
    Result,
    backoff_s,
    parse_answer,
    request_body,
    retry_after_s,
    retryable,
    trimmed,
)
from kuberl_trainer.rollout.rewards.scorer import RewardError, RewardInput, Scored, all_or_cancel

LOG = logging.getLogger("kuberl.reward")


def reward_credential() -> str:
    """reward.auth's credential as this process was given it ("" when none): from the
    Secret in a cluster (the operator's secretKeyRef), from the environment locally."""
    return os.environ.get(ENV_REWARD_AUTH, "")


@dataclass
class _Outcome:
    results: list[Result | str] | None  # None: dropped after its retries; str: an item's error
    retries: int
    error: str | None = None


@dataclass(frozen=True)
class ServiceCodec:
    """The reward service's contract (rewards/protocol.py) as a Codec."""

    path: str = ""

    def body(self, batch: Sequence[RewardInput]) -> dict[str, Any]:
        return request_body(batch)

    def parse(self, text: str, batch: Sequence[RewardInput]) -> list[Result | str]:
        return list(parse_answer(text, [i.id for i in batch]))


class RemoteScorer:
    """`headers`: sent with every request (reward.auth's credential; a served reward model's
    engines' API key); `rng`, `backoff_base_s`: the backoff's jitter and
    first delay (protocol.backoff_s; tests shorten it)."""

    def __init__(self, urls: str | Sequence[str], *, timeout_s: float, max_retries: int,
                 batch_size: int, max_concurrent: int, drop: bool = False,
                 headers: Mapping[str, str] | None = None,
                 rng: random.Random | None = None,
                 backoff_base_s: float = BACKOFF_BASE_S, codec: Codec | None = None,
                 name: str = "reward.url", once: bool = False) -> None:
        self.codec: Codec = codec or ServiceCodec()
        # Score each distinct (prompt, response, label) once a call (a served model, which is
        # deterministic): identical samples then get one reward whatever batch they fall in.
        # A batched forward pass is not batch-invariant to the last bit (padding changes the
        # kernels' shapes), and a GRPO group of identical answers scored in different batches
        # would otherwise get a float-noise spread that std normalisation blows up into
        # advantages; the model also does less work (a group's answers often repeat).
        self.once = once
        self.name = name  # what errors call it: reward.url, or the served reward model
        self.urls = [u + self.codec.path
                     for u in ([urls] if isinstance(urls, str) else list(urls))]
        if not self.urls or batch_size < 1 or max_concurrent < 1 or max_retries < 0:
            raise ValueError("a reward service needs a url, batches of at least one item, "
                             "a request in flight and no negative retries")
        self.timeout_s, self.max_retries, self.batch_size = timeout_s, max_retries, batch_size
        self.max_concurrent, self.drop = max_concurrent, drop
        self.headers = dict(headers or {})
        self.rng, self.backoff_base_s = rng or random.Random(), backoff_base_s

    @classmethod
    def from_spec(cls, spec: RewardSpec, credential: str = "") -> RemoteScorer:
        """The reward service's client; `credential`: reward.auth's (its header's value
        made here)."""
        assert spec.url is not None  # (the spec requires it for type remote)
        headers = ({spec.auth.header: spec.auth.header_value(credential)}
                   if spec.auth is not None else None)
        return cls(spec.url, timeout_s=spec.request_timeout_seconds,
                   max_retries=spec.retries, batch_size=spec.request_batch_size,
                   max_concurrent=spec.concurrent_requests, drop=spec.drops_errors,
                   headers=headers)

    @classmethod
    def for_model(cls, spec: RewardSpec, urls: Sequence[str], render: ChatRender,
                  api_key: str = "") -> RemoteScorer:
        """The scorer of the reward model the job serves (reward.model) at `urls`, its
        replicas; `render`: its tokenizer's chat template; `api_key`: the engines' key."""
        assert spec.model is not None  # (the spec requires it for type model)
        return cls(urls, timeout_s=spec.request_timeout_seconds,
                   max_retries=spec.retries, batch_size=spec.request_batch_size,
                   max_concurrent=spec.concurrent_requests, drop=spec.drops_errors,
                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                   codec=codec_for(spec.model, render),
                   name=f"the reward model ({spec.model.form}, {spec.model.path})", once=True)

    async def score(self, items: Sequence[RewardInput]) -> Scored:
        if not self.once:
            return await self._score(items)
        first: dict[tuple[str, str, str], int] = {}
        unique: list[RewardInput] = []
        index = []
        for item in items:
            j = first.setdefault((item.prompt, item.response, item.label), len(unique))
            if j == len(unique):
                unique.append(item)
            index.append(j)
        scored = await self._score(unique)
        return Scored([scored.rewards[j] for j in index],
                      [dict(scored.metrics[j]) for j in index],
                      [scored.errors[j] for j in index], retries=scored.retries)

    async def _score(self, items: Sequence[RewardInput]) -> Scored:
        size = self.batch_size
        batches = [list(items[i:i + size]) for i in range(0, len(items), size)]
        slots = asyncio.Semaphore(self.max_concurrent)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
            outcomes = await all_or_cancel(self._batch(session, slots, k, batch)
                                           for k, batch in enumerate(batches))
        scored = Scored([], [], [], retries=sum(o.retries for o in outcomes))
        for outcome, batch in zip(outcomes, batches, strict=True):
            if outcome.results is None:
                scored.rewards += [None] * len(batch)
                scored.metrics += [{} for _ in batch]
                scored.errors += [outcome.error] * len(batch)
                continue
            for r in outcome.results:
                if isinstance(r, str):  # (an item the answer gave no reward: kept by drop)
                    scored.rewards.append(None)
                    scored.metrics.append({})
                    scored.errors.append(r)
                else:
                    scored.rewards.append(r.reward)
                    scored.metrics.append(r.metrics)
                    scored.errors.append(None)
        return scored

    async def _batch(self, session: aiohttp.ClientSession, slots: asyncio.Semaphore,
                     k: int, batch: list[RewardInput]) -> _Outcome:
        body = self.codec.body(batch)
        tries, last, wait = self.max_retries + 1, "", 0.0
        url = self.urls[k % len(self.urls)]
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(max(wait, backoff_s(attempt - 1, self.rng,
                                                        self.backoff_base_s)))
            url = self.urls[(k + attempt) % len(self.urls)]
            async with slots:
                try:
                    async with session.post(url, json=body) as resp:
                        status, text = resp.status, await resp.text(errors="replace")
                        after = retry_after_s(resp.headers.get("Retry-After"))
                except TimeoutError:
                    last, wait = f"no answer within {self.timeout_s:g} s", 0.0
                    continue
                except (aiohttp.ClientError, OSError) as exc:
                    last, wait = f"{type(exc).__name__}: {exc}", 0.0
                    continue
            if 200 <= status < 300:
                try:
                    results = self.codec.parse(text, batch)
                except AnswerError as exc:
                    raise RewardError(f"{self.name} {url}: {exc} (HTTP {status}: "
                                      f"{trimmed(text)})") from None
                return self._checked(_Outcome(results, attempt), url, batch)
            if not retryable(status):
                raise RewardError(f"{self.name} {url} refused a batch of {len(batch)} samples "
                                  f"(HTTP {status}, not retried): {trimmed(text)}")
            last, wait = f"HTTP {status}: {trimmed(text)}", after or 0.0
        attempts = "1 attempt" if tries == 1 else f"{tries} attempts"
        error = (f"{self.name} {url}: a batch of {len(batch)} samples failed after {attempts} "
                 f"(reward.maxRetries {self.max_retries}); the last: {last}")
        if not self.drop:
            raise RewardError(error)
        LOG.warning("%s: their groups leave the step (reward.onError: drop)", error)
        return _Outcome(None, tries - 1, error)

    def _checked(self, outcome: _Outcome, url: str, batch: list[RewardInput]) -> _Outcome:
        """An answer that left items without a reward: the job fails on the first, unless
        their groups are dropped (onError drop)."""
        missing = [(item, r) for item, r in zip(batch, outcome.results or [], strict=True)
                   if isinstance(r, str)]
        if missing and not self.drop:
            item, why = missing[0]
            raise RewardError(f"{self.name} {url}: sample {item.id}: {why}"
                              + (f" (and {len(missing) - 1} more in its batch)"
                                 if len(missing) > 1 else ""))
        for item, why in missing:
            LOG.warning("%s: sample %s: %s: its group leaves the step (reward.onError: drop)",
                        self.name, item.id, why)
        return outcome
