"""Trainer side of weight sync: push HF-named tensors to every engine.

Disaggregated (`DistributedWeightSender`), per the contract in docs/trainer-contracts.md:
  connect: POST /init_weights_update_group to engine i (rank 1 + i) concurrently with building
           the group locally as rank 0 - it is a rendezvous, neither side returns alone;
  send:    per bucket, POST /update_weights_from_distributed {names, dtypes, shapes} to every
           engine concurrently, broadcast the bucket's tensors from rank 0 in the announced
           order, then wait for every POST to answer; the last bucket carries weight_version
           and flush_cache, so an engine reports the new version only once fully updated;
  close:   POST /destroy_weights_update_group, then drop the local group.
Colocated (`send_tensors`): POST /update_weights_from_tensor with the tensors by reference
(CUDA IPC handles, `codec.encode_shared`) or by value.

An engine's error answer to a bucket (a wrong name, say: it has received the tensors) is raised
once every engine has answered that bucket, so all of them took part in the same broadcasts and
the group stays usable. A dead connection or a timeout raises EngineError at once; the local
broadcast thread may then stay blocked until the group's timeout, after which the group is
unusable: call close() and connect() again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kuberl_trainer.engine_client import EngineClient, first_error
from kuberl_wire import codec, protocol
from kuberl_wire.dtypes import dtype_to_str
from kuberl_wire.group import WeightSyncGroup, new_group
from kuberl_wire.plan import TensorMeta, iter_buckets

NamedTensors = Sequence[tuple[str, torch.Tensor]]
R = TypeVar("R")
B = TypeVar("B")


def in_daemon_thread(fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
    """Run a blocking collective in its own daemon thread. Not asyncio.to_thread: when an
    engine fails, the collective stays blocked until the group timeout, and a default-executor
    thread would then hold up asyncio.run()'s exit (and the error) for that long."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[R] = loop.create_future()

    def settle(result: R | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def deliver(result: R | None, exc: BaseException | None) -> None:
        # RuntimeError: the loop is closed, the caller gave up long ago.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, exc)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            deliver(None, exc)
        else:
            deliver(result, None)

    threading.Thread(target=body, daemon=True, name=f"weight-sync-{fn.__name__}").start()
    return fut


@dataclass(frozen=True)
class SyncStats:
    weight_version: str
    buckets: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype_to_str(tensor.dtype), shape=tuple(tensor.shape),
                      nbytes=tensor.numel() * tensor.element_size())


