"""Collects concurrent /generate requests into batches for the engine's worker thread.

The first waiting request opens a batch; requests arriving within `max_wait_s` (or already
queued while the previous batch ran) join it, up to `max_batch_size`. A batch runs to
completion before the next starts: batch-level, not token-level (continuous) batching, which
is enough for a reference engine and keeps the decode loop simple.

A pause (server.py) suspends the loop: the running batch stops after its current step and its
unfinished requests are held, with their progress, until the loop resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kuberl_rollout.reference.engine import GenRequest

RunBatch = Callable[[Sequence[GenRequest]], list[dict[str, Any] | None]]
Item = tuple[GenRequest, "asyncio.Future[dict[str, Any]]"]


class Batcher:
    """Also the engine's queues as SGLang's scheduler has them: `waiting` (not started, or
    retracted and due to resume first), `held` (suspended by a pause: they resume after
    /continue_generation) and `running` (the batch on the worker thread)."""

    def __init__(self, run: RunBatch, worker: Executor, *, max_batch_size: int = 256,
                 max_wait_s: float = 0.005) -> None:
        self.run = run
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.waiting: deque[Item] = deque()
        self.held: list[Item] = []
        self.running: list[GenRequest] = []
        self.suspended = False
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, req: GenRequest) -> dict[str, Any]:
        return (await self.submit_many([req]))[0]

    async def submit_many(self, reqs: Sequence[GenRequest]) -> list[dict[str, Any]]:
        """Queue a batched request's prompts together (plain futures, no task per prompt:
        a 256-prompt request would otherwise spend milliseconds creating tasks)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[dict[str, Any]]] = []
        for req in reqs:
            futures.append(loop.create_future())
            self.waiting.append((req, futures[-1]))
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*futures))
        finally:  # a client that went away: the batcher skips prompts whose future is done
            for fut in futures:
                fut.cancel()

    # ---- pause / continue -------------------------------------------------------------------

    def suspend(self) -> None:
        """Start no batch until resume(); the running one hands back what it suspends."""
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False
        self.waiting.extendleft(reversed(self.held))  # suspended requests go first
        self.held.clear()
        self._wakeup.set()

    def abort_waiting(self, match: Callable[[GenRequest], bool],
                      answer: Callable[[GenRequest], dict[str, Any]]) -> int:
        """Answer not-running requests that `match` (waiting or held) with `answer(req)`, as
        SGLang's abort answers queued requests at once. Returns how many."""
        n = 0
        for queue in (self.waiting, self.held):
            keep = [(req, fut) for req, fut in queue if not fut.done() and not match(req)]
            for req, fut in queue:
                if not fut.done() and match(req):
                    fut.set_result(answer(req))
                    n += 1
            queue.clear()
            queue.extend(keep)
        return n

    def num_waiting(self) -> int:
        return sum(1 for _, fut in self.waiting if not fut.done())

    def num_held(self) -> int:
        return sum(1 for _, fut in self.held if not fut.done())

    # ---- the loop ---------------------------------------------------------------------------

    async def _take(self, timeout: float | None) -> Item | None:
        """The next waiting item once batches may start; None after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.suspended or not self.waiting:
            self._wakeup.clear()
            if deadline is None:
                await self._wakeup.wait()
                continue
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return None
        return self.waiting.popleft()

    async def _collect(self) -> list[Item]:
        first = await self._take(None)
        assert first is not None
        batch = [first]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            item = await self._take(max(0.0, deadline - loop.time()))
            if item is None:
                break
            batch.append(item)
        # A client that went away cancelled its future: don't spend compute on it.
        return [(req, fut) for req, fut in batch if not fut.done()]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            self.running = [req for req, _ in batch]
            try:
                results = await loop.run_in_executor(self.worker, self.run, self.running)
            except Exception as exc:  # the whole batch failed: every caller sees why
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            finally:
                self.running = []
            suspended = []
            for item, result in zip(batch, results, strict=True):
                if item[1].done():
                    continue
                if result is None:
                    suspended.append(item)
                else:
                    item[1].set_result(result)
            if self.suspended:
                self.held.extend(suspended)
            else:  # continued before the batch noticed the pause: run them again first
                self.waiting.extendleft(reversed(suspended))
                self._wakeup.set()
