"""SGLang's router (the `sglang-router` package) in front of the engines, for generation only.

`rollout.router: sglang` starts one router process where the training loop runs (the Ray head,
or the local machine), bound to 127.0.0.1: the loop is its only client. Generate requests go
through it; weight updates, pause/continue and memory calls still go to every engine directly
(the router proxies none of them).

How kuberl uses it, and why (measured against sglang-router 0.3.2, docs/design-notes.md):
- The `manual` policy with a routing key per GRPO group (the `X-SMG-Routing-Key` header) keeps
  a group's samples on one engine (its prompt's prefix cache), and `min_load` gives a new key
  to the engine with the fewest requests. The router refuses SGLang's batched form with one
  sampling_params per prompt, so each sample is its own request, with its own seed.
- The fleet (fleet.py) stays the only judge of an engine's health: the router's own health
  checks and circuit breaker are off (a paused engine's 503s would otherwise trip it). An
  engine the fleet takes out is removed from the router (no new request goes to it) and its
  server killed: the router then sends the requests it had in flight to another engine, where
  their seeds make the same samples.
- Its request timeout is the client's, so a request is never sent twice because the router
  gave up on it first.
"""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from kuberl_trainer.engines.client import EngineClient, EngineError
from kuberl_trainer.ray_actors import free_port

START_TIMEOUT_S = 60.0


def router_command(urls: Sequence[str], *, port: int, prometheus_port: int,
                   request_timeout_s: float) -> list[str]:
    """The router's command line (pure: what `Router.start` runs)."""
    return [sys.executable, "-m", "sglang_router.launch_router",
            "--worker-urls", *urls,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--policy", "manual", "--assignment-mode", "min_load",
            "--disable-health-check", "--disable-circuit-breaker",
            "--request-timeout-secs", str(max(1, math.ceil(request_timeout_s))),
            "--log-level", "warn"]


class Router:
    """One router process and the engines registered with it."""

    def __init__(self, client: EngineClient, *, log: Path | None = None) -> None:
        self.client = client
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start it with the client's engines and wait until every one is registered."""
        cmd = router_command(self.client.live(), port=self.port, prometheus_port=free_port(),
                             request_timeout_s=self.client.request_timeout_s)
        sink: IO[bytes] | int = (self._log.open("ab") if self._log is not None
                                 else subprocess.DEVNULL)
        try:
            self._proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        finally:  # (the router writes to its own copy of the file)
            if not isinstance(sink, int):
                sink.close()
        await self.wait_for(set(self.client.live()), timeout_s)

    async def workers(self) -> dict[str, str]:
        """Engine URL -> the router's id for it."""
        answer = await self.client.request(self.url, "GET", "/workers", timeout_s=10)
        return {w["url"].rstrip("/"): w["id"] for w in answer["workers"]}

    async def wait_for(self, urls: set[str], timeout_s: float) -> None:
        """Until the router's engines are exactly `urls` (registration is asynchronous)."""
        deadline = time.monotonic() + timeout_s
        last = "not started"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise EngineError(self.url, f"the router exited with code {self._proc.poll()}"
                                  f"{self._log_hint()}")
            try:
                have = set(await self.workers())
                if have == urls:
                    return
                last = f"has {sorted(have)}"
            except EngineError as exc:
                last = exc.message
            if time.monotonic() > deadline:
                raise EngineError(self.url, f"the router did not register {sorted(urls)} "
                                  f"within {timeout_s:g}s ({last}){self._log_hint()}")
            await asyncio.sleep(0.1)

    async def remove(self, url: str) -> None:
        """No new request goes to `url` once this returns."""
        ids = await self.workers()
        if url in ids:
            await self.client.request(self.url, "DELETE", f"/workers/{ids[url]}", timeout_s=10)
            await self.wait_for(set(ids) - {url}, START_TIMEOUT_S)

    async def add(self, url: str) -> None:
        """Route to `url` (an engine answering /health) from when this returns."""
        ids = await self.workers()
        if url not in ids:
            await self.client.request(self.url, "POST", "/workers", {"url": url}, timeout_s=10)
            await self.wait_for(set(ids) | {url}, START_TIMEOUT_S)

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def _log_hint(self) -> str:
        return f" (its log: {self._log})" if self._log is not None else ""
