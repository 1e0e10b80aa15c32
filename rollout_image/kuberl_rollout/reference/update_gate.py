"""SGLang's `model_update_lock`: a weight update does not run beside requests in flight.

SGLang 0.5.6's tokenizer manager holds a writer-preferring read-write lock: every /generate
holds it to read until its answer, and a weight update that finds generation unpaused takes
it to write, so it waits for the requests in flight to finish while new ones wait for it
(`update_weights_from_distributed`, `update_weights_from_tensor`: "weight sync cannot run
while requests are in progress"). While generation is paused the update runs at once (the
trainer's sequence: pause, flush, update, continue). The reference engine steps its running
batch as separate jobs on its worker thread (batcher.py), so without this gate an update
would land between two steps of a running request and give it tokens of two weight versions.
A pause that comes while an update waits lets it go too (SGLang's would wait for the
continue: the requests it holds are still in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class UpdateGate:
    def __init__(self, paused: Callable[[], bool]) -> None:
        self._paused = paused
        self._changed = asyncio.Condition()
        self._readers = 0
        self._writers = 0  # waiting or writing

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Held by a /generate for as long as it is in flight."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Held by a weight update (or a memory release) while it runs: once no /generate is
        in flight, or at once while generation is paused."""
        async with self._changed:
            self._writers += 1
            try:
                await self._changed.wait_for(lambda: self._readers == 0 or self._paused())
            except BaseException:
                self._writers -= 1
                self._changed.notify_all()
                raise
        try:
            yield
        finally:
            async with self._changed:
                self._writers -= 1
                self._changed.notify_all()

    async def paused(self) -> None:
        """Generation was paused: updates waiting for requests in flight go now."""
        async with self._changed:
            self._changed.notify_all()
