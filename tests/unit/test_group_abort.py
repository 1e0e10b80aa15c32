"""Aborting a weight-sync group whose member went silent in the middle of a broadcast
(kuberl_wire.group), on real gloo groups whose ranks run on threads of this process: the
sender (rank 0) and a receiver each leave the broadcast at once instead of at the group's
timeout, and the next group forms on the same rendezvous server and port under a new name.
The run-level test is tests/integration/test_local_run.py (dies-mid-broadcast)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kuberl_wire.group import GroupAborted, WeightSyncGroup, host_store, new_group

TIMEOUT_S = 60.0  # the groups' own timeout: what an abort must not wait for
RELEASED_WITHIN_S = 5.0  # (ABORT_POLL is 0.1 s; a loaded machine gets slack)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def form(port: int, name: str, world: int, store: Any) -> list[WeightSyncGroup]:
    """Every rank's end of group `name` (they join at once, one thread each)."""
    with ThreadPoolExecutor(world) as pool:
        ends = [pool.submit(new_group, "gloo", "127.0.0.1", port, rank, world, name,
                            TIMEOUT_S, store if rank == 0 else None) for rank in range(world)]
        return [end.result(timeout=60) for end in ends]


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def test_an_aborted_broadcast_ends_at_once_on_the_sender_and_a_receiver() -> None:
    """Rank 2 never takes part (a member gone silent): rank 0's broadcast of more than the
    sockets hold and rank 1's receive of a broadcast that cannot finish are both blocked;
    each ends with GroupAborted once its end is aborted, long before the group's timeout."""
    port = free_port()
    store = host_store("127.0.0.1", port, TIMEOUT_S)
    g0, g1, _silent = form(port, "g1", 3, store)
    sending, sent = in_thread(lambda: g0.broadcast([torch.ones(64 << 20)]))
    # rank 1 waits for a second broadcast that rank 0 never makes
    receiving, received = in_thread(lambda: g1.broadcast([torch.empty(64 << 20),
                                                          torch.empty(16)]))
    time.sleep(1.0)
    assert sending.is_alive() and receiving.is_alive()  # blocked
    started = time.monotonic()
    g0.abort()
    g1.abort()
    g1.abort()  # (again: nothing more happens)
    sending.join(RELEASED_WITHIN_S)
    receiving.join(RELEASED_WITHIN_S)
    assert not sending.is_alive() and not receiving.is_alive()
    assert time.monotonic() - started < RELEASED_WITHIN_S
    assert [type(e) for e in sent + received] == [GroupAborted, GroupAborted]
    with pytest.raises(GroupAborted, match="'g1' was aborted"):
        g0.broadcast([torch.ones(4)])


def test_the_next_group_forms_on_the_same_port_while_an_aborted_one_waits_out_its_timeout(
) -> None:
    """A fixed rendezvous port (a cluster's network.weightSyncPort): the aborted group's
    operation still sits in gloo until its timeout, yet a new group (a new name, the same
    server) forms at once and broadcasts exactly."""
    port = free_port()
    store = host_store("127.0.0.1", port, TIMEOUT_S)
    old = form(port, "g1", 2, store)
    blocked, _ = in_thread(lambda: old[1].broadcast([torch.empty(1 << 20)]))
    time.sleep(0.5)
    for end in old:
        end.abort()
    blocked.join(RELEASED_WITHIN_S)
    assert not blocked.is_alive()
    new = form(port, "g2", 3, store)
    want = torch.arange(1 << 16, dtype=torch.float32)
    got = [torch.empty_like(want) for _ in new[1:]]
    with ThreadPoolExecutor(3) as pool:
        done = [pool.submit(new[0].broadcast, [want])]
        done += [pool.submit(end.broadcast, [buf]) for end, buf in zip(new[1:], got,
                                                                        strict=True)]
        for d in done:
            d.result(timeout=30)
    assert all(torch.equal(g, want) for g in got)
