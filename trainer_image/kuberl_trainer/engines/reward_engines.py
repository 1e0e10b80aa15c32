"""The served reward model's engines (reward.model): `replicas` engine actors, each running one
server of the reward model (engines/command.py's reward_engine_command) on a reward pod, as
EngineServer runs the policy's. The trainer calls them like a reward service
(rollout/reward_client.py, rollout/rewards/model_io.py); they take no weights.

Not replaced when one dies: its batches are retried on the other replicas (the scorer rotates
a batch's retries over them), and the step fails after reward.maxRetries, quoting the last
answer, with the dead server's exit code in the job's error line.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import ray

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.actors import ENGINE_LOG_TAIL_LINES, EngineServer, server_exit_code
from kuberl_trainer.placement import Layout, reward_actor, reward_sharing
from kuberl_trainer.ray_actors import placed

ROLE = "reward"


class RewardEngines:
    """Starts the replicas (their servers load while the rest of the job starts) and knows
    their URLs. `log_dir`: where each replica's output goes (reward-model-<i>.log)."""

    def __init__(self, spec: RLJobSpec, layout: Layout, seed: int, *,
                 one_machine: bool = False, log_dir: Path | None = None) -> None:
        model, shape = spec.reward.model, reward_actor(spec)
        if model is None or shape is None:
            raise ValueError("reward.type is not model: the job serves no reward model")
        spec_json = spec.model_dump_json(by_alias=True)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        sharing = reward_sharing(spec, layout, one_machine)
        self.logs = [None if log_dir is None else log_dir / f"reward-model-{i}.log"
                     for i in range(model.replicas)]
        self.actors: list[Any] = [
            ray.remote(EngineServer).options(**opts).remote(
                spec_json, i, seed + i, sharing,
                None if log is None else str(log.resolve()), 0, ROLE)
            for i, (opts, log) in enumerate(zip(placed(shape, model.replicas, "reward model"),
                                                self.logs, strict=True))]
        started: list[tuple[str, str]] = ray.get([a.start.remote(model.path)
                                                  for a in self.actors])
        self.urls = [url for url, _ in started]

    def dead(self) -> dict[str, int]:
        """Replicas whose server exited, with the exit code (-1: its actor is gone)."""
        polls = [a.poll.remote() for a in self.actors]
        codes = [server_exit_code(ref) for ref in polls]
        return {url: code for url, code in zip(self.urls, codes, strict=True)
                if code is not None}

    def log_tail(self, url: str, lines: int = ENGINE_LOG_TAIL_LINES) -> list[str]:
        """The last lines the replica serving `url` wrote."""
        actor = self.actors[self.urls.index(url)]
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            tail: list[str] = ray.get(actor.log_tail.remote(lines), timeout=30)
            return tail
        return []

    def stop(self) -> None:
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get([a.stop.remote() for a in self.actors])
