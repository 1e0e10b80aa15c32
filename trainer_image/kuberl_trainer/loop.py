"""The training loop: one screen, everything else is a part it calls."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kuberl_trainer.actors import EngineGroup, TrainGroup
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.memory_handoff import MemoryHandoff
from kuberl_trainer.metrics_log import MetricsLog
from kuberl_trainer.rollout import Rollout, RolloutManager
from kuberl_trainer.staleness import Phases, overlap_times, staleness_metrics


class Checkpointer(Protocol):
    def due(self, step: int) -> bool: ...
    def save(self, step: int, weight_version: int) -> str: ...


class Critic(Protocol):
    def train(self, batch: TrainBatch) -> dict[str, float]: ...


class Reporter(Protocol):
    def step(self, step: int, metrics: dict[str, Any], checkpoint: tuple[int, str] | None
             ) -> None: ...


@dataclass
class Parts:
    aio: asyncio.AbstractEventLoop  # the engine client's loop (its HTTP session lives on it)
    rollout: RolloutManager
    train: TrainGroup
    engines: EngineGroup
    log: MetricsLog
    checkpointer: Checkpointer
    reporter: Reporter
    bucket_bytes: int
    memory: MemoryHandoff  # colocated engines and trainers take turns with the GPUs
    eval_interval: int | None = None
    critic: Critic | None = None  # PPO's value model


def train(parts: Parts, start: int, total: int, weight_version: int) -> int:
    """Steps start..total-1; returns the weight version reached. Raises on engine death."""
    for step in range(start, total):
        t0 = time.perf_counter()
        # -> batch; colocated, once sampled, the GPUs pass from the engines to the trainers
        rollout = parts.aio.run_until_complete(parts.rollout.generate(step))
        t1 = time.perf_counter()
        stats = _train(parts, rollout)
        weight_version += 1
        # A checkpoint while the trainers hold their GPUs (colocated, every byte of their
        # state is still there and the engines' memory is released)
        ckpt, saved_s = _save_if_due(parts, step, weight_version)
        parts.memory.trained()  # colocated: the optimizer's state to host memory
        t2 = time.perf_counter()
        parts.memory.before_sync()  # colocated: the engines' weights come back first
        parts.train.push_weights(parts.engines.urls, weight_version, parts.bucket_bytes)
        parts.memory.to_engines()  # colocated: the GPUs pass back to the engines
        t3 = time.perf_counter()
        handoff = parts.memory.step_metrics()  # seconds within the phases' times
        _finish(parts, step, ckpt, {
            "step": step, **rollout.metrics, **stats, "weight_version": weight_version,
            "time_generate_s": t1 - t0, "time_train_s": t2 - t1 - saved_s,
            "time_sync_s": t3 - t2, "time_step_s": t3 - t0 - saved_s, **handoff,
            **({"time_save_s": saved_s} if ckpt else {})})
    return weight_version


def train_one_step_off(parts: Parts, start: int, total: int, weight_version: int) -> int:
    """mode async (maxStaleness 1, disaggregated): while step k trains, the engines generate
    step k+1's rollout under the weights step k started from; once both are done the new
    weights go to the engines, between rollouts. Every sample of step k+1 is then exactly one
    version behind the policy that trains on it (the first step's: none)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="train")  # Ray calls block: off the loop
    waited = time.perf_counter()
    rollout = parts.aio.run_until_complete(parts.rollout.generate(start)) if start < total \
        else None
    waited = time.perf_counter() - waited  # the first rollout has nothing to overlap
    generated_under = weight_version  # what the engines held (they report it too)
    try:
        for step in range(start, total):
            assert rollout is not None
            t0 = time.perf_counter()
            trained_from = weight_version
            stats, ahead, phases = parts.aio.run_until_complete(_overlap(
                parts, pool, rollout, step + 1 if step + 1 < total else None))
            weight_version += 1
            ckpt, saved_s = _save_if_due(parts, step, weight_version)
            t2 = time.perf_counter()
            parts.train.push_weights(parts.engines.urls, weight_version, parts.bucket_bytes)
            t3 = time.perf_counter()
            times = overlap_times(phases, sync_s=t3 - t2, step_s=t3 - t0 - saved_s + waited)
            _finish(parts, step, ckpt, {
                "step": step, **rollout.metrics, **stats, "weight_version": weight_version,
                **staleness_metrics(trained_from, rollout.versions, generated_under),
                "time_generate_s": rollout.seconds, **times,
                "time_wait_rollout_s": times["time_wait_rollout_s"] + waited,
                **({"time_save_s": saved_s} if ckpt else {})})
            rollout, waited, generated_under = ahead, 0.0, trained_from
    finally:
        pool.shutdown(wait=True)
    return weight_version


async def _overlap(parts: Parts, pool: ThreadPoolExecutor, rollout: Rollout,
                   next_step: int | None) -> tuple[dict[str, float], Rollout | None, Phases]:
    """Train on `rollout` while the engines generate `next_step`'s; both finish."""
    started = time.perf_counter()
    phases = Phases()

    async def training() -> dict[str, float]:
        stats = await asyncio.get_running_loop().run_in_executor(pool, _train, parts, rollout)
        phases.train_s = time.perf_counter() - started
        return stats

    async def generating() -> Rollout | None:
        if next_step is None:
            return None
        ahead = await parts.rollout.generate(next_step)
        phases.generate_s = time.perf_counter() - started
        return ahead

    stats, ahead = await asyncio.gather(training(), generating())
    return stats, ahead, phases


def _train(parts: Parts, rollout: Rollout) -> dict[str, float]:
    stats = parts.train.train(rollout.batch, rollout.sft)  # pi_old, pi_ref, step(s)
    if parts.critic is not None:
        stats |= parts.critic.train(rollout.batch)  # towards GAE's returns
    return stats


def _save_if_due(parts: Parts, step: int, weight_version: int
                 ) -> tuple[tuple[int, str] | None, float]:
    """(the checkpoint written after step `step`, if one was due; the seconds it took)."""
    saving = time.perf_counter()
    if not parts.checkpointer.due(step + 1):
        return None, 0.0
    ckpt = (step + 1, parts.checkpointer.save(step + 1, weight_version))
    return ckpt, time.perf_counter() - saving


def _finish(parts: Parts, step: int, ckpt: tuple[int, str] | None,
            record: dict[str, Any]) -> None:
    """Evaluate when due (under the weights just sent), then log and report the step."""
    every = parts.eval_interval
    if every and (step + 1) % every == 0:
        record.update(parts.aio.run_until_complete(parts.rollout.evaluate(step)))
    parts.log.write(record)
    parts.reporter.step(step, record, ckpt)
