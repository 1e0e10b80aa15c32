"""PPO's critic: value-model workers on Ray, beside the training workers or on pods of their
own (``critic.placement``), with a torch.distributed group of their own.

The loop asks them for values of each rollout (GAE needs them before the policy trains) and
trains them on GAE's returns after the policy's step; their checkpoint is the ``critic/``
directory of each trainer checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.actors import RankGroup, TrainGroup, TrainWorker, combine_rank_metrics
from kuberl_trainer.backends.base import Backend, TrainBatch
from kuberl_trainer.placement import Layout
from kuberl_trainer.ray_actors import in_bundle, reserve

CRITIC_DIR = "critic"


class CriticWorker(TrainWorker):
    """One value-model rank (its backend is ``backends.value.ValueBackend``)."""

    role = "critic"  # its log file: critic-<rank>.log

    def on_gpu(self) -> bool:
        c = self.spec.critic
        return (c.gpus_per_node if c.placement == "dedicated"
                else self.spec.training.gpus_per_node) > 0

    def build_backend(self) -> Backend:
        from kuberl_trainer.backends.value import ValueBackend

        return ValueBackend(self.spec, rank=self.rank, world_size=self.world_size,
                            device=self.device)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        from kuberl_trainer.backends.value import ValueBackend

        assert isinstance(self.backend, ValueBackend)
        self.onload()
        return self.backend.values(batch)


class CriticGroup(RankGroup):
    """The critic workers, driven together (data-parallel shards, like ``TrainGroup``);
    usable once `setup` has returned (RankGroup)."""

    def __init__(self, spec: RLJobSpec, layout: Layout, trainers: TrainGroup, *,
                 one_machine: bool = False, log_dir: Path | None = None) -> None:
        shape = layout.critic_actor
        if shape is None:
            raise ValueError("the job has no critic (advantageEstimator is not ppo)")
        n = layout.critic_workers
        # Shared: in the training ranks' bundles, which reserved the critic's share too.
        pg = trainers.pg if layout.critic_shared else reserve(
            [shape.bundle() for _ in range(n)], "critic")
        self.spawn(CriticWorker, spec, [in_bundle(shape, pg, rank) for rank in range(n)],
                   sharing=n if one_machine else 1, log_dir=log_dir)

    def _shards(self, batch: TrainBatch) -> list[TrainBatch]:
        return batch.split(len(self.workers))

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` value estimates of the whole batch (a collective over the ranks)."""
        parts: Sequence[torch.Tensor] = ray.get(
            [w.values.remote(s) for w, s in zip(self.workers, self._shards(batch),
                                                 strict=True)])
        return torch.cat(list(parts))

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Train on the batch's ``returns`` (clipping around its ``values``); metrics prefixed
        ``critic_`` where the policy reports the same name."""
        results: Sequence[dict[str, float]] = ray.get(
            [w.train_step.remote(s) for w, s in zip(self.workers, self._shards(batch),
                                                     strict=True)])
        stats = combine_rank_metrics(results)
        keep = ("value_loss", "vf_clipfrac", "value_mean")
        return {k if k in keep else f"critic_{k}": v for k, v in stats.items()}

    def save(self, path: str) -> None:
        ray.get([w.save.remote(f"{path}/{CRITIC_DIR}") for w in self.workers])

    def load(self, path: str) -> None:
        ray.get([w.load.remote(f"{path}/{CRITIC_DIR}") for w in self.workers])
