"""What every kuberl Ray actor shares, with no torch import (an engine actor only starts a
process: importing torch would cost it seconds of start-up, on the run's critical path):
ports, the node's address, where an actor's output goes, CPU threads, placement groups."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from kuberl_trainer.placement import ActorShape, cpu_threads

# Ports handed out on this machine (a file under flock): see free_port.
PORT_LEDGER = Path(tempfile.gettempdir()) / f"kuberl-ports-{os.getuid()}"
PORT_HOLD_S = 900.0  # an engine binds its port once its model is loaded: minutes, for a large one


# Where free_port looks first: below Linux's default ephemeral range (32768-60999), and apart
# from the range the e2e harness gives its control planes (e2e/controlplane/procs.py, 20000+).
OWN_PORTS = (12000, 20000)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections' local ports (Linux's default
    where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _os_free_port() -> int:
    """A port free now, outside the kernel's ephemeral range where there is room. A port the
    kernel picked (bind to 0) is one it hands out again to the next bind(0) or outgoing
    connection, and an engine binds its port only once its model is loaded: meanwhile Ray
    starts workers that listen on kernel-picked ports, and one took an engine's (the engine
    then died with "address already in use", two integration tests side by side)."""
    low, high = ephemeral_range()
    for _ in range(64):
        port = random.randrange(*OWN_PORTS)
        if low <= port <= high:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # (in use: try another)
                continue
            return port
    with socket.socket() as s:  # (no room outside the range: the kernel's pick)
        s.bind(("", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port free now that no kuberl process on this machine was given in the last
    PORT_HOLD_S seconds. The OS forgets a port once it is released, and an engine binds its
    port only after loading its model: meanwhile a second run on the same machine could be given
    the same port, and its engine answered the first run's health checks (seen with two test
    runs side by side: the first sync then met a closed port). So every port handed out is
    written down, and one written down is not handed out again while it is held."""
    try:
        ledger = PORT_LEDGER.open("a+")
    except OSError:  # (no writable temp directory: the OS's word alone)
        return _os_free_port()
    with ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # (released when closed, or when the process dies)
        ledger.seek(0)
        now = time.time()
        held: dict[int, float] = {}
        for entry in ledger.read().split():
            with contextlib.suppress(ValueError):  # (a torn line: skipped)
                number, _, at = entry.partition("@")
                if now - float(at) < PORT_HOLD_S:
                    held[int(number)] = float(at)
        port = _os_free_port()
        for _ in range(100):
            if port not in held:
                break
            port = _os_free_port()
        held[port] = now
        ledger.seek(0)
        ledger.truncate()
        ledger.write("".join(f"{p}@{at:.3f}\n" for p, at in held.items()))
    return port


def distinct_free_ports(count: int) -> list[int]:
    """`count` different free ports (free_port repeats none while it is held, but without a
    writable ledger it has only the OS's word, and the OS may repeat one)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def node_ip() -> str:
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def log_to_file(path: str | None, what: str) -> None:
    """Send this actor process's stdout and stderr to `path` (appended; a resumed run adds to
    it), or leave them alone when None.

    Locally (`kuberl run` without --address) the run's terminal is for the step table, and
    Ray would forward every line an actor writes there: its routine logs belong in the run's
    output folder instead. Done on the file descriptors, not sys.stdout, so C++ libraries
    (gloo, NCCL), warnings and child processes (an engine server) write there too. In a
    cluster (None) they stay on stdout, where `kubectl logs` finds them.
    """
    if path is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {what} (pid {os.getpid()})", flush=True)


def log_path(log_dir: str | None, name: str) -> str | None:
    """`log_dir`/`name`.log, or None (no log directory: output stays on stdout)."""
    return None if log_dir is None else str(Path(log_dir) / f"{name}.log")


def torch_threads(sharing: int) -> int:
    """Threads for a CPU actor sharing its machine with `sharing - 1` actors of its role;
    KUBERL_TORCH_THREADS overrides (see placement.cpu_threads)."""
    forced = int(os.environ.get("KUBERL_TORCH_THREADS", "0") or 0)
    return forced if forced > 0 else cpu_threads(len(os.sched_getaffinity(0)), sharing)



PLACEMENT_TIMEOUT_S = 600.0


def reserve(bundles: list[dict[str, float]], what: str) -> Any:
    """Reserve `bundles` at once (a gang: all or nothing) as one placement group.

    PACK keeps consecutive ranks on the same node where they fit, so data-parallel neighbours
    talk over NVLink and an engine's GPUs never straddle nodes (a bundle is one node).
    """
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"could not place {len(bundles)} {what} actor(s) of {bundles[0]} within "
            f"{PLACEMENT_TIMEOUT_S:.0f}s; the Ray cluster offers {ray.cluster_resources()}"
        ) from None
    return pg


def in_bundle(shape: ActorShape, pg: Any, index: int) -> dict[str, Any]:
    """Actor options: `shape`'s resources, taken from bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {**shape.options(), "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


def placed(shape: ActorShape, count: int, what: str) -> list[dict[str, Any]]:
    """Per-actor options for `count` actors of `shape`, each in a bundle of its own."""
    pg = reserve([shape.bundle() for _ in range(count)], what)
    return [in_bundle(shape, pg, i) for i in range(count)]


