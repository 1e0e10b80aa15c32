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

Groups one after another on one port (an engine replaced): rank 0 keeps one rendezvous server
(`host_store`) and passes it to each `new_group`, each group under a name of its own, so no
key of an earlier group is read by a later one and no earlier group, still holding its server,
keeps the port from being bound again (a fixed port in a cluster: network.weightSyncPort).

Aborting (`WeightSyncGroup.abort`): when a member dies in the middle of a broadcast, the others
stay in that collective until the group's timeout. abort() ends this end of it at once, from
any thread: the collective in flight and every later one raise `GroupAborted`. NCCL: the
process group's abort (ncclCommAbort) ends kernels waiting for the dead peer. Gloo cannot
cancel an operation it has started: a broadcast waits for it in short slices and gives up when
the group is aborted; the operation stays in gloo's own thread until the group's timeout, and
the process group, whose destructor would wait for it, is dropped by a daemon thread then.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
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
# How often a gloo broadcast's wait looks whether its group was aborted (an operation that
# completes ends the wait at once, whatever this is).
ABORT_POLL = timedelta(seconds=0.1)


class GroupAborted(RuntimeError):
    """A collective of a weight-sync group that was aborted (WeightSyncGroup.abort)."""


@dataclass
class WeightSyncGroup:
    backend: str
    rank: int
    world_size: int
    group_name: str
    pg: Any
    # The store must outlive the group: on rank 0 it is the rendezvous server, or a
    # connection to `server` (host_store's, kept across groups).
    store: Store = field(repr=False)
    server: Store | None = field(default=None, repr=False)
    destroyed: bool = False
    _aborted: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pending: list[Any] = field(default_factory=list, repr=False)  # the broadcast in flight

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def check(self) -> None:
        """Raise GroupAborted if the group was aborted. NCCL: call it after waiting for what
        a broadcast received (a stream synchronize): an abort ends the kernel whether or not
        the bytes arrived."""
        if self._aborted.is_set():
            raise GroupAborted(f"weight-sync group {self.group_name!r} was aborted")

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor from `src`, in order. Gloo: returns when all have arrived.
        NCCL: the caller's current CUDA stream waits for them, so work queued on it later
        sees the received bytes. GroupAborted once the group is aborted (see abort).

        All broadcasts are issued before waiting on any, so gloo/NCCL can pipeline them."""
        if self.destroyed and not self.aborted:
            raise RuntimeError(f"weight-sync group {self.group_name!r} was destroyed")
        pg = self.pg
        self.check()
        works = []
        for tensor in tensors:  # (not under the lock: NCCL's first sets up its communicator)
            opts = BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(pg.broadcast([tensor], opts))
        with self._lock:
            late = self._aborted.is_set()
            if not late:
                self._pending = works  # (what an abort waits for before dropping the group)
        if late:  # aborted while these were issued: they go aside with the group
            if self.backend == "gloo":
                _drop_aside(pg, works, self.group_name)
            del pg
            self.check()
        for work in works:
            self._wait(work)
        with self._lock:
            self._pending = []

    def _wait(self, work: Any) -> None:
        if self.backend == "nccl":  # (the stream waits; the host does not)
            work.wait()
            return
        while True:
            try:
                work.wait(ABORT_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # (its own error, or done just now)
                    work.wait()
                    return
                self.check()

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def abort(self) -> None:
        """End this end of the group now, whatever its peers do (see the module's docstring);
        safe from any thread, and more than once. The group cannot be used again."""
        with self._lock:
            if self._aborted.is_set():
                return
            self._aborted.set()
            self.destroyed = True
            pg, self.pg, pending, self._pending = self.pg, None, self._pending, []
        if pg is None:
            return
        if self.backend == "nccl":
            pg.abort()  # ncclCommAbort: kernels waiting for a dead peer end
            return
        # Gloo's destructor waits for its operations in flight: dropped aside once they end
        # (at the latest at the group's timeout), never on the caller's thread.
        _drop_aside(pg, pending, self.group_name)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if self.backend == "nccl":
            # Frees the communicator now rather than at garbage collection.
            self.pg.shutdown()


def _drop_aside(pg: Any, works: list[Any], name: str) -> None:
    threading.Thread(target=_drop_when_done, args=(pg, works), daemon=True,
                     name=f"aborted-group-{name}").start()


def _drop_when_done(pg: Any, works: list[Any]) -> None:
    """Hold an aborted gloo process group until its operations in flight have ended (they
    fail at the group's timeout), then drop it here."""
    for work in works:
        with contextlib.suppress(Exception):
            work.wait()
    del pg


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


def host_store(master_address: str, master_port: int,
               timeout: float | timedelta = 300.0) -> TCPStore:
    """Rank 0's rendezvous server on master_port, for groups formed one after another
    (new_group's `store`): it waits for no one; each group's own set-up does."""
    span = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    return TCPStore(master_address, master_port, None, True, span, wait_for_workers=False)


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str, timeout: float | timedelta = 300.0,
              store: Store | None = None) -> WeightSyncGroup:
    """Join (rank > 0) or host (rank 0) the group. Blocks until all `world_size` ranks have
    connected or `timeout` passes, so rank 0 must call this concurrently with asking the engines
    to join (a thread, or asyncio.to_thread). `store`: rank 0's rendezvous server from
    host_store (at master_address:master_port), kept across groups, to which the group opens
    a connection of its own; None: a server of its own."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if not group_name:
        raise ValueError("group_name must be non-empty")
    if store is not None and rank != 0:
        raise ValueError("only rank 0 hosts the rendezvous (store)")
    span = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    # With a kept server, a connection of this group's own to it: a TCPStore object runs one
    # request at a time, and a join left waiting in the rendezvous would hold up the next's.
    tcp = TCPStore(master_address, master_port, world_size, rank == 0 and store is None, span,
                   wait_for_workers=store is None)
    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/",
                                                      PrefixStore(group_name, tcp)))
    if backend == "gloo":
        pg = _gloo(prefixed, rank, world_size, master_address, master_port, span)
    else:
        pg = _nccl(prefixed, rank, world_size, span)
    return WeightSyncGroup(backend=backend, rank=rank, world_size=world_size,
                           group_name=group_name, pg=pg, store=tcp, server=store)
