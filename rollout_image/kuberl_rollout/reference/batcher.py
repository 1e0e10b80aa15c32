"""Feeds concurrent /generate requests to the engine's running batch, one step at a time.

Continuous (token-level) batching, as SGLang's scheduler does it: the engine's running batch
advances one token per step (engine.step, on the worker thread), and before each step the
batcher admits waiting requests into it, up to `max_batch_size` running and
`max_prefill_tokens` prompt tokens a step (at least one request), in arrival order; finished
requests leave after the step that finished them and their callers are answered then. A
request arriving while a batch runs therefore starts at the next step, not when the batch in
flight ends. When the engine is idle, the first request waits `max_wait_s` for others, so a
burst of single requests starts as one prefill.

Each step is a job of its own on the worker thread, so the other work queued there (weight
updates, checksums, memory moves) runs between two steps, as SGLang's scheduler handles its
requests between forward batches.

`join_running=False` admits requests only into an empty batch: batch-level batching (every
batch runs to completion before the next starts), kept for models whose cache cannot take
rows mid-batch (kv_batch.joinable) and to compare against (bench/engine_batching.py).

With LoRA (`max_adapters`: SGLang's --max-loras-per-batch), a request joins only while the
running batch's distinct adapters, the base model counted as one, stay within the bound; the
first that would exceed it waits, and those behind it too (SGLang's scheduler stops there).

A pause (server.py) suspends the loop: the running requests stop after the current step and
are held, with their progress, until the loop resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kuberl_rollout.reference.engine import GenRequest, Step

RunStep = Callable[[Sequence[GenRequest], Sequence[GenRequest]], Step]
Item = tuple[GenRequest, "asyncio.Future[dict[str, Any]]"]


class Batcher:
    """Also the engine's queues as SGLang's scheduler has them: `waiting` (not started, or
    retracted and due to resume first), `held` (suspended by a pause: they resume after
    /continue_generation) and `running` (in the engine's running batch)."""

    def __init__(self, step: RunStep, worker: Executor, *, max_batch_size: int = 256,
                 max_wait_s: float = 0.005, max_prefill_tokens: int = 16384,
                 join_running: bool = True, max_adapters: int | None = None) -> None:
        self.step = step
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_prefill_tokens = max_prefill_tokens
        self.join_running = join_running
        self.max_adapters = max_adapters
        self.waiting: deque[Item] = deque()
        self.held: list[Item] = []
        self._running: dict[int, Item] = {}  # id(req): the running requests, in join order
        self.suspended = False
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> list[GenRequest]:
        return [req for req, _ in self._running.values()]

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
        finally:  # a client that went away: its prompts leave the batch at the next step
            for fut in futures:
                fut.cancel()

    # ---- pause / continue -------------------------------------------------------------------

    def suspend(self) -> None:
        """Admit nothing until resume(); the running requests are handed back at the next
        step (the engine's suspend flag, set with this)."""
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

    async def _wait_for_work(self) -> None:
        """Until requests may start; then, the engine being idle, `max_wait_s` for more to
        arrive (or until a full batch waits)."""
        while self.suspended or not self.waiting:
            self._wakeup.clear()
            await self._wakeup.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(self.waiting) < self.max_batch_size and (left := deadline - loop.time()) > 0:
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), left)

    def _admit(self) -> list[Item]:
        """The waiting requests that join at the next step, in arrival order."""
        if self.suspended or (self._running and not self.join_running):
            return []
        joining: list[Item] = []
        tokens = 0
        adapters = {req.lora_id for req, _ in self._running.values()}
        while self.waiting and len(self._running) + len(joining) < self.max_batch_size:
            req, fut = self.waiting[0]
            if fut.done():  # its caller went away: don't spend compute on it
                self.waiting.popleft()
                continue
            size = len(req.input_ids) + len(req.output_ids)
            if joining and tokens + size > self.max_prefill_tokens:
                break
            if (self.max_adapters is not None
                    and len(adapters | {req.lora_id}) > self.max_adapters):
                break
            adapters.add(req.lora_id)
            joining.append(self.waiting.popleft())
            tokens += size
        return joining

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running:
                await self._wait_for_work()
            joining = self._admit()
            if not joining and not self._running:
                continue
            gone = [req for req, fut in self._running.values() if fut.done()]
            for req in gone:
                del self._running[id(req)]
            self._running.update((id(item[0]), item) for item in joining)
            try:
                out = await loop.run_in_executor(self.worker, self.step,
                                                 [req for req, _ in joining], gone)
            except Exception as exc:  # the running batch failed: every caller in it sees why
                for _, fut in self._running.values():
                    if not fut.done():
                        fut.set_exception(exc)
                self._running.clear()
                continue
            for req, result in out.finished:
                _, fut = self._running.pop(id(req))
                if not fut.done():
                    fut.set_result(result)
            suspended = [self._running.pop(id(req)) for req in out.suspended]
            suspended = [item for item in suspended if not item[1].done()]
            if self.suspended:
                self.held.extend(suspended)
            elif suspended:  # continued before the step noticed the pause: they go first
                self.waiting.extendleft(reversed(suspended))
