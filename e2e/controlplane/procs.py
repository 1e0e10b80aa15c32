"""Processes: free ports, signals, and telling whether a recorded pid still runs its binary."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
from pathlib import Path

from kuberl_cli.graceful_stop import process_alive as pid_alive  # (zombies count as gone)

__all__ = ["free_ports", "niceness", "pid_alive", "pid_runs", "set_pdeathsig", "terminate"]


def terminate(proc: subprocess.Popen[bytes], grace: float = 10) -> None:
    """SIGTERM a child we started, SIGKILL it after `grace` s; wait for it either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


# Where free_ports looks first: below the kernel's ephemeral range. A port picked from that
# range (bind to port 0) is free when picked, but a component listens on it only seconds later,
# and meanwhile the cluster's own client connections (apiserver to etcd, the controllers to
# the apiserver) take ephemeral ports from the same range: CI once lost a run to KubeRay's
# "bind: address already in use" on a port picked 17 s before. Ports outside the range are
# never handed out to outgoing connections.
LOW_PORTS = (20000, 32768)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unread)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, outside the ephemeral range where there is room
    (random within LOW_PORTS, so two clusters rarely try the same), else the kernel's picks;
    held together while picked, so no duplicates."""
    low, high = LOW_PORTS
    eph_low, eph_high = ephemeral_range()
    candidates = [p for p in range(low, high) if not eph_low <= p <= eph_high]
    random.shuffle(candidates)
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # (no room below the range: the kernel's picks)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def niceness() -> int:
    return int(os.environ.get("KUBERL_E2E_NICE", "19"))


def set_pdeathsig() -> None:
    """In the child: die (SIGTERM) when the parent that started the cluster dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def pid_runs(pid: int, binary: str) -> bool:
    """The pid is alive and still runs `binary` (not a recycled pid)."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # argv[0] is the path it was started with; compare names, so that a cache dir given
    # differently (a symlink, another XDG_CACHE_HOME) still finds it.
    return bool(cmdline) and Path(cmdline[0].decode(errors="replace")).name == Path(binary).name
