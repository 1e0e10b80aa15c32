"""The weight-update process group: trainer rank 0 plus every engine, outside the default group.

Built from a TCPStore and a ProcessGroupGloo / ProcessGroupNCCL object directly, never through
`torch.distributed.init_process_group` / `new_group`: those register global state (the default
group, the group registry) that a trainer already inside a DDP/Megatron group owns, and that a
second group with a different membership must not disturb. Collectives are therefore called on
the backend object (`pg.broadcast([t], opts)`), not via `torch.distributed.broadcast`.

Store layout: the trainer (rank 0) hosts the TCPStore at master_address:master_port. Keys are
prefixed exactly as SGLang's `init_custom_process_group` ends up prefixing them (its own
`PrefixStore(group_name)`, then torch's `_new_process_group_helper` adds `"{group_name}/"` and
`"{device}/"`), so this helper on the trainer and a real SGLang engine rendezvous on the same
keys. That compatibility is only checked on GPUs (bench/), not in the CPU test run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

BACKENDS = ("gloo", "nccl")


@dataclass
class WeightSyncGroup:
    backend: str
    rank: int
    world_size: int
    group_name: str
    pg: Any
    # The store must outlive the group: on rank 0 it is the rendezvous server.
    store: Store = field(repr=False)
    destroyed: bool = False

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor from `src`, in order. Gloo: returns when all have arrived.
        NCCL: the caller's current CUDA stream waits for them, so work queued on it later
        sees the received bytes.

        All broadcasts are issued before waiting on any, so gloo/NCCL can pipeline them."""
        if self.destroyed:
            raise RuntimeError(f"weight-sync group {self.group_name!r} was destroyed")
        works = []
        for tensor in tensors:
            opts = BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(self.pg.broadcast([tensor], opts))
        for work in works:
            work.wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if self.backend == "nccl":
            # Frees the communicator now rather than at garbage collection.
            self.pg.shutdown()


def _local_address_towards(master_address: str, master_port: int) -> str:
    """The local IP the kernel would use to reach the master (a UDP connect sends nothing).

    Gloo must bind a device on an interface the other ranks can reach; its default device
    resolves this host's hostname, which in containers is often 127.0.1.1 or unresolvable."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(master_address), master_port))
        return str(sock.getsockname()[0])


def _gloo(store: Store, rank: int, world_size: int, master_address: str, master_port: int,
          timeout: timedelta) -> Any:
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from stubs
    opts._timeout = timeout
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        device = ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    else:
        device = ProcessGroupGloo.create_device(
            hostname=_local_address_towards(master_address, master_port))
    opts._devices = [device]
    return ProcessGroupGloo(store, rank, world_size, opts)


def _nccl(store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    from torch._C._distributed_c10d import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, opts)


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str, timeout: float | timedelta = 300.0) -> WeightSyncGroup:
    """Join (rank > 0) or host (rank 0) the group. Blocks until all `world_size` ranks have
    connected or `timeout` passes, so rank 0 must call this concurrently with asking the engines
    to join (a thread, or asyncio.to_thread)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if not group_name:
        raise ValueError("group_name must be non-empty")
    span = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    tcp = TCPStore(master_address, master_port, world_size, rank == 0, span,
                   wait_for_workers=True)
    device = "cuda" if backend == "nccl" else "cpu"
    store = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, tcp)))
    if backend == "gloo":
        pg = _gloo(store, rank, world_size, master_address, master_port, span)
    else:
        pg = _nccl(store, rank, world_size, span)
    return WeightSyncGroup(backend=backend, rank=rank, world_size=world_size,
                           group_name=group_name, pg=pg, store=tcp)
