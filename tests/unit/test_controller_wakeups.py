"""The operator's timed wake-ups (Controller.wake_at): the earliest one per RLJob is kept, and
a job the operator forgets (deleted) is never reconciled by a wake-up set before."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from kuberl_operator.metrics import Metrics
from kuberl_operator.reconcile.controller import Controller, Key
from kuberl_operator.settings import Config


def controller() -> tuple[Controller, list[Key]]:
    ctl = Controller(kube=None, config=Config(), metrics=Metrics(CollectorRegistry()))  # type: ignore[arg-type]
    woken: list[Key] = []

    def trigger(key: Key) -> None:
        woken.append(key)

    ctl.trigger = trigger  # type: ignore[method-assign]
    return ctl, woken


async def test_a_forgotten_job_is_not_woken() -> None:
    ctl, woken = controller()
    ctl.wake_at(("ns", "deleted"), time.time() + 0.1)
    ctl.wake_at(("ns", "kept"), time.time() + 0.1)
    ctl.forget(("ns", "deleted"))
    await asyncio.sleep(0.4)
    assert woken == [("ns", "kept")]


async def test_the_earliest_wakeup_is_kept() -> None:
    ctl, woken = controller()
    key = ("ns", "a")
    ctl.wake_at(key, time.time() + 5.0)
    ctl.wake_at(key, time.time() + 0.1)  # earlier: replaces the later one
    ctl.wake_at(key, time.time() + 3.0)  # later than the pending one: ignored
    await asyncio.sleep(0.4)
    assert woken == [key]
    assert key not in ctl._wakeups  # nothing else pending for it
