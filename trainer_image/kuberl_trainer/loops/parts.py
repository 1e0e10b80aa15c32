"""What both training loops are given (Parts) and the pieces of a step they share: train on a
rollout, save when due, count the sync's bytes, evaluate when due, report the step."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kuberl_trainer.actors import TrainGroup
from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.fleet import Fleet
from kuberl_trainer.memory_handoff import MemoryHandoff
from kuberl_trainer.report.metrics_log import MetricsLog
from kuberl_trainer.rollout.manager import DataPosition, Rollout, RolloutManager
from kuberl_trainer.stopping import GracefulStop


class Staged(Protocol):
    """A checkpoint written, not yet the newest (checkpoint.Staged)."""

    step: int
    def commit(self) -> Path: ...


class Checkpointer(Protocol):
    def due(self, step: int) -> bool: ...
    def stage(self, step: int, weight_version: int,
              position: DataPosition | None = None) -> Staged: ...


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
    fleet: Fleet  # replaces engines that die
    eval_interval: int | None = None
    critic: Critic | None = None  # PPO's value model
    stop: GracefulStop = field(default_factory=GracefulStop)  # SIGTERM: stop at a safe point


def train_on(parts: Parts, rollout: Rollout) -> dict[str, float]:
    stats = parts.train.train(rollout.batch, rollout.sft)  # pi_old, pi_ref, step(s)
    parts.fleet.trained()  # (the weights an engine replaced from now on gets)
    if parts.critic is not None:
        stats |= parts.critic.train(rollout.batch)  # towards GAE's returns
    return stats


def save_if_due(parts: Parts, step: int, weight_version: int,
                position: DataPosition | None = None) -> tuple[Staged | None, float]:
    """(the checkpoint written after step `step`, if one was due, committed by report_step;
    the seconds it took). `position`: the prompts' position to record, when the caller took
    it (mode async)."""
    saving = time.perf_counter()
    if not parts.checkpointer.due(step + 1):
        return None, 0.0
    staged = parts.checkpointer.stage(step + 1, weight_version, position)
    return staged, time.perf_counter() - saving


def sync_bytes(parts: Parts, before: int) -> dict[str, int]:
    """The step's weight-sync bytes (sync: adapter, the adapter's, and the most adapters an
    engine holds): those its sync sent (`before`: the trainers' count when
    it began; only a sync that succeeded counts, so one that failed as an engine died and
    was made again counts once), and the process's total so far (every sync that succeeded,
    the start-up one's too)."""
    total = parts.train.synced_bytes
    out = {"weight_sync_bytes": total - before, "weight_sync_bytes_total": total}
    if parts.train.spec.adapter_sync:  # (LoRA's sync: adapter: the bound on what stays loaded)
        out["lora_adapters_loaded"] = parts.train.adapters_loaded
    return out


def evaluation_due(parts: Parts, step: int) -> bool:
    every = parts.eval_interval
    return every is not None and (step + 1) % every == 0


def report_step(parts: Parts, step: int, staged: Staged | None,
                record: dict[str, Any]) -> None:
    """The step's row, then the checkpoint it saved made the newest, then the progress line
    and the RLJob status: a checkpoint never lands before the rows of the steps it holds, so
    a run killed between the two resumes from the checkpoint before and trains the step
    again (its row dropped then: report/metrics_log.py)."""
    parts.log.write(record)
    ckpt = None if staged is None else (staged.step, str(staged.commit()))
    parts.reporter.step(step, record, ckpt)
