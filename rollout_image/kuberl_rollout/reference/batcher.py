"""Collects concurrent /generate requests into batches for the engine's worker thread.

The first waiting request opens a batch; requests arriving within `max_wait_s` (or already
queued while the previous batch ran) join it, up to `max_batch_size`. A batch runs to
completion before the next starts: batch-level, not token-level (continuous) batching, which
is enough for a reference engine and keeps the decode loop simple.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kuberl_rollout.reference.engine import GenRequest

RunBatch = Callable[[Sequence[GenRequest]], list[dict[str, Any]]]


class Batcher:
    def __init__(self, run: RunBatch, worker: Executor, *, max_batch_size: int = 256,
                 max_wait_s: float = 0.005) -> None:
        self.run = run
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.queue: asyncio.Queue[tuple[GenRequest, asyncio.Future[dict[str, Any]]]] = (
            asyncio.Queue())
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
            self.queue.put_nowait((req, futures[-1]))
        try:
            return list(await asyncio.gather(*futures))
        finally:  # a client that went away: the batcher skips prompts whose future is done
            for fut in futures:
                fut.cancel()

    async def _collect(self) -> list[tuple[GenRequest, asyncio.Future[dict[str, Any]]]]:
        batch = [await self.queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            if not self.queue.empty():
                batch.append(self.queue.get_nowait())
                continue
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except TimeoutError:
                break
        # A client that went away cancelled its future: don't spend compute on it.
        return [(req, fut) for req, fut in batch if not fut.done()]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self.worker, self.run,
                                                     [req for req, _ in batch])
            except Exception as exc:  # the whole batch failed: every caller sees why
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
