"""The colocated step's memory handoff between engines and trainers (placement: colocate).

Colocated engines and training ranks share GPUs. An SGLang engine holds its static pool
(weights, KV cache, CUDA graphs: `--mem-fraction-static` of each GPU) until told otherwise, and
a training rank holds its weights and optimizer state; neither phase fits beside the other's
peak for a model of real size. So every step moves memory, in slime's order
(`--offload-rollout`, `--offload-train`):

1. sampling done: every engine releases all of its pool (`/release_memory_occupation`, no
   tags), and the training ranks (a shared critic too) bring back what they offloaded; the
   reference and critic passes and training then have the GPU;
2. training done: the ranks offload the optimizer's state (`training.offload.optimizer`);
3. engines take back their weights' memory (`tags: ["weights"]`), which the sync fills (CUDA
   IPC per TP rank);
4. sync done: the ranks offload their weights (`training.offload.weights`), and the engines
   take back the KV cache and CUDA graphs, ready to generate.

Before the first step (Session.start): the engines start alone on their GPUs, as each sizes
its pool from the memory free when it starts (SGLang: mem_fraction_static x free, less the
weights), then release all of it (`release_engines`); the training ranks build their models
in the room; then 3 and 4 as after a step: the engines get back the weights' memory and the
trainers' weights (SGLang discards released weights), then their cache. Checkpoints are
written after training, before 2, while the trainers hold their GPUs; the save at a run's end
comes after another `release_engines`.

Each transition is one call from the loop (2 to 4) or from the rollout manager once the
step's sampling is over (1). Their seconds go into the step's metrics: `time_offload_s`
(releases and offloads) and `time_onload_s` (onloads and resumes); `offload_gib` is what the
training ranks freed. Disaggregated engines have GPUs of their own: every call does nothing.
With LoRA's sync: adapter (`keep_weights`) the engines' base weights stay resident throughout:
0 and 1 release only the cache and graphs, 3 does nothing, and 4 takes back the cache.
The same calls run on CPU, where nothing is freed but the reference engine records each
request (GET /get_event_log), so a CPU test checks the order a GPU run depends on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from kuberl_api.spec import OffloadSpec
from kuberl_trainer.engines.client import EngineClient
from kuberl_wire.protocol import memory_occupation

WEIGHTS = ("weights",)
CACHE_AND_GRAPHS = ("kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_TYPE_* besides weights
GIB = float(1 << 30)


class Ranks(Protocol):
    """A group of training (or shared critic) ranks: TrainGroup, CriticGroup."""

    def offload(self, *, optimizer: bool, weights: bool) -> int: ...
    def onload(self) -> None: ...


class MemoryHandoff:
    """`offload`: what training ranks offload (the spec's trainer_offload); None turns the
    handoff off (disaggregated). `ranks`: the groups sharing the engines' GPUs (set once they
    exist: the engines release their memory before the ranks are built)."""

    def __init__(self, client: EngineClient, aio: asyncio.AbstractEventLoop,
                 ranks: list[Ranks], offload: OffloadSpec | None, *,
                 keep_weights: bool = False) -> None:
        self.client, self.aio, self.ranks, self.offload = client, aio, ranks, offload
        # The engines keep their weights resident (LoRA's sync: adapter: the base never
        # changes, and a sync sends no weights to make room for): only the cache and graphs
        # move, released in 0 and 1 and taken back in 4; 3 does nothing
        self.released = CACHE_AND_GRAPHS if keep_weights else None
        self.times = {"time_offload_s": 0.0, "time_onload_s": 0.0}
        self.freed = 0

    @property
    def on(self) -> bool:
        return self.offload is not None

    async def _post(self, path: str, tags: tuple[str, ...] | None) -> None:
        await self.client.post_all(path, memory_occupation(tags), in_step=True)

    def _engines(self, path: str, tags: tuple[str, ...] | None) -> None:
        self.aio.run_until_complete(self._post(path, tags))

    def _timed(self, key: str, started: float) -> None:
        self.times[key] += time.perf_counter() - started

    def release_engines(self) -> None:
        """0: the engines, started alone, release everything before the ranks are built (and
        at a run's end, before the trainers' last save)."""
        if not self.on:
            return
        started = time.perf_counter()
        self._engines("/release_memory_occupation", self.released)
        self._timed("time_offload_s", started)

    async def to_trainers(self) -> None:
        """1: sampling is over; the GPUs go to the training ranks. (A coroutine: the rollout
        manager calls it on the engine client's loop. The onload blocks that loop, which has
        nothing else to do until the trainers' passes.)"""
        if not self.on:
            return
        started = time.perf_counter()
        await self._post("/release_memory_occupation", self.released)
        self._timed("time_offload_s", started)
        started = time.perf_counter()
        for group in self.ranks:
            group.onload()
        self._timed("time_onload_s", started)

    def trained(self) -> None:
        """2: the optimizer's state leaves the GPU until the next step's training."""
        if self.offload is None or not self.offload.optimizer:
            return
        started = time.perf_counter()
        self.freed += sum(group.offload(optimizer=True, weights=False) for group in self.ranks)
        self._timed("time_offload_s", started)

    def before_sync(self) -> None:
        """3: room for the weights the sync writes into the engines."""
        if not self.on or self.released is not None:
            return
        started = time.perf_counter()
        self._engines("/resume_memory_occupation", WEIGHTS)
        self._timed("time_onload_s", started)

    def to_engines(self) -> None:
        """4: the training ranks' weights leave; the engines' cache comes back."""
        if self.offload is None:
            return
        started = time.perf_counter()
        if self.offload.weights:
            self.freed += sum(group.offload(optimizer=False, weights=True)
                              for group in self.ranks)
        self._timed("time_offload_s", started)
        started = time.perf_counter()
        self._engines("/resume_memory_occupation", CACHE_AND_GRAPHS)
        self._timed("time_onload_s", started)

    def step_metrics(self) -> dict[str, float]:
        """This step's handoff metrics (then reset for the next)."""
        out = {**self.times, "offload_gib": self.freed / GIB} if self.on else {}
        self.times = dict.fromkeys(self.times, 0.0)
        self.freed = 0
        return out
