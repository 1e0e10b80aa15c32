"""The colocated update across training ranks: each engine TP rank gets a handle to the copy of
the weights on its own GPU, from the training rank there (routing.py).

A collective over the trainers' default process group, bucket by bucket, since exporting a
bucket is itself collective (FSDP gathers full tensors on every rank). Every rank copies its
bucket, cast to the engines' dtype, into one new flat buffer (`flatten_to`: one multi-tensor
copy) and serializes that buffer by reference, as SGLang's `load_format: "flattened_bucket"`
reads it (codec.encode_flattened: one CUDA IPC handle, naming the GPU by UUID, for the whole
bucket). A handle per tensor cost the trainer an IPC event and the engine a handle to open
and an event to wait on for each of a model's hundreds of tensors, far more time than the
copy. Rank 0 gathers the entries, POSTs each engine its own, and broadcasts the outcome. A
rank keeps a buffer alive until rank 0 has broadcast that every engine has answered for it:
with one bucket of lookahead (the last carries weight_version) that is at most two buffers
per rank. A new buffer per bucket, not a reused one: torch's IPC reference counting keeps a
buffer's memory until the engine has let go of it, which a buffer written again could not
wait for.

Collective order, the same on every rank: status(pause), gather(0), gather(1), status(0),
gather(2), status(1), ..., gather(n-1), status(n-2), status(n-1), status(continue). A failure
on rank 0 travels as a status, so every rank stops at the same point and raises.

Rank 0's HTTP side (`Poster`: an event loop and one HTTP session) is the caller's and outlives
a sync (actors.TrainWorker keeps one while the engine list stays the same): one made per sync
set up a loop and opened new connections to every engine each time, fixed overhead on a sync
whose copies take about a millisecond.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.weight_sync.routing import Gpu, colocated_sources, engine_gpus
from kuberl_trainer.weight_sync.sender import (
    continue_generation,
    pause_and_flush,
    post_tensor_bucket,
)
from kuberl_wire import codec
from kuberl_wire.protocol import FLATTENED

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def _all_gather(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _gather(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    if world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _status(message: str | None, world_size: int) -> str | None:
    """Rank 0's outcome (None: fine, else the error) to every rank."""
    if world_size == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Poster:
    """Rank 0's side: the engines' HTTP calls, on an event loop of its own, through one
    client (one HTTP session, its connections kept open from one sync to the next). Each
    call returns None, or the error as text for `_status`."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = EngineClient(urls, request_timeout_s=600)

    def run(self, coro: Coroutine[Any, Any, None]) -> str | None:
        try:
            self.loop.run_until_complete(coro)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def post(self, entries: list[list[str]] | None, version: str | None) -> str | None:
        assert entries is not None  # rank 0 gathered them
        return self.run(post_tensor_bucket(self.client, entries, weight_version=version,
                                           load_format=FLATTENED))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def flatten_to(bucket: NamedTensors, dtype: torch.dtype
               ) -> tuple[torch.Tensor, list[codec.FlattenedTensorMetadata]]:
    """The bucket's tensors cast to ``dtype`` and copied, in order, into one new buffer (one
    multi-tensor copy kernel, whatever the tensor count), as bytes, with SGLang's metadata:
    byte offsets into the buffer (each a multiple of the dtype's size, so the engine views
    them without copying) and each tensor's shape."""
    numels = [t.numel() for _, t in bucket]
    flat = torch.empty(sum(numels), dtype=dtype, device=bucket[0][1].device)
    parts = list(torch.split(flat, numels))
    with torch.no_grad():
        torch._foreach_copy_(parts, [t.reshape(-1) for _, t in bucket])
    size, at = flat.element_size(), 0
    metadata = []
    for (name, tensor), numel in zip(bucket, numels, strict=True):
        metadata.append(codec.FlattenedTensorMetadata(
            name=name, shape=tensor.shape, dtype=dtype, start_idx=at * size,
            end_idx=(at + numel) * size, numel=numel * size))
        at += numel
    return flat.view(torch.uint8), metadata


def push_colocated(buckets: Iterable[NamedTensors], *, rank: int, world_size: int, gpu: Gpu,
                   engine_urls: Sequence[str], engine_devices: Sequence[Sequence[int]],
                   weight_version: str, poster: Poster | None, dtype: torch.dtype) -> int:
    """Every training rank calls this with its own buckets (see the module docstring);
    `poster`: rank 0's, for `engine_urls` and kept by the caller; None on the other ranks;
    `dtype`: the engines' (each bucket is cast to it as it is flattened). Returns the bytes
    this rank handed over: its flat buffers' sizes, the weights once in the engines' dtype
    (each engine TP rank reads the buffer on its own GPU)."""
    sources = colocated_sources(_all_gather(gpu, world_size),
                                engine_gpus(engine_urls, engine_devices))

    def settle(outcome: str | None) -> None:
        shared = _status(outcome, world_size)
        if shared is not None:
            raise RuntimeError(f"colocated weight update failed: {shared}")

    settle(poster.run(pause_and_flush(poster.client)) if poster else None)
    held: deque[torch.Tensor] = deque()  # the flat buffers the engines may still be reading
    pending: list[list[str]] | None = None  # the previous bucket's entries (rank 0)
    sent = 0
    for index, bucket in enumerate(buckets):
        flat, metadata = flatten_to(bucket, dtype)
        del bucket  # gathered full tensors (FSDP2) are freed once copied
        held.append(flat)
        sent += flat.numel()  # (a uint8 view: its bytes)
        entries = _gather(codec.encode_flattened(flat, metadata), rank, world_size)
        if index > 0:
            settle(poster.post(pending, None) if poster else None)
            held.popleft()
        pending = None if entries is None else [[entries[src] for src in engine]
                                                for engine in sources]
    if held:
        settle(poster.post(pending, weight_version) if poster else None)
        held.clear()
    settle(poster.run(continue_generation(poster.client)) if poster else None)
    # Free what the engines have let go of (torch keeps memory shared by IPC until the
    # consumer releases it and the producer collects); a CPU run (tests) shared none.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
    return sent
