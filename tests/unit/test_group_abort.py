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


def test_a_join_left_in_the_rendezvous_gives_up_when_its_group_is_aborted() -> None:
    """The reference engine's side (Receiver.init_group): a member of the group being formed
    is gone, so the rendezvous cannot finish; /abort_weights_update_group (abort_group, from
    another thread) ends the join at once, and the engine can join the next group."""
    from kuberl_rollout.reference.weights import Receiver

    class Engine:  # (what a join uses of a ReferenceEngine)
        device = torch.device("cpu")

    port = free_port()
    store = host_store("127.0.0.1", port, TIMEOUT_S)
    receiver = Receiver(Engine(), timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 3, "group_name": "g1", "backend": "gloo"}
    # (rank 0's own join, which no abort reaches either, is left to fail at its timeout)
    in_thread(lambda: new_group("gloo", "127.0.0.1", port, 0, 3, "g1", TIMEOUT_S, store))
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(receiver.init_group, body)  # (rank 2 never comes)
        time.sleep(1.0)
        assert not joining.done()
        started = time.monotonic()
        assert receiver.abort_group({"group_name": "g1"}) == "left 'g1' as it was being formed"
        with pytest.raises(GroupAborted, match="as it was being formed"):
            joining.result(timeout=RELEASED_WITHIN_S)
        assert time.monotonic() - started < RELEASED_WITHIN_S
        assert "g1" not in receiver.groups
    new = form_with(receiver, port, store)
    assert "g2" in receiver.groups and new.world_size == 2


def form_with(receiver: Any, port: int, store: Any) -> WeightSyncGroup:
    """Group g2 of rank 0 (here) and the receiver as rank 1, at once: not after the g1 join
    still waiting on the same server (each group talks to it on a connection of its own)."""
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "g2", "backend": "gloo"}
    with ThreadPoolExecutor(2) as pool:
        host = pool.submit(new_group, "gloo", "127.0.0.1", port, 0, 2, "g2", TIMEOUT_S, store)
        pool.submit(receiver.init_group, body).result(timeout=TIMEOUT_S / 3)
        return host.result(timeout=TIMEOUT_S / 3)
