"""The reference engine's batcher (continuous batching, one engine step at a time) against a
stand-in step function: a client that goes away while its request runs (a closed connection, a
trainer that gave up) leaves the batch at the next step and the others get their answers; a
request arriving while a batch runs joins it at the next step, while batch-level batching
(join_running=False) holds it until the batch has finished. And the update gate (SGLang's
model_update_lock): an update waits for requests in flight, new ones wait behind it, and a
pause lets it through."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from kuberl_rollout.reference.batcher import Batcher
from kuberl_rollout.reference.engine import Step
from kuberl_rollout.reference.update_gate import UpdateGate


@dataclass(eq=False)
class Req:
    name: str
    tokens: int  # how many steps it runs
    input_ids: list[int] = field(default_factory=lambda: [1])
    output_ids: list[int] = field(default_factory=list)
    lora_id: str | None = None  # (the base: every request here)


class FakeEngine:
    """One token per running request per step; steps wait for `go` when `gated`."""

    def __init__(self, gated: bool = False) -> None:
        self.running: list[Req] = []
        self.joins: list[list[str]] = []  # per step
        self.dropped: list[str] = []
        self.go = threading.Event()
        if not gated:
            self.go.set()

    def step(self, join: Sequence[Any], drop: Sequence[Any]) -> Step:
        self.go.wait(timeout=10)
        self.dropped += [r.name for r in drop]
        self.running = [r for r in self.running if r not in drop] + list(join)
        self.joins.append([r.name for r in join])
        out = Step()
        for req in self.running:
            req.output_ids.append(0)
            if len(req.output_ids) == req.tokens:
                out.finished.append((req, {"rid": req.name, "steps": len(self.joins)}))
        self.running = [r for r in self.running if len(r.output_ids) < r.tokens]
        return out


async def until(check: Any) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_a_caller_gone_mid_batch_leaves_the_others_answered() -> None:
    engine = FakeEngine(gated=True)
    with ThreadPoolExecutor(1) as worker:
        batcher = Batcher(engine.step, worker, max_wait_s=0.05)  # type: ignore[arg-type]
        batcher.start()
        try:
            gone = asyncio.create_task(batcher.submit(Req("gone", 3)))  # type: ignore
            stays = asyncio.create_task(batcher.submit(Req("stays", 3)))  # type: ignore
            await until(lambda: len(batcher.running) == 2)
            assert [r.name for r in batcher.running] == ["gone", "stays"]  # type: ignore
            gone.cancel()
            await asyncio.sleep(0.05)
            engine.go.set()
            assert (await asyncio.wait_for(stays, 10))["rid"] == "stays"
            assert gone.cancelled() and engine.dropped == ["gone"]
            answer = await asyncio.wait_for(batcher.submit(Req("next", 1)), 10)  # type: ignore
            assert answer["rid"] == "next"
        finally:
            engine.go.set()
            await batcher.stop()


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "batch-level"])
async def test_a_request_arriving_mid_batch_joins_at_the_next_step(continuous: bool) -> None:
    engine = FakeEngine()
    with ThreadPoolExecutor(1) as worker:
        batcher = Batcher(engine.step, worker, max_wait_s=0.0,  # type: ignore[arg-type]
                          join_running=continuous)
        batcher.start()
        try:
            engine.go.clear()
            long = asyncio.create_task(batcher.submit(Req("long", 20)))  # type: ignore
            await until(lambda: batcher.running)
            short = asyncio.create_task(batcher.submit(Req("short", 2)))  # type: ignore
            await until(lambda: batcher.waiting)
            engine.go.set()
            first = await asyncio.wait_for(asyncio.wait([long, short],
                                                        return_when="FIRST_COMPLETED"), 10)
            done = {t.result()["rid"] for t in first[0]}
            assert done == ({"short"} if continuous else {"long"})
            await asyncio.wait_for(asyncio.gather(long, short), 10)
            assert engine.joins[1] == (["short"] if continuous else [])
        finally:
            engine.go.set()
            await batcher.stop()


async def test_the_update_gate_waits_for_requests_in_flight_and_new_ones_wait_for_it() -> None:
    paused = False
    gate = UpdateGate(lambda: paused)
    order: list[str] = []
    in_flight = asyncio.Event()
    finish = asyncio.Event()

    async def generate(name: str, hold: asyncio.Event | None = None) -> None:
        async with gate.generating():
            order.append(f"{name} start")
            in_flight.set()
            if hold is not None:
                await hold.wait()
            order.append(f"{name} end")

    async def update() -> None:
        async with gate.updating():
            order.append("update")

    first = asyncio.create_task(generate("first", finish))
    await in_flight.wait()
    upd = asyncio.create_task(update())
    await asyncio.sleep(0.05)
    later = asyncio.create_task(generate("later"))
    await asyncio.sleep(0.05)
    assert order == ["first start"]  # the update waits; the later request waits behind it
    finish.set()
    await asyncio.wait_for(asyncio.gather(first, upd, later), 5)
    assert order == ["first start", "first end", "update", "later start", "later end"]

    # A pause lets a waiting update go (the requests it holds stay in flight).
    finish.clear()
    order.clear()
    held = asyncio.create_task(generate("held", finish))
    await asyncio.sleep(0.05)
    upd = asyncio.create_task(update())
    await asyncio.sleep(0.05)
    assert order == ["held start"]
    paused = True
    await gate.paused()
    await asyncio.wait_for(upd, 5)
    assert order == ["held start", "update"]
    finish.set()
    await asyncio.wait_for(held, 5)
