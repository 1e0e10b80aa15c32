"""How a request to every engine ends when one engine fails.

A weight-update bucket must reach every engine even when one answers an error: each engine
joins the bucket's broadcasts only once its request arrives, so an engine whose request was
cancelled misses them and pairs the next bucket's broadcasts with the wrong receives (gloo
then aborts that engine on a size mismatch; seen in CI). Two small aiohttp servers stand in
for engines: one answers an error at once, the other answers slowly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_trainer.engines.client import EngineClient, EngineError, every_answer, first_error

SLOW_S = 0.4


class Engines:
    def __init__(self) -> None:
        self.slow_finished: list[float] = []

    async def failing(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"success": False, "message": "unknown tensor 'nope'"},
                                 status=400)

    async def slow(self, request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(SLOW_S)
        self.slow_finished.append(time.monotonic())
        return web.json_response({"success": True, "message": "updated 1 tensors"})


@pytest.fixture
async def engines() -> AsyncIterator[tuple[Engines, list[str]]]:
    state = Engines()
    servers = []
    for handler in (state.failing, state.slow):
        app = web.Application()
        app.router.add_post("/update_weights_from_distributed", handler)
        # As the reference engine runs (handler_cancellation=True, __main__.py).
        servers.append(TestServer(app, host="127.0.0.1", handler_cancellation=True))
    for server in servers:
        await server.start_server()
    try:
        yield state, [str(server.make_url("")).rstrip("/") for server in servers]
    finally:
        for server in servers:
            await server.close()


async def test_in_step_post_raises_the_error_only_after_every_engine_answered(
        engines: tuple[Engines, list[str]]) -> None:
    state, urls = engines
    async with EngineClient(urls) as client:
        with pytest.raises(EngineError, match="unknown tensor 'nope'") as err:
            await client.post_all("/update_weights_from_distributed", {}, in_step=True)
        raised = time.monotonic()
    assert err.value.url == urls[0] and err.value.answered
    assert len(state.slow_finished) == 1 and state.slow_finished[0] <= raised


async def test_plain_post_raises_at_once_and_drops_the_others(
        engines: tuple[Engines, list[str]]) -> None:
    state, urls = engines
    async with EngineClient(urls) as client:
        with pytest.raises(EngineError, match="unknown tensor 'nope'"):
            await client.post_all("/update_weights_from_distributed", {})
        await asyncio.sleep(SLOW_S + 0.2)
    assert state.slow_finished == []  # its handler was cancelled with the request


async def _answer(value: int, after: float) -> int:
    await asyncio.sleep(after)
    return value


async def _fail(error: Exception, after: float) -> int:
    await asyncio.sleep(after)
    raise error


async def test_every_answer_returns_results_in_order() -> None:
    assert await every_answer([_answer(1, 0.05), _answer(2, 0.0), _answer(3, 0.02)]) == [1, 2, 3]


async def test_every_answer_raises_the_first_error_in_order_after_all_answered() -> None:
    finished: list[int] = []

    async def slow() -> int:
        await asyncio.sleep(0.2)
        finished.append(1)
        return 1

    second = EngineError("http://b", "/x: bad", 400)
    first = EngineError("http://a", "/x: bad too", 200)
    with pytest.raises(EngineError) as err:
        await every_answer([_fail(first, 0.05), slow(), _fail(second, 0.0)])
    assert err.value is first and finished == [1]


@pytest.mark.parametrize("error", [
    EngineError("http://a", "/x: cannot connect"),  # no answer: the engine is gone
    RuntimeError("broadcast failed"),  # the local collective
], ids=["dead-engine", "collective"])
async def test_every_answer_gives_up_at_once_on_a_failure_without_an_answer(
        error: Exception) -> None:
    slow = asyncio.ensure_future(_answer(1, 5.0))
    started = time.monotonic()
    with pytest.raises(type(error)):
        await every_answer([_fail(error, 0.01), slow])
    assert time.monotonic() - started < 1.0
    await asyncio.sleep(0)
    assert slow.cancelled()


async def test_first_error_cancels_the_rest_at_once_even_for_an_answer() -> None:
    slow = asyncio.ensure_future(_answer(1, 5.0))
    with pytest.raises(EngineError):
        await first_error([_fail(EngineError("http://a", "/x: bad", 400), 0.01), slow])
    await asyncio.sleep(0)
    assert slow.cancelled()
