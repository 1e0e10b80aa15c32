"""`kuberl graceful-stop head|worker --within N`: the preStop hooks that let a stopping job
save its checkpoint (see kuberl_api.runtime.GRACEFUL_STOP).

Kubernetes runs a container's preStop hook to the end (or to the grace period) before it sends
the container SIGTERM. KubeRay deletes a suspended (preempted) RayJob's pods without stopping
the Ray job, and Ray's own shutdown would kill the driver and its actors at once, so:
- head: send the training driver SIGTERM (it stops at a safe point and saves), then wait for
  it to exit;
- worker (train and critic pods, whose ranks write the checkpoint): stay up while the driver
  serves its metrics port on the head, i.e. until it has saved and exited.
Both always exit 0: a failed hook must never block a pod's deletion.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kuberl_api import runtime

POLL_SECONDS = 0.5
# The head's address in every KubeRay worker pod (KubeRay sets it for `ray start`).
HEAD_HOST_ENV = "FQ_RAY_IP"
# Consecutive failed probes that mean the driver's port is closed (one may be a blip).
CLOSED_AFTER = 2


def process_alive(pid: int) -> bool:
    """The process runs (a zombie has exited: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # (no procfs: kill(0) is all there is)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _wait(done: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(POLL_SECONDS)
    return done()


def stop_head(within: float, pid_file: str | Path = runtime.DRIVER_PID_FILE) -> int:
    try:
        pid = int(Path(pid_file).read_text().strip())
    except (OSError, ValueError):
        print("graceful-stop: no training driver runs here", file=sys.stderr)
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    print(f"graceful-stop: asked the driver (pid {pid}) to save and stop; waiting up to "
          f"{within:.0f}s", file=sys.stderr)
    if not _wait(lambda: not process_alive(pid), within):
        print("graceful-stop: the driver is still saving as the grace period ends",
              file=sys.stderr)
    return 0


def hold_worker(within: float, host: str | None = None,
                port: int = runtime.TRAINER_METRICS_PORT) -> int:
    host = host or os.environ.get(HEAD_HOST_ENV)
    if not host:
        return 0
    failures = 0

    def driver_gone() -> bool:
        nonlocal failures
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2):
                failures = 0
        except OSError:
            failures += 1
        return failures >= CLOSED_AFTER

    _wait(driver_gone, within)
    return 0


def main(role: str, within: float) -> int:
    return stop_head(within) if role == "head" else hold_worker(within)
