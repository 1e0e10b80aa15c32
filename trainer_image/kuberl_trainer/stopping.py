"""Stopping at a safe point when Kubernetes stops the head (preemption, suspend, a node drain).

KubeRay stops no Ray job before it deletes a suspended RayJob's pods; the head's preStop hook
(`kuberl graceful-stop head`) sends the driver SIGTERM and waits while it saves. The first
SIGTERM only asks: the loop stops where a checkpoint is consistent. A rollout in flight is
abandoned at once (the weights are still those of the last finished step, which is what the
checkpoint then holds, and a resumed run draws the same prompts again); a step that has begun
training runs to its end and is saved after it. A second SIGTERM (or Ctrl-C) stops at once.

Rejected: raising KeyboardInterrupt from the handler, as before. It lands wherever the driver
is; mid-training, the trainers finish the update while the driver saves the previous step's
number with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

LOG = logging.getLogger("kuberl.stopping")
T = TypeVar("T")


class StopRequested(Exception):
    """The loop reached a safe point after a SIGTERM: save, then exit."""


class GracefulStop:
    def __init__(self) -> None:
        self.requested = threading.Event()
        self._inflight: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None = None
        self._previous: Any = None

    def install(self) -> GracefulStop:
        if os.name == "posix" and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt  # asked twice: stop now
        self.requested.set()
        LOG.warning("SIGTERM: stopping at the next safe point, after saving a checkpoint")
        if self._inflight is not None:
            loop, task = self._inflight
            loop.call_soon_threadsafe(task.cancel)  # (wakes the loop out of its select)

    def check(self) -> None:
        """Raise StopRequested when a stop was asked for (call where a checkpoint is
        consistent: between steps, or after a rollout and before its training)."""
        if self.requested.is_set():
            raise StopRequested

    def abandonable(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` (a rollout) on `loop`, abandoning it when a stop is asked for."""
        self.check()
        task = loop.create_task(coro)
        self._inflight = (loop, task)
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            if self.requested.is_set():
                raise StopRequested from None
            raise
        finally:
            self._inflight = None


class PidFile:
    """Where the head's preStop hook finds the driver to signal (in a cluster only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __enter__(self) -> PidFile:
        self.path.write_text(f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)
