"""mode async: the engines generate rollouts continuously into a buffer while the trainers
train, never more than `async.maxStaleness` policy versions ahead.

The rollout for step j trains under policy version `v_j` (the trainers' update count then). Its
generation may start only once the engines hold weights of version `>= v_j - maxStaleness`, so
no token of it is older than the bound when it trains and nothing is ever dropped; with
maxStaleness 1 this is one-step-off (step k+1's rollout is generated while step k trains).
After each step the trainers send the new weights:

- without `partialRollout`, between rollouts: the update waits for the rollout in flight to
  finish (one generation or one update holds the engines at a time);
- with it, at once: the weight sender pauses generation (retract), updates and continues it
  (`weight_sync.sender.paused`), and the requests in flight finish under the new weights.

How far ahead the engines run within the bound is `async.runAhead` (loops/run_ahead.py):
`adaptive` (the default) only as far as keeps the trainers fed, `bound` as far as the bound
allows.

A row's oldest token is at least of the version the engines held when its rollout was
submitted (the loop records it, and tells the rollout the version they hold as each request
goes, `held`: an engine reports only the newest, with the response); staleness counts the
oldest token of each row (loops/staleness.py), across a trajectory's turns too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kuberl_api.spec import RunAhead
from kuberl_trainer.loops.parts import (
    Parts,
    evaluation_due,
    report_step,
    save_if_due,
    sync_bytes,
    train_on,
)
from kuberl_trainer.loops.run_ahead import RunAheadDepth
from kuberl_trainer.loops.staleness import overlap_times, staleness_metrics
from kuberl_trainer.rollout.manager import Rollout


@dataclass
class _Engines:
    """What the loop knows of the engines: the weight version they hold, and what they did."""

    version: int
    ahead: RunAheadDepth
    # (notified on a new weight version, a rollout taken by the trainers, a new depth)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)  # a rollout or an update
    idle_s: float = 0.0  # held back (bound, depth) or by an update since the last step ended
    generating_s: float = 0.0  # generating since the last step ended

    async def hold(self, version: int) -> None:
        async with self.changed:
            self.version = version
            self.changed.notify_all()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


def train(parts: Parts, start: int, total: int, weight_version: int, *, max_staleness: int,
          partial_rollout: bool, run_ahead: RunAhead = "adaptive") -> int:
    """Steps start..total-1; returns the weight version reached. Raises on engine death
    past the restart budget."""
    return parts.aio.run_until_complete(_run(parts, start, total, weight_version,
                                             max_staleness, partial_rollout, run_ahead))


async def _run(parts: Parts, start: int, total: int, weight_version: int, max_staleness: int,
               partial: bool, run_ahead: RunAhead) -> int:
    engines = _Engines(version=weight_version, ahead=RunAheadDepth(max_staleness, run_ahead))
    ready: asyncio.Queue[tuple[Rollout, int]] = asyncio.Queue()
    producer = asyncio.ensure_future(_produce(parts, engines, ready, start, total,
                                              weight_version, max_staleness, partial))
    pool = ThreadPoolExecutor(1, thread_name_prefix="train")  # Ray calls block: off the loop
    # (an engine replaced mid-rollout gets the weights the trainers hold once their step is done)
    parts.fleet.arm(parts.train.push_weights, parts.bucket_bytes, weight_version, executor=pool)
    loop = asyncio.get_running_loop()
    try:
        for step in range(start, total):
            parts.stop.check()  # (told to stop: the rollouts not trained on are redrawn)
            t0 = time.perf_counter()
            rollout, submitted = await _next(ready, producer)
            waiting_after = ready.qsize()
            t1 = time.perf_counter()
            parts.stop.check()
            trained_from = weight_version
            stats = await loop.run_in_executor(pool, train_on, parts, rollout)
            weight_version += 1
            # Where the prompts stand before the first rollout not trained yet, read here:
            # the producer draws prompts on this thread, never while this code runs.
            position = parts.rollout.position_at(step + 1)
            staged, saved_s = await loop.run_in_executor(pool, save_if_due, parts, step,
                                                         weight_version, position)
            t2 = time.perf_counter()
            async with _between_rollouts(engines, partial):
                t_sync = time.perf_counter()
                synced = parts.train.synced_bytes
                # (dead engines replaced first, and during the sync: they get these weights)
                await parts.fleet.sync(parts.train.push_weights, weight_version,
                                       parts.bucket_bytes, executor=pool)
                await engines.hold(weight_version)
            t3 = time.perf_counter()
            step_s = t3 - t0 - saved_s
            trainers_idle_s = (t1 - t0) + (t_sync - t2)
            if step > start:  # (the first step waits for the first rollout whatever the depth)
                engines.ahead.observe(trainers_idle_s=trainers_idle_s,
                                      train_s=t2 - t1 - saved_s, waiting_after=waiting_after)
                await engines.notify()
            record = {
                "step": step, **rollout.metrics, **stats, "weight_version": weight_version,
                **staleness_metrics(trained_from, rollout.versions, submitted, max_staleness),
                "time_generate_s": rollout.seconds, **sync_bytes(parts, synced),
                "engine_restarts_total": parts.fleet.restarts,
                "run_ahead_depth": engines.ahead.depth,
                **overlap_times(train_s=t2 - t1 - saved_s, sync_s=t3 - t_sync,
                                step_s=step_s, trainers_idle_s=trainers_idle_s,
                                engines_idle_s=min(engines.idle_s, step_s),
                                generating_s=min(engines.generating_s, step_s)),
                **({"time_save_s": saved_s} if staged else {})}
            engines.idle_s = engines.generating_s = 0.0
            if evaluation_due(parts, step):  # under the weights just sent
                async with _between_rollouts(engines, partial):
                    record.update(await parts.rollout.evaluate(step))
            # (off the loop: a commit prunes, deleting a whole checkpoint)
            await loop.run_in_executor(pool, report_step, parts, step, staged, record)
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # (its error: raised)
            await producer
        pool.shutdown(wait=True)
    return weight_version


async def _produce(parts: Parts, engines: _Engines, ready: asyncio.Queue[tuple[Rollout, int]],
                   start: int, total: int, first_version: int, max_staleness: int,
                   partial: bool) -> None:
    """Generate every step's rollout in order, each as soon as the bound and the run-ahead
    depth allow."""
    for step in range(start, total):
        waited = time.perf_counter()
        async with engines.changed:
            # (the depth is the bound's own: maxStaleness, or less under runAhead adaptive;
            # read again on every wake, as it may change while the producer waits)
            while engines.version < first_version + (step - start) - engines.ahead.depth:
                await engines.changed.wait()
        async with _between_rollouts(engines, partial):  # (held: updates wait for it)
            began = time.perf_counter()
            engines.idle_s += began - waited
            submitted = engines.version
            # (partial rollouts: an update may come during it; each token is counted as of
            # the oldest weights that can have sampled it, agents.context)
            rollout = await parts.rollout.generate(step, held=lambda: engines.version)
            engines.generating_s += time.perf_counter() - began
        await ready.put((rollout, submitted))


@contextlib.asynccontextmanager
async def _between_rollouts(engines: _Engines, partial: bool) -> AsyncIterator[None]:
    """Hold the engines for an update or an evaluation (waiting for the rollout in flight),
    or, with partial rollouts, go ahead beside it (the update pauses generation itself)."""
    if partial:
        yield
        return
    async with engines.busy:
        yield


async def _next(ready: asyncio.Queue[tuple[Rollout, int]], producer: asyncio.Future[None]
                ) -> tuple[Rollout, int]:
    """The next rollout, or the error that stopped the producer (an engine's death)."""
    getting: asyncio.Future[tuple[Rollout, int]] = asyncio.ensure_future(ready.get())
    waiting: set[asyncio.Future[object]] = {getting, producer}  # type: ignore[arg-type]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if getting.done():
        return getting.result()
    getting.cancel()
    producer.result()  # raises what stopped it
    raise RuntimeError("the rollout producer stopped before the last step")
