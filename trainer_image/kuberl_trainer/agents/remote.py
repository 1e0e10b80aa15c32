"""Environments as services (environment.image): the same protocol as an in-process
environment, over HTTP to `python -m kuberl_env` (env_image/kuberl_env), so `run_episode`
runs a remote environment unchanged.

- One episode, one replica: an `http://` URL's host is resolved (a headless Service's name
  gives every ready replica's address) and each episode goes to the replica with the fewest
  open episodes; its reset may move to another replica while nothing exists yet, its steps
  and close never do. An `https://` URL, or an address, is used as it is.
- Every call has a timeout (environment.timeoutSeconds) and is retried with backoff only
  when the answer is lost or the server failed (a transport error, a timeout, a 5xx): the
  server answers a retried call from what the first one did (episode ids are ours, steps
  carry their index). The environment's own errors (4xx) are never retried.
- A call that still fails raises `EnvironmentFailure` naming the call and the URL, never a
  reward of 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import logging
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kuberl_env import protocol
from kuberl_env.protocol import WireError, sample_to_wire
from kuberl_trainer.agents.environment import EnvironmentFailure

LOG = logging.getLogger("kuberl.environment")
DEFAULT_TIMEOUT_S = 60.0
RETRIES = 3  # after the first try: 4 tries in all
BACKOFF_S = 0.5  # doubled after each try
RESOLVE_TTL_S = 5.0  # replicas come and go (readiness): resolved again after this long


class EnvironmentUnavailable(EnvironmentFailure):
    """The environment service cannot be reached (before a run starts, or at all)."""


class EnvironmentService:
    """The environment service at `url`; calling it makes one environment (an episode), as
    calling an environment class does. `name`: the class the service serves (errors name it)."""

    def __init__(self, url: str, *, name: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = RETRIES, backoff_s: float = BACKOFF_S,
                 resolve_ttl_s: float = RESOLVE_TTL_S) -> None:
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EnvironmentUnavailable(f"environment service URL {url!r} must look like "
                                         "http://host:port")
        self.url, self.name = url.rstrip("/"), name
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = parts.path  # before the protocol's paths (a service behind a prefix)
        self.resolves = parts.scheme == "http" and not _is_address(self.host)
        self.resolve_ttl_s = resolve_ttl_s
        self.open: Counter[str] = Counter()  # open episodes per replica URL
        self._replicas = [] if self.resolves else [f"{parts.scheme}://{parts.netloc}"]
        self._resolved_at = -float("inf")
        self._turn = itertools.count()

    def __call__(self) -> RemoteEnvironment:
        return RemoteEnvironment(self)

    def __repr__(self) -> str:
        return f"EnvironmentService({self.url!r}, {self.name!r})"

    async def replicas(self) -> list[str]:
        """The replicas' URLs (an `http://` host resolved at most every resolve_ttl_s)."""
        if not self.resolves or time.monotonic() - self._resolved_at < self.resolve_ttl_s:
            return self._replicas
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectionError(f"{self.host} does not resolve ({exc}): no replica of the "
                                  "environment service is ready") from None
        addresses = sorted({str(info[4][0]) for info in infos})
        self._replicas = [_with_address(self.url, a, self.port) for a in addresses]
        self._resolved_at = time.monotonic()
        return self._replicas

    async def pick(self, avoid: str | None = None) -> str:
        """The replica for a new episode: the fewest open episodes, in turn among equals;
        `avoid` (one that just failed) only when it is the only one."""
        replicas = await self.replicas()
        if not replicas:
            raise ConnectionError(f"no replica of the environment service at {self.url}")
        choices = [r for r in replicas if r != avoid] or replicas
        turn = next(self._turn)
        return min(choices, key=lambda r: (self.open[r], (choices.index(r) - turn)
                                           % len(choices)))

    def headers(self) -> dict[str, str]:
        """The Host a resolved replica is asked under (the name, not its address)."""
        return {"Host": f"{self.host}:{self.port}"} if self.resolves else {}

    def wait_ready(self, timeout_s: float, interval_s: float = 0.5) -> None:
        """Block until GET /health answers 200 (some replica is ready), at most `timeout_s`;
        EnvironmentUnavailable with the last error otherwise."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                with urllib.request.urlopen(self.url + protocol.HEALTH,
                                            timeout=max(1.0, interval_s * 4)) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if time.monotonic() >= deadline:
                raise EnvironmentUnavailable(
                    f"the environment service for {self.name} at {self.url} is not ready "
                    f"after {timeout_s:g} s ({protocol.HEALTH}: {last})")
            time.sleep(interval_s)


class RemoteEnvironment:
    """One episode on one replica of an environment service."""

    def __init__(self, service: EnvironmentService) -> None:
        self.service = service
        self.episode = uuid.uuid4().hex
        self.replica: str | None = None  # pinned by the reset
        self.steps = 0
        self._unreachable = False  # a call's retries ran out
        self._session: aiohttp.ClientSession | None = None

    async def reset(self, sample: Any, *, seed: int | None = None, **args: str) -> Any:
        """`seed`: the trajectory's; the server gives it to a reset that takes one."""
        try:
            wire = sample_to_wire(sample)
        except WireError as exc:
            raise EnvironmentFailure(f"{self.service.name}.reset: {exc}") from None
        body = {"episode": self.episode, "sample": wire, "args": dict(args), "seed": seed}
        out = await self._call(protocol.RESET, body, movable=True)
        return out.get("observation")

    async def step(self, action_ids: list[int], action_text: str) -> Any:
        body = {"episode": self.episode, "step": self.steps,
                "action_ids": [int(t) for t in action_ids], "action_text": action_text}
        out = await self._call(protocol.STEP, body)
        self.steps += 1
        if not isinstance(out.get("result"), Mapping):
            raise EnvironmentFailure(f"{self.service.name}.step at {self.replica}: the "
                                     f"answer has no result ({str(out)[:200]})")
        return out["result"]

    async def close(self) -> None:
        """Close the episode on its replica. Once the retries are spent the replica is
        left to drop it (it closes idle episodes), so a lost answer never fails a run; an
        error of the environment's own close does, as in process. After a call that found
        the replica unreachable, no close is tried (it would only wait out the same retries)."""
        try:
            if self.replica is not None and not self._unreachable:
                try:
                    await self._call(protocol.CLOSE, {"episode": self.episode})
                except EnvironmentUnavailable as exc:
                    LOG.warning("%s (the replica drops the episode when it has been idle "
                                "long enough)", exc)
        finally:
            if self.replica is not None:
                self.service.open[self.replica] -= 1
                self.replica = None
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def _call(self, path: str, body: Mapping[str, Any], *,
                    movable: bool = False) -> dict[str, Any]:
        """POST `body` to the episode's replica: its JSON answer, retried as the module
        docstring says. `movable`: a reset, which may go to another replica when one fails."""
        svc, call = self.service, path.strip("/")
        last, tries = "", svc.retries + 1
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(svc.backoff_s * 2 ** (attempt - 1))
            try:
                if self.replica is None or (movable and attempt):
                    self._pin(await svc.pick(avoid=self.replica))
                assert self.replica is not None
                answered = await self._post(self.replica + svc.path + path, body)
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                last = (f"no answer within {svc.timeout_s:g} s" if isinstance(exc, TimeoutError)
                        else f"{type(exc).__name__}: {exc}")
                continue
            status, text = answered
            message = _error_message(text)
            if status < 400:
                try:
                    out = json.loads(text)
                except json.JSONDecodeError:
                    out = None
                if isinstance(out, dict):
                    return out
                last = f"HTTP {status} with a body that is not a JSON object: {text[:200]!r}"
            elif status >= 500:
                last = f"HTTP {status}: {message}"
            else:  # the environment's own error, or a request it refuses: never retried
                raise EnvironmentFailure(f"{svc.name}.{call} at {self.replica}: {message}")
        where = self.replica or svc.url
        self._unreachable = True
        raise EnvironmentUnavailable(f"{svc.name}.{call}: the environment service at {where} "
                                     f"failed {tries} times; the last: {last}")

    def _pin(self, replica: str) -> None:
        if self.replica is not None:
            self.service.open[self.replica] -= 1
        self.replica = replica
        self.service.open[replica] += 1

    async def _post(self, url: str, body: Mapping[str, Any]) -> tuple[int, str]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.service.timeout_s))
        async with self._session.post(url, json=body, headers=self.service.headers()) as resp:
            return resp.status, await resp.text()


def _error_message(text: str) -> str:
    """The server's `error`, or the start of whatever else came back."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300] or "no body"
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return text.strip()[:300]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _with_address(url: str, address: str, port: int) -> str:
    """`url` (scheme, host, port, no path) with its host replaced by `address`."""
    host = f"[{address}]" if ":" in address else address
    return f"{urlsplit(url).scheme}://{host}:{port}"
