"""The weight sync when an engine dies during it: replaced, and the weights sent again to all.

A stand-in engine group (its processes: a dict of exit codes) and small aiohttp servers that
answer GET /health stand in for the engines; the integration test
(test_local_run::test_a_dead_or_hung_engine_is_replaced_and_the_run_goes_on, "dies-in-sync")
kills a real engine as its weights go out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_trainer.engines.client import EngineClient, EngineError, GroupBroken
from kuberl_trainer.engines.fleet import Fleet


async def healthy(_: web.Request) -> web.Response:
    return web.Response(status=200)


class Engines:
    """What Fleet uses of engine_actors.EngineGroup: urls, dead(), restart(url)."""

    def __init__(self, urls: list[str], spare: list[str]) -> None:
        self.urls, self.spare = list(urls), list(spare)
        self.exited: dict[str, int] = {}

    def dead(self) -> dict[str, int]:
        return dict(self.exited)

    def restart(self, url: str) -> str:
        new = self.spare.pop(0)
        self.urls[self.urls.index(url)] = new
        self.exited.pop(url, None)  # (a hung one: stopped first)
        return new


@pytest.fixture
async def servers() -> AsyncIterator[list[str]]:
    app = web.Application()
    app.router.add_get("/health", healthy)
    started = [TestServer(app) for _ in range(4)]
    for srv in started:
        await srv.start_server()
    yield [str(srv.make_url("")).rstrip("/") for srv in started]
    for srv in started:
        await srv.close()


def fleet_of(urls: list[str], budget: int) -> tuple[Fleet, Engines]:
    engines = Engines(urls[:2], urls[2:])
    client = EngineClient(engines.urls[:])
    return Fleet(engines, client, budget=budget, start_timeout_s=10), engines  # type: ignore[arg-type]


def push_that_kills(engines: Engines, times: int) -> tuple[Callable[..., float], list[list[str]]]:
    """A push that kills engine 0 while it sends, `times` times (as SIGKILL mid-update)."""
    calls: list[list[str]] = []

    def push(urls: list[str], version: int, bucket_bytes: int) -> float:
        calls.append(urls)
        assert (version, bucket_bytes) == (7, 1024)
        if len(calls) <= times:
            engines.exited[urls[0]] = -9
            raise EngineError(urls[0], "/update_weights_from_distributed: connection reset")
        return 0.1
    return push, calls


async def test_an_engine_dying_in_the_sync_is_replaced_and_every_engine_gets_the_weights(
        servers: list[str]) -> None:
    fleet, engines = fleet_of(servers, budget=1)
    push, calls = push_that_kills(engines, times=1)
    await fleet.sync(push, 7, 1024)
    # Sent again to all: the engine that survived may hold half an update.
    assert calls == [servers[:2], [servers[2], servers[1]]]
    assert fleet.restarts == 1 and fleet.client.urls == [servers[2], servers[1]]


async def test_an_engine_past_the_syncs_deadline_is_taken_as_hung_and_replaced(
        servers: list[str]) -> None:
    """No engine died, but one did not answer within its deadline (the sender's timeouts):
    hung, so replaced like a dead one rather than waited on."""
    fleet, _ = fleet_of(servers, budget=1)
    calls: list[list[str]] = []

    def push(urls: list[str], version: int, bucket_bytes: int) -> float:
        calls.append(urls)
        if len(calls) == 1:
            raise EngineError(urls[1], "/pause_generation: TimeoutError")
        return 0.1

    await fleet.sync(push, 7, 1024)
    assert calls == [servers[:2], [servers[0], servers[2]]] and fleet.restarts == 1


async def test_the_engines_left_in_an_aborted_update_are_replaced_with_the_dead_one(
        servers: list[str]) -> None:
    """Engine 0 died in the middle of a broadcast; the trainer aborted the group and engine 1
    was still in it past the grace (an engine that cannot abort its side: SGLang's). Both are
    replaced before the push is made again, at once, not at the group's timeout."""
    fleet, engines = fleet_of(servers, budget=2)
    calls: list[list[str]] = []

    def push(urls: list[str], version: int, bucket_bytes: int) -> float:
        calls.append(urls)
        if len(calls) == 1:
            engines.exited[urls[0]] = -9
            raise GroupBroken(urls[0], "Server disconnected; the group was aborted",
                              stuck=[urls[1]])
        return 0.1

    await fleet.sync(push, 7, 1024)
    assert calls == [servers[:2], servers[2:4]] and fleet.restarts == 2


async def test_a_broken_update_whose_failed_engine_lives_replaces_it_as_hung(
        servers: list[str]) -> None:
    """No engine died: the one that failed (past its bucket's deadline) is hung, and the
    others were shown out of the aborted update (nothing stuck): only it is replaced."""
    fleet, _ = fleet_of(servers, budget=1)
    calls: list[list[str]] = []

    def push(urls: list[str], version: int, bucket_bytes: int) -> float:
        calls.append(urls)
        if len(calls) == 1:
            raise GroupBroken(urls[1], "no answer within 30s; the group was aborted")
        return 0.1

    await fleet.sync(push, 7, 1024)
    assert calls == [servers[:2], [servers[0], servers[2]]] and fleet.restarts == 1


async def test_past_the_budget_the_sync_fails_naming_it(servers: list[str]) -> None:
    fleet, engines = fleet_of(servers, budget=0)
    push, calls = push_that_kills(engines, times=1)
    with pytest.raises(EngineError, match=r"exited with code -9; rollout\.maxEngineRestarts is 0"):
        await fleet.sync(push, 7, 1024)
    assert len(calls) == 1 and fleet.restarts == 0


async def test_a_failure_with_every_engine_alive_is_raised_not_retried(
        servers: list[str]) -> None:
    fleet, _ = fleet_of(servers, budget=3)
    calls: list[list[str]] = []

    def push(urls: list[str], version: int, bucket_bytes: int) -> float:
        calls.append(urls)
        raise EngineError(urls[1], "/update_weights_from_distributed: shape mismatch", status=400)

    with pytest.raises(EngineError, match="shape mismatch"):
        await fleet.sync(push, 7, 1024)
    assert len(calls) == 1 and fleet.restarts == 0
