"""The colocated step's memory handoff between engines and trainers (placement: colocate).

Colocated engines and training ranks share GPUs. An SGLang engine holds its static pool
(weights, KV cache, CUDA graphs: `--mem-fraction-static` of each GPU) until told otherwise, so
the training phase would run in what the pool leaves. Around training the loop therefore moves
memory, in slime's order (`--offload-rollout`):

1. after generation: every engine releases all of it (`/release_memory_occupation`, no tags);
2. training runs with the GPU to itself;
3. before the weight sync: engines take back their weights' memory (`tags: ["weights"]`),
   which the update then fills (by CUDA IPC, per TP rank);
4. after it: engines take back the KV cache and CUDA graphs, and generate again.

Each transition is one call from the loop; its seconds go into the step's metrics
(time_offload_s: 1, time_onload_s: 3 + 4). Disaggregated engines have GPUs of their own: the
handoff does nothing there. The same calls run on CPU (the reference engine records them:
GET /get_event_log), so a CPU test checks the order a GPU run depends on.
"""

from __future__ import annotations

import asyncio
import time

from kuberl_trainer.engine_client import EngineClient
from kuberl_wire.protocol import memory_occupation

WEIGHTS = ("weights",)
CACHE_AND_GRAPHS = ("kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_TYPE_* besides weights


class MemoryHandoff:
    def __init__(self, client: EngineClient, aio: asyncio.AbstractEventLoop, *,
                 colocated: bool) -> None:
        self.client, self.aio, self.on = client, aio, colocated

    def _post(self, path: str, tags: tuple[str, ...] | None) -> float:
        if not self.on:
            return 0.0
        started = time.perf_counter()
        self.aio.run_until_complete(self.client.post_all(path, memory_occupation(tags),
                                                         in_step=True))
        return time.perf_counter() - started

    def engines_release(self) -> float:
        """After generation: the engines' whole static pool goes back to the GPU."""
        return self._post("/release_memory_occupation", None)

    def engines_take_weights(self) -> float:
        """Before the weight sync: room for the weights it writes."""
        return self._post("/resume_memory_occupation", WEIGHTS)

    def engines_take_cache(self) -> float:
        """After the sync: the KV cache and CUDA graphs, so generation can start."""
        return self._post("/resume_memory_occupation", CACHE_AND_GRAPHS)
