"""The reward service (reward.type remote): its contract as pure functions (rewards/protocol.py:
both answer forms, what is checked, which failures are retried, the backoff), and the client
(rollout/reward_client.py) against a real HTTP server on loopback (tests/reward_server.py):
batching, order, concurrency, retries with the same ids, fail and drop."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kuberl_trainer.rollout.reward_client import RemoteScorer
from kuberl_trainer.rollout.rewards.protocol import (
    AnswerError,
    backoff_s,
    parse_answer,
    request_body,
    retry_after_s,
    retryable,
    trimmed,
)
from kuberl_trainer.rollout.rewards.scorer import RewardError, RewardInput
from tests.reward_server import RewardServer, dumps, exact

ROOT = Path(__file__).resolve().parents[2]


def items(count: int, right: set[int] | None = None) -> list[RewardInput]:
    """Items whose response is right (equals the label, but for case and spaces) for the
    indices in `right` (default: the even ones)."""
    right = {i for i in range(count) if i % 2 == 0} if right is None else right
    return [RewardInput(id=f"3:0:{i}:0", prompt=f"{i}+{i}=", label=str(2 * i),
                        response=f" {2 * i} " if i in right else "x", metadata={"i": i})
            for i in range(count)]


def scorer(url: str | list[str], **kwargs: Any) -> RemoteScorer:
    settings: dict[str, Any] = {"timeout_s": 5.0, "max_retries": 3, "batch_size": 3,
                                "max_concurrent": 8, "rng": random.Random(0),
                                "backoff_base_s": 0.001}
    return RemoteScorer(url, **(settings | kwargs))


# --- the contract, as pure functions ---------------------------------------------------------

def test_the_request_carries_every_field_of_each_item() -> None:
    (item,) = items(1)
    assert request_body([item]) == {"items": [{"id": "3:0:0:0", "prompt": "0+0=",
                                               "response": " 0 ", "label": "0",
                                               "metadata": {"i": 0}}]}


def test_both_answer_forms_come_back_in_the_requests_order() -> None:
    ids = ["a", "b", "c"]
    assert [r.reward for r in parse_answer('{"rewards": [1, 0.5, -2]}', ids)] == [1, 0.5, -2]
    results = ('{"results": [{"id": "c", "reward": 3}, {"id": "a", "reward": 1, '
               '"metrics": {"judge.len": 7, "ok": 1}}, {"id": "b", "reward": 2}]}')
    parsed = parse_answer(results, ids)
    assert [r.reward for r in parsed] == [1.0, 2.0, 3.0]
    assert parsed[0].metrics == {"judge.len": 7.0, "ok": 1.0} and parsed[1].metrics == {}


@pytest.mark.parametrize(("body", "words"), [
    ("not json", "not JSON"),
    ("[1, 0]", 'with "rewards"'),
    ('{"rewards": [1, 0], "results": []}', 'with "rewards"'),
    ('{"score": [1, 0]}', 'with "rewards"'),
    ('{"rewards": [1]}', '"rewards" has 1 values for 2 items'),
    ('{"rewards": [1, 0, 1]}', '"rewards" has 3 values for 2 items'),
    ('{"rewards": "1,0"}', '"rewards" is not a list'),
    ('{"rewards": [1, NaN]}', "rewards[1] is NaN, not a finite number"),
    ('{"rewards": [Infinity, 0]}', "rewards[0] is Infinity, not a finite number"),
    ('{"rewards": [1, "0.5"]}', 'rewards[1] is "0.5", not a number'),
    ('{"rewards": [true, 0]}', "rewards[0] is true, not a number"),
    ('{"rewards": [1, null]}', "rewards[1] is null, not a number"),
    ('{"results": [{"id": "a", "reward": 1}]}', "missing ['b']"),
    ('{"results": [{"id": "a", "reward": 1}, {"id": "b", "reward": 1}, '
     '{"id": "z", "reward": 1}]}', "unknown ['z']"),
    ('{"results": [{"id": "a", "reward": 1}, {"id": "a", "reward": 1}]}', "answered twice"),
    ('{"results": [{"reward": 1}, {"id": "b", "reward": 1}]}', "results[0] is not an object"),
    ('{"results": [{"id": "a", "reward": 1}, {"id": "b"}]}', "results[1].reward is null"),
    ('{"results": [{"id": "a", "reward": 1, "metrics": [1]}, {"id": "b", "reward": 1}]}',
     "results[0].metrics is not an object"),
    ('{"results": [{"id": "a", "reward": 1, "metrics": {"x": NaN}}, '
     '{"id": "b", "reward": 1}]}', "results[0].metrics.x is NaN"),
    ('{"results": [{"id": "a", "reward": 1, "metrics": {"a b": 1}}, '
     '{"id": "b", "reward": 1}]}', "'a b' is not a metric name"),
])
def test_a_malformed_answer_says_what_is_wrong(body: str, words: str) -> None:
    with pytest.raises(AnswerError, match=None) as info:
        parse_answer(body, ["a", "b"])
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize(("status", "retried"), [
    (200, False), (400, False), (401, False), (403, False), (404, False), (409, False),
    (413, False), (422, False), (408, True), (429, True), (500, True), (502, True),
    (503, True), (504, True), (599, True)])
def test_only_failures_that_may_go_away_are_retried(status: int, retried: bool) -> None:
    assert retryable(status) is retried


def test_backoff_doubles_within_its_jitter_and_stops_at_the_cap() -> None:
    rng = random.Random(1)
    for attempt in range(12):
        ceiling = min(30.0, 0.5 * 2 ** attempt)
        waits = [backoff_s(attempt, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), attempt
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not one value
    assert backoff_s(40, rng) <= 30.0  # (2**40 would overflow no float, but stays capped)


def test_retry_after_in_seconds_is_honoured_up_to_the_cap() -> None:
    assert retry_after_s("2") == 2.0 and retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s("3600") == 30.0 and retry_after_s("-1") == 0.0
    assert retry_after_s(None) is None and retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_s("nan") is None


def test_a_servers_text_is_trimmed_for_the_error_line() -> None:
    assert trimmed("  line one\n\n  line two ") == "line one line two"
    assert trimmed("") == "(empty body)"
    long = trimmed("x" * 2000)
    assert len(long) == 504 and long.endswith(" ...")


# --- the client, against a real server ---------------------------------------------------------

def test_rewards_come_back_in_order_whatever_order_batches_finish_in() -> None:
    """11 items in batches of 3 (the last of 2), the first batches answered last, in both
    answer forms: every item gets its own reward, in order, and the batches went out at
    once (4 in flight)."""
    async def run() -> None:
        def slowest_first(ids: list[str]) -> float:  # items 0-2: 0.35 s ... 9-10: 0.05 s
            return 0.35 - 0.1 * int(ids[0].split(":")[2]) / 3

        async with RewardServer(answer="alternate", metrics=True,
                                delay=slowest_first) as server:
            its = items(11)
            scored = await scorer(server.url).score(its)
        assert scored.rewards == [exact(i.response, i.label) for i in its]
        assert scored.rewards == [1.0 if k % 2 == 0 else 0.0 for k in range(11)]
        assert [len(r.ids) for r in server.requests] == [2, 3, 3, 3]  # (as they finished)
        assert [r.ids[0] for r in server.requests] == ["3:0:9:0", "3:0:6:0", "3:0:3:0",
                                                       "3:0:0:0"]  # finished out of order
        assert server.max_in_flight == 4 and scored.retries == 0
        # the results form's metrics came back on their items (the rewards form has none)
        with_metrics = [m for m in scored.metrics if m]
        assert with_metrics and all(m == {"length": len(i.response)}
                                    for m, i in zip(scored.metrics, its, strict=True) if m)
        assert scored.errors == [None] * 11
    asyncio.run(run())


def test_at_most_max_concurrent_requests_are_in_flight() -> None:
    async def run() -> None:
        async with RewardServer(delay=lambda ids: 0.05) as server:
            await scorer(server.url, batch_size=1, max_concurrent=3).score(items(12))
        assert len(server.requests) == 12 and server.max_in_flight == 3
    asyncio.run(run())


def test_retries_send_the_same_ids_and_are_counted() -> None:
    """Half the batches' first attempts answered 503: each is sent again with the same ids
    (what lets a server cache), the rewards are the same, the retries counted."""
    async def run() -> None:
        async with RewardServer(flaky=0.5) as server:
            its = items(30)
            scored = await scorer(server.url, batch_size=2).score(its)
        failed = [r.ids for r in server.requests if r.status == 503]
        served = [r.ids for r in server.served]
        assert 2 <= len(failed) <= 13, dumps(server)
        assert sorted(served) == sorted([i.id for i in its[k:k + 2]] for k in range(0, 30, 2))
        assert all(served.count(ids) == 1 for ids in failed)  # each resent once, unchanged
        assert scored.retries == len(failed)
        assert scored.rewards == [exact(i.response, i.label) for i in its]
    asyncio.run(run())


def test_a_timeout_and_a_dropped_connection_are_retried() -> None:
    attempts: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        attempts.append(request.headers.get("Authorization", ""))
        if len(attempts) == 1:
            await asyncio.sleep(2)  # past the client's timeout
        if len(attempts) == 2:
            assert request.transport is not None
            request.transport.close()  # the connection drops without an answer
            return web.Response()
        return web.json_response({"rewards": [1.0]})

    async def run() -> None:
        async with _server(handler) as url:
            scored = await scorer(url, timeout_s=0.5,
                                  headers={"Authorization": "Bearer k"}).score(items(1))
        assert scored.rewards == [1.0] and scored.retries == 2
        assert attempts == ["Bearer k"] * 3
    asyncio.run(run())


def test_retry_after_is_waited_out() -> None:
    seen: list[float] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        if len(seen) == 1:
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0.3"})
        return web.json_response({"rewards": [0.0]})

    async def run() -> None:
        async with _server(handler) as url:
            assert (await scorer(url).score(items(1))).rewards == [0.0]
        assert seen[1] - seen[0] >= 0.3
    asyncio.run(run())


def test_a_refusal_fails_at_once_with_the_servers_text() -> None:
    calls: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        calls.append(1)
        return web.Response(status=422, text='{"detail": "label missing"}\n')

    async def run() -> None:
        async with _server(handler) as url:
            with pytest.raises(RewardError) as info:
                await scorer(url).score(items(2))
        message = str(info.value)
        assert message.startswith(f"reward.url {url} refused a batch of 2 samples (HTTP 422, "
                                  "not retried)"), message
        assert '{"detail": "label missing"}' in message and calls == [1]
    asyncio.run(run())


@pytest.mark.parametrize(("answer", "words"), [
    ({"rewards": [1.0]}, '"rewards" has 1 values for 3 items'),
    ({"rewards": [1.0, float("nan"), 0.0]}, "rewards[1] is NaN, not a finite number"),
    ({"results": [{"id": "3:0:0:0", "reward": 1}, {"id": "3:0:1:0", "reward": 1},
                  {"id": "3:0:9:0", "reward": 1}]}, "missing ['3:0:2:0']")])
def test_a_malformed_answer_fails_the_job_naming_the_url_and_quoting_it(
        answer: dict[str, Any], words: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=_json(answer), content_type="application/json")

    async def run() -> None:
        async with _server(handler) as url:
            with pytest.raises(RewardError) as info:
                await scorer(url, max_retries=5).score(items(3))
        message = str(info.value)
        assert message.startswith(f"reward.url {url}: ") and words in message, message
        assert "(HTTP 200: {" in message  # the server's own text
    asyncio.run(run())


def test_a_batch_failing_past_its_retries_fails_the_job_quoting_the_last_answer() -> None:
    async def run() -> None:
        async with RewardServer(broken=lambda item: item["id"] == "3:0:4:0") as server:
            with pytest.raises(RewardError) as info:
                await scorer(server.url, max_retries=2).score(items(9))
        assert str(info.value) == (
            f"reward.url {server.url}: a batch of 3 samples failed after 3 attempts "
            "(reward.maxRetries 2); the last: HTTP 500: grader crashed on 3:0:3:0: boom")
        assert [len(r.ids) for r in server.requests if r.status == 500] == [3, 3, 3]
    asyncio.run(run())


def test_drop_leaves_exactly_the_failed_batches_items_without_a_reward() -> None:
    async def run() -> None:
        async with RewardServer(broken=lambda item: item["id"] in ("3:0:4:0", "3:0:9:0")
                                ) as server:
            scored = await scorer(server.url, max_retries=1, drop=True).score(items(11))
        lost = {3, 4, 5, 9, 10}  # the batches [3, 4, 5] and [9, 10]
        assert [k for k, r in enumerate(scored.rewards) if r is None] == sorted(lost)
        assert all(r == (1.0 if k % 2 == 0 else 0.0) for k, r in enumerate(scored.rewards)
                   if k not in lost)
        assert scored.retries == 2  # each failed batch tried twice
        assert [e is not None for e in scored.errors] == [k in lost for k in range(11)]
        assert "HTTP 500: grader crashed on 3:0:3:0" in str(scored.errors[3])
        assert server.url in str(scored.errors[9])
    asyncio.run(run())


def test_retries_go_to_the_next_url() -> None:
    """With several urls (the replicas of a served reward model), batch i goes to url i and
    its retry to the next one."""
    async def run() -> None:
        async with RewardServer(broken=lambda item: True, broken_status=503) as down, \
                RewardServer() as up:
            scored = await scorer([down.url, up.url], batch_size=2).score(items(4))
        assert scored.rewards == [1.0, 0.0, 1.0, 0.0] and scored.retries == 1
        assert [r.ids for r in down.requests] == [["3:0:0:0", "3:0:1:0"]]
        assert [r.ids for r in up.requests] == [["3:0:2:0", "3:0:3:0"],
                                                ["3:0:0:0", "3:0:1:0"]]
    asyncio.run(run())


def test_the_documented_example_server_serves_the_contract() -> None:
    """examples/reward_server.py, which docs/rewards.md tells users to copy."""
    spec = importlib.util.spec_from_file_location("reward_server_example",
                                                  ROOT / "examples" / "reward_server.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    async def run() -> None:
        runner = web.AppRunner(example.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/score"
        try:
            its = items(7)
            scored = await scorer(url).score(its)
        finally:
            await runner.cleanup()
        assert scored.rewards == [exact(i.response, i.label) for i in its]
    asyncio.run(run())


class _server:
    """A one-handler server on loopback: `async with _server(handler) as url`."""

    def __init__(self, handler: Any) -> None:
        self.app = web.Application()
        self.app.router.add_post("/score", handler)

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}/score"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


@pytest.mark.parametrize("header", ["Authorization", "X-API-Key"])
def test_reward_auth_sends_the_credential_in_its_header(header: str) -> None:
    """reward.auth: Authorization carries `Bearer <credential>`, another header the
    credential itself; a wrong one is the service's 401, not retried, quoted."""
    from kuberl_api.spec import RewardSpec

    async def run(credential: str) -> Any:
        async with RewardServer(token="s3cret", header=header) as server:
            spec = RewardSpec.model_validate({
                "type": "remote", "url": server.url, "maxRetries": 2,
                "auth": {"secret": "grader", "header": header}})
            return await RemoteScorer.from_spec(spec, credential).score(items(4))

    assert asyncio.run(run("s3cret")).rewards == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(RewardError, match=rf"refused a batch of 4 samples \(HTTP 401, not "
                       rf"retried\): {header}: not authorized"):
        asyncio.run(run("wrong"))
