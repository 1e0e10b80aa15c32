"""A rollout's requests when an engine is lost: sent to the engines left, never lost.

Small aiohttp servers stand in for engines: one answers, one never answers (hung), and a
closed port stands for a dead one. The fleet (fleet.py) decides when an engine is lost; here
the client's side: what happens to the requests it held."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_trainer.engines.client import EngineClient, EngineError


async def answer(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response([
        {"text": "x", "output_ids": [7, 8],
         "meta_info": {"prompt_tokens": len(ids), "completion_tokens": 2,
                       "finish_reason": {"type": "length"},
                       "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
                       "seed": sp["sampling_seed"]}}
        for ids, sp in zip(body["input_ids"], body["sampling_params"], strict=True)])


async def never(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def server(handler: Any) -> TestServer:
    app = web.Application()
    app.router.add_post("/generate", handler)
    srv = TestServer(app)
    await srv.start_server()
    return srv


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def live() -> AsyncIterator[str]:
    srv = await server(answer)
    yield str(srv.make_url("")).rstrip("/")
    await srv.close()


@pytest.fixture
async def hung() -> AsyncIterator[str]:
    srv = await server(never)
    yield str(srv.make_url("")).rstrip("/")
    await srv.close()


PROMPTS = [[1, 2, 3]] * 8  # 4 groups of 2
PARAMS = [{"sampling_seed": i} for i in range(8)]


async def test_a_dead_engines_share_goes_to_the_engine_left(live: str) -> None:
    dead = closed_port_url()
    async with EngineClient([dead, live]) as client:
        out = await client.generate_spread(PROMPTS, PARAMS, group=2)
        assert [r.meta_info["seed"] for r in out] == list(range(8))  # each once, in order
        assert {r.engine_url for r in out} == {live}
        assert client.lost == {dead} and client.live() == [live]
        # and later rollouts go to the engine left alone, at once
        again = await client.generate_spread(PROMPTS, PARAMS, group=2)
        assert {r.engine_url for r in again} == {live}


async def test_a_hung_engines_requests_are_given_up_when_it_is_lost(live: str,
                                                                    hung: str) -> None:
    async with EngineClient([hung, live]) as client:
        rollout = asyncio.ensure_future(client.generate_spread(PROMPTS, PARAMS, group=2))
        await asyncio.sleep(0.3)
        assert not rollout.done()  # half of it waits on the hung engine
        assert client.lose(hung)  # what the health probe does
        out = await asyncio.wait_for(rollout, 10)
        assert [r.meta_info["seed"] for r in out] == list(range(8))
        assert {r.engine_url for r in out} == {live}
        assert client.outstanding[live] == 0 and client.outstanding[hung] == 0


async def test_the_last_engine_lost_fails_the_rollout_naming_it(hung: str) -> None:
    async with EngineClient([hung]) as client:
        rollout = asyncio.ensure_future(client.generate_spread(PROMPTS, PARAMS, group=2))
        await asyncio.sleep(0.3)
        assert not client.lose(hung)  # nobody left to take its work
        with pytest.raises(EngineError, match="no other engine is left") as err:
            await asyncio.wait_for(rollout, 10)
        assert err.value.url == hung


async def test_with_no_engine_left_the_rollout_waits_for_one_revival(live: str) -> None:
    """Every engine dies mid-rollout (a fleet of one, or all at once): every chunk waits for
    the one `revive` (the fleet replacing the engines and sending them the weights), then
    goes to a replacement; the samples are those the lost engines would have made (their
    seeds)."""
    dead = [closed_port_url(), closed_port_url()]
    new = [live, live.replace("127.0.0.1", "localhost")]  # (one server under two names)
    revivals = 0
    async with EngineClient(dead) as client:
        async def revive() -> None:
            nonlocal revivals
            revivals += 1
            await asyncio.sleep(0.2)
            for old, url in zip(dead, new, strict=True):
                client.replace(old, url)

        client.revive = revive
        out = await asyncio.wait_for(client.generate_spread(PROMPTS, PARAMS, group=2), 10)
        assert revivals == 1 and client.urls == new and not client.lost
        assert {r.engine_url for r in out} <= set(new)
        assert [r.meta_info["seed"] for r in out] == list(range(8))


async def test_an_engines_error_answer_is_raised_not_retried(live: str) -> None:
    async def refuse(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "bad sampling params"}}, status=400)
    srv = await server(refuse)
    bad = str(srv.make_url("")).rstrip("/")
    try:
        async with EngineClient([bad, live]) as client:
            with pytest.raises(EngineError, match="bad sampling params"):
                await client.generate_spread(PROMPTS, PARAMS, group=2)
            assert not client.lost  # it answered: alive, and its error is the caller's
    finally:
        await srv.close()


async def test_a_replacement_takes_the_lost_engines_place(live: str) -> None:
    dead = closed_port_url()
    new = live.replace("127.0.0.1", "localhost")  # (the same server under another name)
    async with EngineClient([dead, live]) as client:
        client.lose(dead)
        client.replace(dead, new + "/")
        assert client.urls == [new, live] and not client.lost
        out = await client.generate_spread(PROMPTS, PARAMS, group=2)
        assert {r.engine_url for r in out} == {new, live}  # both in rotation again
        with pytest.raises(ValueError):
            client.replace(dead, live)  # gone already


def test_an_engine_error_survives_pickling_with_its_fields() -> None:
    """(as it crosses from a Ray actor to the driver)"""
    import pickle

    err = pickle.loads(pickle.dumps(EngineError("http://e:1", "no answer within 30s")))
    assert (err.url, err.message, err.status, str(err)) == (
        "http://e:1", "no answer within 30s", None, "engine http://e:1: no answer within 30s")
    assert pickle.loads(pickle.dumps(EngineError("http://e:1", "bad", 400))).answered
