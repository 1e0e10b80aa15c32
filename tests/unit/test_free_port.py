"""free_port: a port handed out to one kuberl process is not handed to another on the same
machine while it is held (an engine binds its port only after loading its model; two runs side
by side were once given the same one, and one run's engine answered the other's checks)."""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kuberl_trainer import ray_actors


@pytest.fixture
def os_ports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[int]]:
    """The OS's answers, in order (it forgets a port once released, so it may repeat one)."""
    answers: list[int] = []
    lock = threading.Lock()

    def next_answer() -> int:
        with lock:
            return answers.pop(0)

    monkeypatch.setattr(ray_actors, "PORT_LEDGER", tmp_path / "ports")
    monkeypatch.setattr(ray_actors, "_os_free_port", next_answer)
    yield answers


def test_a_port_held_is_not_handed_out_again(os_ports: list[int]) -> None:
    os_ports += [5000, 5000, 5000, 5001]
    assert ray_actors.free_port() == 5000
    assert ray_actors.free_port() == 5001  # the OS said 5000 twice more: still held
    os_ports += [5001, 5002, 5000, 5003]
    assert ray_actors.distinct_free_ports(2) == [5002, 5003]


def test_a_port_is_held_for_port_hold_s(os_ports: list[int],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    os_ports += [5000, 5000, 5001, 5000]
    assert ray_actors.free_port() == 5000
    now[0] += ray_actors.PORT_HOLD_S - 1
    assert ray_actors.free_port() == 5001
    now[0] += 2  # 5000 handed out PORT_HOLD_S + 1 s ago: free to give again
    assert ray_actors.free_port() == 5000


def _ask(n: int, out: Any) -> None:
    out.put([ray_actors.free_port() for _ in range(n)])


def test_processes_asking_at_once_never_get_the_same_port(os_ports: list[int]) -> None:
    # Every process's OS offers the same ports in the same order (6000, 6001, ... 6199): only
    # the ledger, read and written under its lock, keeps two processes from taking one.
    os_ports += list(itertools.islice(itertools.cycle(range(6000, 6200)), 5000))
    ctx = multiprocessing.get_context("fork")  # (the children keep this test's patches)
    out = ctx.Queue()
    askers = [ctx.Process(target=_ask, args=(20, out)) for _ in range(4)]
    for p in askers:
        p.start()
    got = [port for _ in askers for port in out.get(timeout=60)]
    for p in askers:
        p.join(timeout=60)
    assert len(got) == 80 and len(set(got)) == 80, sorted(got)


def test_without_a_writable_ledger_the_os_port_is_used(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setattr(ray_actors, "PORT_LEDGER", tmp_path / "missing-dir" / "ports")
    port = ray_actors.free_port()
    assert 0 < port < 65536
    monkeypatch.setattr(ray_actors, "_os_free_port", iter([7000, 7000, 7001]).__next__)
    assert ray_actors.distinct_free_ports(2) == [7000, 7001]  # (the OS repeated itself)


def test_ports_come_from_outside_the_kernels_ephemeral_range() -> None:
    """A kernel-picked port is the kernel's to hand out again (Ray's workers listen on such
    ports) before an engine binds it: free_port looks below the range first."""
    import socket

    low, high = ray_actors.ephemeral_range()
    ports = {ray_actors._os_free_port() for _ in range(20)}
    assert all(ray_actors.OWN_PORTS[0] <= p < ray_actors.OWN_PORTS[1] for p in ports), ports
    assert not any(low <= p <= high for p in ports)
    for port in ports:  # free when handed out
        with socket.socket() as s:
            s.bind(("", port))


def test_with_no_room_outside_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_actors, "ephemeral_range", lambda: (1024, 65535))
    assert 0 < ray_actors._os_free_port() < 65536
