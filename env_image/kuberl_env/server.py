"""The environment service: one instance of the user's class per episode, behind
/reset, /step, /close and /health (the package docstring has the protocol).

Every call is safe to retry, since the client cannot tell a lost request from a lost answer:
an episode's reset and its latest step are kept as tasks, and a retry awaits the same task (a
call still running) or reads its outcome (one that ended, its error included); the user's code
never runs twice for one call. A client that gives up does not cancel the user's call
(`asyncio.shield`): its retry finds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kuberl_env import protocol
from kuberl_env.protocol import Sample, WireError, answer_to_wire, takes_seed

LOG = logging.getLogger("kuberl.env")
ENDED_KEPT = 4096  # ended episodes remembered, for an error that says how they ended


class CallError(Exception):
    """An answer other than 200: `status` and a message (the body's "error")."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class UserCodeFailed(CallError):
    """The environment's own code raised, or returned what cannot go over the wire."""

    def __init__(self, message: str) -> None:
        super().__init__(422, message)


@dataclass
class Episode:
    env: Any
    reset: asyncio.Task[Any]
    touched: float
    last_step: int = -1  # the index of the latest step started
    step: asyncio.Task[Any] | None = None


class EnvironmentServer:
    """`factory` makes one environment (the user's class); `name` is its import path, which
    every error names; episodes idle for `episode_timeout_s` are reaped."""

    def __init__(self, factory: Callable[[], Any], name: str, *,
                 episode_timeout_s: float = protocol.DEFAULT_EPISODE_TIMEOUT_S,
                 exit_with_parent: bool = False) -> None:
        self.factory, self.name = factory, name
        self.episode_timeout_s = episode_timeout_s
        self.episodes: dict[str, Episode] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # episode -> how it ended
        self.served = 0  # episodes reset here
        self._parent = os.getppid() if exit_with_parent else None
        self._reaper: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json])
        app.router.add_get(protocol.HEALTH, self.health)
        app.router.add_post(protocol.RESET, self.reset)
        app.router.add_post(protocol.STEP, self.step)
        app.router.add_post(protocol.CLOSE, self.close)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ------------------------------------------------------------------ handlers

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "class": self.name,
                                  "episodes": len(self.episodes)})

    async def reset(self, request: web.Request) -> web.Response:
        body = await _body(request)
        episode = _episode_id(body)
        sample, args, seed = body.get("sample"), body.get("args") or {}, body.get("seed")
        if not isinstance(sample, dict) or not isinstance(args, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in args.items()):
            raise CallError(400, "reset needs `sample` (an object) and `args` (strings)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise CallError(400, f"reset's `seed` must be an integer or null, got {seed!r}")
        ep = self.episodes.get(episode)
        if ep is None:
            if episode in self.ended:
                raise CallError(409, f"episode {episode!r} {self.ended[episode]}; a new "
                                "episode needs a new id")
            try:
                env = self.factory()
            except Exception as exc:
                raise UserCodeFailed(f"{self.name}() failed: {type(exc).__name__}: {exc}") \
                    from exc
            given = {"seed": seed} if takes_seed(env.reset) else {}
            ep = Episode(env, asyncio.ensure_future(env.reset(Sample(sample), **args,
                                                              **given)),
                         time.monotonic())
            self.episodes[episode] = ep
            self.served += 1
        observation = await self._outcome(ep, ep.reset, "reset")
        return web.json_response({"observation": observation})

    async def step(self, request: web.Request) -> web.Response:
        body = await _body(request)
        episode = _episode_id(body)
        index, ids, text = body.get("step"), body.get("action_ids"), body.get("action_text")
        if (not isinstance(index, int) or isinstance(index, bool) or index < 0
                or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids)
                or not isinstance(text, str)):
            raise CallError(400, "step needs `step` (an index from 0), `action_ids` (integers) "
                            "and `action_text` (a string)")
        ep = self._known(episode)
        if not ep.reset.done() or ep.reset.exception() is not None:
            raise CallError(409, f"episode {episode!r}: step before its reset has succeeded")
        if index == ep.last_step + 1:
            if ep.step is not None and not ep.step.done():
                raise CallError(409, f"episode {episode!r}: step {index} while step "
                                f"{ep.last_step} is still running")
            ep.last_step, ep.step = index, asyncio.ensure_future(ep.env.step(ids, text))
        elif index != ep.last_step or ep.step is None:
            raise CallError(409, f"episode {episode!r}: step {index} out of order (the "
                            f"latest step is {ep.last_step})")
        result = await self._outcome(ep, ep.step, "step")
        return web.json_response({"result": result})

    async def close(self, request: web.Request) -> web.Response:
        episode = _episode_id(await _body(request))
        ep = self.episodes.pop(episode, None)
        if ep is None:
            return web.json_response({"closed": False, "episode": episode})
        self._ended(episode, "was closed")
        await self._close(ep, episode)
        return web.json_response({"closed": True, "episode": episode})

    # ------------------------------------------------------------------ episodes

    def _known(self, episode: str) -> Episode:
        ep = self.episodes.get(episode)
        if ep is None:
            how = self.ended.get(episode, "is unknown here (never reset on this replica)")
            raise CallError(404, f"episode {episode!r} {how}")
        ep.touched = time.monotonic()
        return ep

    async def _outcome(self, ep: Episode, task: asyncio.Task[Any], call: str) -> Any:
        """The call's answer as JSON, or its error (422), however often it is asked."""
        ep.touched = time.monotonic()
        try:
            value = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the request itself was cancelled, not the call
            raise UserCodeFailed(f"{self.name}.{call} was cancelled (its episode was "
                                 "closed)") from None
        except Exception as exc:
            raise UserCodeFailed(f"{self.name}.{call} failed: {type(exc).__name__}: {exc}") \
                from exc
        finally:
            ep.touched = time.monotonic()
        try:
            return answer_to_wire(value, f"{self.name}.{call}")
        except WireError as exc:
            raise UserCodeFailed(str(exc)) from None

    async def _close(self, ep: Episode, episode: str) -> None:
        for task in (ep.reset, ep.step):  # a call nobody waits for any more
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*(t for t in (ep.reset, ep.step) if t is not None),
                             return_exceptions=True)
        try:
            await ep.env.close()
        except Exception as exc:
            raise UserCodeFailed(f"{self.name}.close failed: {type(exc).__name__}: {exc}") \
                from exc

    def _ended(self, episode: str, how: str) -> None:
        self.ended[episode] = how
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def reap(self) -> int:
        """Close the episodes nobody asked about for longer than the timeout, a call still
        running included (a hung step whose client gave up: every retry of a call touches
        its episode, so a call only its client still waits for is never reaped); returns
        how many."""
        now = time.monotonic()
        idle = [e for e, ep in self.episodes.items() if now - ep.touched > self.episode_timeout_s]
        for episode in idle:
            ep = self.episodes.pop(episode)
            self._ended(episode, f"was closed after {self.episode_timeout_s:g} s idle")
            try:
                await self._close(ep, episode)
            except CallError as exc:
                LOG.warning("reaping episode %s: %s", episode, exc.message)
        if idle:
            LOG.info("closed %d episodes idle for %g s", len(idle), self.episode_timeout_s)
        return len(idle)

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(self.episode_timeout_s / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            if self._parent is not None and os.getppid() != self._parent:
                LOG.warning("the process that started this server is gone: exiting")
                os._exit(0)
            await self.reap()

    async def _start(self, _: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="kuberl_env reaper")

    async def _stop(self, _: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        left = len(self.episodes)
        LOG.info("served %d episodes (%s)", self.served,
                 f"{left} still open: closing them" if left else "all closed")
        for episode in list(self.episodes):
            ep = self.episodes.pop(episode)
            try:
                await self._close(ep, episode)
            except CallError as exc:
                LOG.warning("closing episode %s at shutdown: %s", episode, exc.message)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CallError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise CallError(400, "the body must be a JSON object")
    return body


def _episode_id(body: dict[str, Any]) -> str:
    episode = body.get("episode")
    if not isinstance(episode, str) or not episode or len(episode) > 256:
        raise CallError(400, "`episode` must be a non-empty string (the client's episode id)")
    return episode


@web.middleware
async def _errors_as_json(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """Every error as {"error", "call"} JSON, never aiohttp's HTML page; a bug here is 500."""
    call = request.path.strip("/")
    try:
        return await handler(request)
    except CallError as exc:
        if exc.status == 422:
            LOG.warning("%s: %s", call, exc.message)
        return web.json_response({"error": exc.message, "call": call}, status=exc.status)
    except web.HTTPException as exc:
        return web.json_response({"error": exc.reason, "call": call}, status=exc.status)
    except Exception as exc:
        LOG.exception("%s failed", call)
        return web.json_response({"error": f"{type(exc).__name__}: {exc}", "call": call},
                                 status=500)