def bucketize(named: Iterable[tuple[str, torch.Tensor]],
              bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream (name, tensor) pairs into buckets of at most bucket_bytes (see plan.iter_buckets)."""
    return iter_buckets(named, lambda nt: nt[1].numel() * nt[1].element_size(), bucket_bytes)


def flatten_bucket(bucket: NamedTensors, device: torch.device) -> list[torch.Tensor]:
    """The bucket's tensors (one dtype) as a single flat tensor on ``device``, in order: what
    a ``flattened_bucket`` update broadcasts (one copy kernel, views need not be contiguous)."""
    return [torch.cat([t.detach().reshape(-1).to(device) for _, t in bucket])]


def _with_last(items: Iterable[B]) -> Iterator[tuple[B, bool]]:
    """Yield (bucket, is_last) with one bucket of lookahead, keeping the input a stream."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


class DistributedWeightSender:
    """Rank 0 of the weight-update group; one instance per trainer (only rank 0 sends)."""

    def __init__(self, client: EngineClient, *, master_address: str, master_port: int,
                 backend: str = "gloo", group_name: str = "kuberl_weight_sync",
                 timeout_s: float = 300.0, weight_version: int = 0,
                 flatten: bool = True) -> None:
        self.client = client
        # One broadcast per bucket instead of one per tensor: a model has hundreds of small
        # tensors (norms, biases), and each broadcast costs tens of microseconds to launch on
        # both sides whatever its size.
        self.flatten = flatten
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        self.group: WeightSyncGroup | None = None
        # NCCL broadcasts need the tensors on this process's GPU.
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    @property
    def world_size(self) -> int:
        return 1 + len(self.client.urls)

    async def connect(self) -> None:
        if self.group is not None:
            raise RuntimeError("already connected")
        bodies = [protocol.init_weights_update_group(
            master_address=self.master_address, master_port=self.master_port,
            rank_offset=1 + i, world_size=self.world_size, group_name=self.group_name,
            backend=self.backend) for i in range(len(self.client.urls))]
        local = in_daemon_thread(new_group, self.backend, self.master_address,
                                 self.master_port, 0, self.world_size, self.group_name,
                                 self.timeout_s)
        posts = self.client.post_all("/init_weights_update_group", bodies, per_engine=True,
                                     timeout_s=self.timeout_s + 30)
        results = await first_error([local, posts])
        group = results[0]
        assert isinstance(group, WeightSyncGroup)
        self.group = group

    async def send(self, buckets: Iterable[NamedTensors], *, weight_version: str | None = None,
                   flush_cache: bool = True) -> SyncStats:
        """Push every bucket; the engines' weight_version becomes `weight_version`, default
        the next integer. Returns sizes and time for throughput metrics."""
        group = self.group
        if group is None:
            raise RuntimeError("connect() first")
        version = weight_version if weight_version is not None else str(self.weight_version + 1)
        start = time.perf_counter()
        n_buckets = n_tensors = n_bytes = 0
        for bucket, last in _with_last(buckets):
            metas = [tensor_meta(name, t) for name, t in bucket]
            flat = self.flatten and len({t.dtype for _, t in bucket}) == 1
            tensors = flatten_bucket(bucket, self.device) if flat else [
                t.detach().to(self.device).contiguous() for _, t in bucket]
            body = protocol.update_weights_from_distributed(
                metas, group_name=self.group_name, weight_version=version if last else None,
                flush_cache=flush_cache and last, flattened=flat)
            await first_error([
                self.client.post_all("/update_weights_from_distributed", body,
                                     timeout_s=self.timeout_s + 30, in_step=True),
                in_daemon_thread(group.broadcast, tensors, 0),
            ])
            n_buckets += 1
            n_tensors += len(metas)
            n_bytes += sum(m.nbytes for m in metas)
        if weight_version is None:
            self.weight_version += 1
        return SyncStats(weight_version=version, buckets=n_buckets, tensors=n_tensors,
                         bytes=n_bytes, seconds=time.perf_counter() - start)

    async def close(self) -> None:
        """Ask engines to leave the group, then drop ours (engine errors still raise)."""
        group, self.group = self.group, None
        if group is None:
            return
        leave = self.client.post_all("/destroy_weights_update_group",
                                     protocol.destroy_weights_update_group(self.group_name),
                                     timeout_s=60)
        if self.backend == "nccl":
            # An NCCL communicator's destroy may wait for its peers: both ends tear down at
            # once, or waiting for the engines' answer first would deadlock (seen on H200).
            await first_error([leave, in_daemon_thread(group.destroy)])
            return
        # Gloo closes its sockets on destroy, which a peer still in the group can take as a
        # failure: let the engines leave first.
        try:
            await leave
        finally:
            group.destroy()


async def send_tensors(client: EngineClient, buckets: Iterable[NamedTensors], *,
                       weight_version: str, flush_cache: bool = True,
                       shared: bool = False) -> SyncStats:
    """Colocated path: each bucket is serialized (codec) and POSTed to every engine's
    /update_weights_from_tensor; the last bucket carries weight_version and flush_cache.
    ``shared``: by reference (CUDA IPC handles; the bucket stays alive until every engine has
    answered), else by value."""
    encode = codec.encode_shared if shared else codec.encode_named_tensors
    start = time.perf_counter()
    n_buckets = n_tensors = n_bytes = 0
    for bucket, last in _with_last(buckets):
        body = protocol.update_weights_from_tensor(
            [encode(bucket)], weight_version=weight_version if last else None,
            flush_cache=flush_cache and last)
        # in_step: engines may still be reading the bucket by reference when another answers
        # an error, so it must stay alive (not be raised past) until every engine answered.
        await client.post_all("/update_weights_from_tensor", body, in_step=True)
        n_buckets += 1
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return SyncStats(weight_version=weight_version, buckets=n_buckets, tensors=n_tensors,
                     bytes=n_bytes, seconds=time.perf_counter() - start)
