"""The training loop (mode sync): one screen, everything else is a part it calls (parts.py)."""

from __future__ import annotations

import time

from kuberl_trainer.loops.parts import (
    Parts,
    evaluation_due,
    report_step,
    save_if_due,
    sync_bytes,
    train_on,
)


def train(parts: Parts, start: int, total: int, weight_version: int) -> int:
    """Steps start..total-1; returns the weight version reached. Raises on engine death
    past the restart budget."""
    parts.fleet.arm(parts.train.push_weights, parts.bucket_bytes, weight_version)
    for step in range(start, total):
        t0 = time.perf_counter()
        # -> batch; colocated, once sampled, the GPUs pass from the engines to the trainers
        # (abandoned when the head is told to stop: nothing has changed the weights yet)
        rollout = parts.stop.abandonable(parts.aio, parts.rollout.generate(step))
        t1 = time.perf_counter()
        parts.stop.check()
        stats = train_on(parts, rollout)
        weight_version += 1
        # A checkpoint while the trainers hold their GPUs (colocated, every byte of their
        # state is still there and the engines' memory is released)
        staged, saved_s = save_if_due(parts, step, weight_version)
        parts.memory.trained()  # colocated: the optimizer's state to host memory
        t2 = time.perf_counter()
        parts.memory.before_sync()  # colocated: the engines' weights come back first
        synced = parts.train.synced_bytes
        # (dead engines replaced first, and during the sync: they get these weights)
        parts.aio.run_until_complete(parts.fleet.sync(
            parts.train.push_weights, weight_version, parts.bucket_bytes))
        parts.memory.to_engines()  # colocated: the GPUs pass back to the engines
        t3 = time.perf_counter()
        handoff = parts.memory.step_metrics()  # seconds within the phases' times
        record = {"step": step, **rollout.metrics, **stats, "weight_version": weight_version,
                  "time_generate_s": t1 - t0, "time_train_s": t2 - t1 - saved_s,
                  "time_sync_s": t3 - t2, "time_step_s": t3 - t0 - saved_s, **handoff,
                  # every sample drawn by the weights trained on (what lets the train-inference
                  # gap alert tell a sync job's gap, all numerics, from an async job's)
                  "staleness_mean": 0.0, "staleness_max": 0.0,
                  **sync_bytes(parts, synced), "engine_restarts_total": parts.fleet.restarts,
                  **({"time_save_s": saved_s} if staged else {})}
        if evaluation_due(parts, step):  # under the weights just sent
            record.update(parts.aio.run_until_complete(parts.rollout.evaluate(step)))
        report_step(parts, step, staged, record)
    return weight_version
