"""The whole spec, `RLJobSpec`: its sections, and what the operator and the trainer derive from
them (GPU counts, engines, batch sizes, defaults that depend on placement). The rules that span
sections are in job_rules.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel, rules_schema
from kuberl_api.spec.algorithm import AlgorithmSpec
from kuberl_api.spec.code import CodeSpec
from kuberl_api.spec.critic import CriticSpec
from kuberl_api.spec.data import DataSpec
from kuberl_api.spec.environment import EnvironmentSpec
from kuberl_api.spec.job_rules import JOB_RULES
from kuberl_api.spec.model import ModelSpec
from kuberl_api.spec.network import NetworkSpec
from kuberl_api.spec.reward import RewardSpec
from kuberl_api.spec.rollout import (
    COLOCATED_MEMORY_FRACTION,
    DEFAULT_ENGINE_RESTARTS,
    RolloutSpec,
)
from kuberl_api.spec.schedule import CheckpointSpec, ScheduleSpec
from kuberl_api.spec.scheduling import AsyncSpec, SchedulingSpec
from kuberl_api.spec.training import OffloadSpec, TrainingSpec

Placement = Literal["colocate", "disaggregated"]


class RLJobSpec(ApiModel):
    RULES = JOB_RULES
    model_config = {"json_schema_extra": rules_schema(RULES)}

    model: ModelSpec
    data: DataSpec
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    critic: CriticSpec = Field(default_factory=CriticSpec)
    code: CodeSpec = Field(default_factory=CodeSpec)
    placement: Placement = "colocate"
    mode: Literal["sync", "async", "eval"] = Field(
        "sync", description="sync: generate, then train, then push weights, each step; async: "
        "engines generate while the trainers train, within async.maxStaleness (disaggregated "
        "only); eval: evaluate model.path (a base model, or a checkpoint's model/ directory) "
        "on data.evalSets once, train nothing, and exit.")
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    suspend: bool = Field(False, description="Delete the Ray cluster and hold; false resumes "
                          "from the last checkpoint.")
    backoff_limit: int = Field(3, ge=0, le=99,
                               description="Restarts (from the last checkpoint) before Failed.")
    active_deadline_seconds: int | None = Field(None, ge=1,
                                                description="Fail the job after this long.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the RLJob this long after it finished.")
    heartbeat_timeout_seconds: int = Field(
        900, ge=30, le=86400,
        description="A running trainer silent for this long counts as lost (Stalled).")

    @property
    def global_batch_size(self) -> int:
        samples = self.data.rollout_batch_size * self.data.n_samples_per_prompt
        return self.training.global_batch_size or samples

    @property
    def global_batch_rows(self) -> int:
        """The rows of one optimizer step: the global batch's samples, each its
        rollout.maxRowsPerSample rows (a sample's rows train in the same step)."""
        return self.global_batch_size * self.rollout.max_rows_per_sample

    @property
    def has_critic(self) -> bool:
        return self.algorithm.advantage_estimator == "ppo"

    @property
    def critic_world_size(self) -> int:
        """Critic workers: one beside each training worker (shared), or one per dedicated
        GPU (one per dedicated pod on CPU)."""
        c = self.critic
        if c.placement == "shared":
            return self.training.world_size
        return c.nodes * c.gpus_per_node if c.gpus_per_node else c.nodes

    @property
    def training_gpus(self) -> int:
        return self.training.nodes * self.training.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        if self.rollout.gpus is not None:
            return self.rollout.gpus
        return self.training_gpus if self.placement == "colocate" else 0

    @property
    def num_engines(self) -> int:
        if self.rollout_gpus == 0:
            return self.rollout.engines or 1
        return self.rollout_gpus // self.rollout.gpus_per_engine

    @property
    def engine_nodes(self) -> int:
        """Nodes (rollout pods, Ray actors) one engine spans: gpusPerEngine / gpusPerNode when
        a disaggregated engine is wider than a node (SGLang's --nnodes), else 1. On CPU the
        engine's TP processes count as its GPUs."""
        r = self.rollout
        if self.placement != "disaggregated" or r.gpus_per_engine <= r.gpus_per_node:
            return 1
        return r.gpus_per_engine // r.gpus_per_node

    @property
    def has_gpu_pods(self) -> bool:
        critic = (self.has_critic and self.critic.placement == "dedicated"
                  and self.critic.gpus_per_node > 0)
        return self.training.gpus_per_node > 0 or self.rollout_gpus > 0 or critic


    @property
    def adapter_sync(self) -> bool:
        """The engines get the policy's LoRA adapter itself (training.lora.sync: adapter)."""
        return self.training.lora is not None and self.training.lora.sync == "adapter"

    @property
    def adapter_slots(self) -> int:
        """How many adapter versions the engines keep loaded (sync: adapter): the newest and,
        in mode async, the maxStaleness before it, which requests still in flight may name
        (older ones are past the staleness bound); one in mode sync, where no request is in
        flight while the adapter changes."""
        return self.async_.max_staleness + 1 if self.mode == "async" else 1

    @property
    def engine_restart_budget(self) -> int:
        """rollout.maxEngineRestarts, by default DEFAULT_ENGINE_RESTARTS when disaggregated
        and 0 colocated."""
        if self.rollout.max_engine_restarts is not None:
            return self.rollout.max_engine_restarts
        return DEFAULT_ENGINE_RESTARTS if self.placement == "disaggregated" else 0

    @property
    def engine_memory_fraction(self) -> float | None:
        """The engines' static pool share of each GPU (--mem-fraction-static), or None to leave
        it to the engine: rollout.memoryFraction, by default COLOCATED_MEMORY_FRACTION for
        colocated engines on GPUs."""
        if self.rollout.memory_fraction is not None:
            return self.rollout.memory_fraction
        if self.placement == "colocate" and self.rollout_gpus:
            return COLOCATED_MEMORY_FRACTION
        return None

    @property
    def trainer_offload(self) -> OffloadSpec | None:
        """What training ranks offload between phases: training.offload, by default both
        parts when colocated; None when disaggregated (no memory handoff)."""
        return self.training.offload if self.placement == "colocate" else None
