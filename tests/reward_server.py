"""A reward service on loopback for the tests and bench/remote_reward.py: exact match (the
response and the label equal once whitespace is collapsed and case folded, written here
from the contract, not taken from kuberl's grader), answering in either of the contract's
forms, with faults to order, and a record of what it was sent.

Faults are chosen by a batch's ids, never by chance, so a run is repeatable and a retry
(the same ids) is recognised as one:

- `flaky`: the share of batches whose FIRST attempt is answered 503 (then served);
- `broken(item)`: a batch holding such an item is answered `broken_status` every time;
- `delay(ids)`: seconds to wait before answering (batches then finish out of order).

With `token`, a request whose `header` does not carry it (`Bearer <token>` in Authorization,
the token itself in another header) is answered 401, as a service behind auth answers.

Run it in the test's event loop (``async with RewardServer() as server``) or, for a
`kuberl run` in another process, in a thread of its own (``with server.in_thread()``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def exact(response: str, label: str) -> float:
    return float(" ".join(response.split()).casefold() == " ".join(label.split()).casefold())


def share(ids: list[str]) -> float:
    """A batch's place in [0, 1), by its ids (a stable hash: the same on a retry)."""
    return int.from_bytes(hashlib.sha256("\n".join(ids).encode()).digest()[:4], "big") / 2**32


@dataclass
class Request:
    ids: list[str]
    status: int
    items: list[dict[str, Any]] = field(repr=False)


@dataclass
class RewardServer:
    answer: str = "rewards"  # "rewards", "results", or "alternate" (by request)
    flaky: float = 0.0
    broken: Callable[[dict[str, Any]], bool] | None = None
    broken_status: int = 500
    delay: Callable[[list[str]], float] | None = None
    metrics: bool = False  # results carry {"length": len(response)}
    token: str | None = None
    header: str = "Authorization"
    requests: list[Request] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""
    _seen: set[tuple[str, ...]] = field(default_factory=set)

    @property
    def served(self) -> list[Request]:
        return [r for r in self.requests if r.status == 200]

    def rewards(self) -> dict[str, float]:
        """Every id's reward as served (the last answer, if it was sent twice)."""
        return {i["id"]: exact(i["response"], i["label"]) for r in self.served for i in r.items}

    async def _score(self, request: web.Request) -> web.Response:
        if self.token is not None:
            want = (f"Bearer {self.token}" if self.header.lower() == "authorization"
                    else self.token)
            if request.headers.get(self.header) != want:
                return web.Response(status=401, text=f"{self.header}: not authorized")
        body = await request.json()
        items, ids = body["items"], [i["id"] for i in body["items"]]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay is not None:
                await asyncio.sleep(self.delay(ids))
            first = tuple(ids) not in self._seen
            self._seen.add(tuple(ids))
            if self.broken is not None and any(self.broken(i) for i in items):
                self.requests.append(Request(ids, self.broken_status, items))
                return web.Response(status=self.broken_status,
                                    text=f"grader crashed on {ids[0]}: boom")
            if first and share(ids) < self.flaky:
                self.requests.append(Request(ids, 503, items))
                return web.Response(status=503, text="busy, try again")
            self.requests.append(Request(ids, 200, items))
            rewards = [exact(i["response"], i["label"]) for i in items]
            form = (self.answer if self.answer != "alternate"
                    else ("rewards", "results")[len(self.requests) % 2])
            if form == "rewards":
                return web.json_response({"rewards": rewards})
            results = [{"id": i["id"], "reward": r,
                        **({"metrics": {"length": len(i["response"])}} if self.metrics else {})}
                       for i, r in zip(items, rewards, strict=True)]
            return web.json_response({"results": results[::-1]})  # any order, by id
        finally:
            self.in_flight -= 1

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/score", self._score)
        return app

    async def __aenter__(self) -> RewardServer:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/score"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()

    @contextmanager
    def in_thread(self) -> Iterator[str]:
        """Served from a thread's own event loop while the block runs; its url."""
        loop = asyncio.new_event_loop()
        ready, stop = threading.Event(), asyncio.Event()

        async def serve() -> None:
            async with self:
                ready.set()
                await stop.wait()

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        if not ready.wait(30):
            raise RuntimeError("the reward server did not start")
        try:
            yield self.url
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            loop.close()


@asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[RewardServer]:
    async with RewardServer(**kwargs) as server:
        yield server


def dumps(server: RewardServer) -> str:
    """The requests, one line each: for a failing test's message."""
    return "\n".join(json.dumps({"ids": r.ids, "status": r.status}) for r in server.requests)
