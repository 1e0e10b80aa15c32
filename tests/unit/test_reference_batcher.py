"""The reference engine's batcher when a client goes away while its request is in the running
batch (a closed connection, a trainer that gave up): the batch finishes, the others in it get
their answers, and the engine goes on serving."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kuberl_rollout.reference.batcher import Batcher


async def test_a_caller_gone_mid_batch_leaves_the_others_answered() -> None:
    release = threading.Event()

    def run(batch: Sequence[Any]) -> list[dict[str, Any] | None]:
        release.wait(timeout=10)  # the batch is on the worker thread until released
        return [{"rid": req} for req in batch]

    with ThreadPoolExecutor(1) as worker:
        batcher = Batcher(run, worker, max_wait_s=0.05)  # type: ignore[arg-type]
        batcher.start()
        try:
            gone = asyncio.create_task(batcher.submit("gone"))  # type: ignore[arg-type]
            stays = asyncio.create_task(batcher.submit("stays"))  # type: ignore[arg-type]
            for _ in range(200):
                if len(batcher.running) == 2:
                    break
                await asyncio.sleep(0.01)
            assert batcher.running == ["gone", "stays"]
            gone.cancel()
            await asyncio.sleep(0.05)
            release.set()
            assert await asyncio.wait_for(stays, 10) == {"rid": "stays"}
            assert gone.cancelled()
            answer = await asyncio.wait_for(batcher.submit("next"), 10)  # type: ignore[arg-type]
            assert answer == {"rid": "next"}
        finally:
            release.set()
            await batcher.stop()
