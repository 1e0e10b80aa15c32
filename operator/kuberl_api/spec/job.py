"""The whole spec, `RLJobSpec`: its sections, and the rules that span them (placement, GPUs
and batch sizes across sections, settings that one section makes meaningless in another)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from kuberl_api.base import ApiModel, cel, cel_rules, check
from kuberl_api.spec.algorithm import AlgorithmSpec
from kuberl_api.spec.common import (
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_ENGINE,
    MAX_GPUS_PER_NODE,
    MAX_MICRO_BATCH,
    MAX_NODES,
    MAX_ROLLOUT_BATCH,
    MAX_ROLLOUT_GPUS,
    MAX_SAMPLES_PER_PROMPT,
    _at_default,
    _at_defaults,
    _gpus_outside,
    _is_default,
    _mp_outside,
    _outside,
    _shown,
)
from kuberl_api.spec.critic import CriticSpec
from kuberl_api.spec.data import DataSpec
from kuberl_api.spec.model import ModelSpec
from kuberl_api.spec.network import NetworkSpec
from kuberl_api.spec.reward import RewardSpec
from kuberl_api.spec.rollout import (
    _ROLLOUT_GPUS_OUTSIDE,
    COLOCATED_MEMORY_FRACTION,
    DEFAULT_ENGINE_RESTARTS,
    MEMORY_SAVER_COLOCATED,
    HealthProbe,
    RolloutSpec,
)
from kuberl_api.spec.schedule import CheckpointSpec, ScheduleSpec
from kuberl_api.spec.scheduling import AsyncSpec, SchedulingSpec
from kuberl_api.spec.training import OFFLOAD_COLOCATED_ONLY, OffloadSpec, TrainingSpec

Placement = Literal["colocate", "disaggregated"]

# Data-parallel size as a CEL expression over the spec (world size / model-parallel size).
_DP = ("((self.training.gpusPerNode == 0 ? self.training.nodes : "
       "self.training.nodes * self.training.gpusPerNode) / (self.training.parallelism.tp * "
       "self.training.parallelism.pp * self.training.parallelism.cp))")
_GBS = ("(has(self.training.globalBatchSize) ? self.training.globalBatchSize : "
        "self.data.rolloutBatchSize * self.data.nSamplesPerPrompt)")
_CRITIC_WORLD = ("(self.critic.gpusPerNode == 0 ? self.critic.nodes : "
                 "self.critic.nodes * self.critic.gpusPerNode)")
# The range guards (see _outside) of the batch sizes: the samples of one rollout, and the
# global batch (globalBatchSize, or those samples when it is unset).
_BATCH_OUTSIDE = (
    f"{_outside('self.data.rolloutBatchSize', 1, MAX_ROLLOUT_BATCH)} || "
    f"{_outside('self.data.nSamplesPerPrompt', 1, MAX_SAMPLES_PER_PROMPT)} || "
    f"{_outside('self.training.globalBatchSize', 1, MAX_GLOBAL_BATCH, optional=True)}")


# Whether rollout runs on CPU (no rollout GPUs) or on GPUs, as CEL over the spec. A
# disaggregated job without rollout.gpus is neither: the rule that requires it reports that.
_ROLLOUT_ON_CPU = ("(has(self.rollout.gpus) ? self.rollout.gpus == 0 : "
                   "(self.placement == 'colocate' && self.training.gpusPerNode == 0))")
_ROLLOUT_ON_GPU = ("(has(self.rollout.gpus) ? self.rollout.gpus > 0 : "
                   "(self.placement == 'colocate' && self.training.gpusPerNode > 0))")
# Whether any pod of the job has GPUs: training, rollout, or a dedicated PPO critic.
_HAS_GPU_PODS = (f"(self.training.gpusPerNode > 0 || !{_ROLLOUT_ON_CPU} || "
                 "(self.algorithm.advantageEstimator == 'ppo' && self.critic.placement == "
                 "'dedicated' && self.critic.gpusPerNode > 0))")


ENGINE_RESTARTS_DISAGGREGATED = ("rollout.maxEngineRestarts above 0 needs placement: "
                                 "disaggregated (colocated engines share the training GPUs and "
                                 "are not replaced)")
HEALTH_PROBE_NEEDS_RESTARTS = ("rollout.healthProbe applies only where engines are replaced "
                               "(placement: disaggregated, rollout.maxEngineRestarts above 0): "
                               "leave it at its defaults")
ASYNC_DISAGGREGATED = ("mode: async needs placement: disaggregated (colocated engines and "
                       "trainers take turns with the same GPUs: there is nothing to overlap)")
ASYNC_SETTINGS_ASYNC_ONLY = ("async settings apply to mode: async only: leave them at their "
                             "defaults")
SGLANG_NEEDS_GPUS = "engine sglang needs GPUs (rollout on CPU): use engine: reference"
ENGINES_ON_CPU_ONLY = ("rollout.engines applies only when rollout runs on CPU (no rollout "
                       "GPUs); with GPUs the engine count is rollout GPUs / gpusPerEngine")
CRITIC_PPO_ONLY = "critic applies to advantageEstimator: ppo only"
EVAL_NEEDS_BOTH = ("schedule.evalInterval needs data.evalSets, and data.evalSets are evaluated "
                   "only every schedule.evalInterval steps")
NETWORK_NEEDS_GPUS = ("network settings apply to GPU pods; this job has none (training."
                      "gpusPerNode is 0, and neither rollout nor a dedicated critic has GPUs)")
ENGINE_TILES_NODES = ("engines must tile the rollout nodes: rollout.gpusPerEngine must divide "
                      "rollout.gpusPerNode (engines share a node) or be a multiple of it (an "
                      "engine spans gpusPerEngine / gpusPerNode whole nodes)")
ROLLOUT_WHOLE_NODES = ("rollout.gpus above one node must fill whole nodes (a multiple of "
                       "rollout.gpusPerNode)")
# What colocated engines take from the training pods instead of their own fields.
COLOCATED_FROM_TRAINING = {
    "image": "on training.image",
    "resources": "within training.resources",
    "gpus_per_node": "on training.gpusPerNode GPUs each",
}
NETWORK_FIELDS = ("env", "nccl_socket_ifname", "host_network", "rdma", "weight_sync_port")


def _colocated_from_training(name: str) -> str:
    return (f"rollout.{to_camel(name)} applies to placement: disaggregated only (colocated "
            f"engines run in the training pods, {COLOCATED_FROM_TRAINING[name]})")


class RLJobSpec(ApiModel):
    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.mode == 'sync' || self.placement == 'disaggregated'",
                ASYNC_DISAGGREGATED, ".mode"),
            cel(f"self.mode == 'async' || {_at_defaults('self.async', AsyncSpec)}",
                ASYNC_SETTINGS_ASYNC_ONLY, ".async"),
            cel("self.placement == 'disaggregated' || !has(self.rollout.maxEngineRestarts) || "
                "self.rollout.maxEngineRestarts == 0", ENGINE_RESTARTS_DISAGGREGATED,
                ".rollout.maxEngineRestarts"),
            cel("(self.placement == 'disaggregated' && (!has(self.rollout.maxEngineRestarts) "
                "|| self.rollout.maxEngineRestarts > 0)) || "
                f"{_at_defaults('self.rollout.healthProbe', HealthProbe)}",
                HEALTH_PROBE_NEEDS_RESTARTS, ".rollout.healthProbe"),
            cel(f"!{_ROLLOUT_ON_CPU} || self.rollout.engine == 'reference'", SGLANG_NEEDS_GPUS,
                ".rollout.engine"),
            cel(f"!has(self.rollout.engines) || !{_ROLLOUT_ON_GPU}", ENGINES_ON_CPU_ONLY,
                ".rollout.engines"),
            *(cel(f"self.placement != 'colocate' || "
                  f"{_at_default('self.rollout', RolloutSpec, name)}",
                  _colocated_from_training(name), f".rollout.{to_camel(name)}")
              for name in COLOCATED_FROM_TRAINING),
            # On CPU (gpus 0) an engine's TP processes stand in for its GPUs, gpusPerNode of
            # them to a pod; one smaller pod holds every rollout GPU when they fit one node.
            cel("self.placement != 'disaggregated' || !has(self.rollout.gpus) || "
                f"{_ROLLOUT_GPUS_OUTSIDE.replace('self.gpus', 'self.rollout.gpus')} || "
                f"{_outside('self.rollout.gpusPerNode', 1, MAX_GPUS_PER_NODE)} || "
                f"{_outside('self.rollout.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
                "self.rollout.gpusPerEngine % self.rollout.gpusPerNode == 0 || "
                "(self.rollout.gpus == 0 ? self.rollout.gpusPerEngine < self.rollout.gpusPerNode"
                " : (self.rollout.gpus <= self.rollout.gpusPerNode || "
                "self.rollout.gpusPerNode % self.rollout.gpusPerEngine == 0))",
                ENGINE_TILES_NODES, ".rollout.gpusPerEngine"),
            cel("self.placement != 'disaggregated' || !has(self.rollout.gpus) || "
                f"{_outside('self.rollout.gpus', 0, MAX_ROLLOUT_GPUS)} || "
                f"{_outside('self.rollout.gpusPerNode', 1, MAX_GPUS_PER_NODE)} || "
                "self.rollout.gpus <= self.rollout.gpusPerNode || "
                "self.rollout.gpus % self.rollout.gpusPerNode == 0",
                ROLLOUT_WHOLE_NODES, ".rollout.gpus"),
            cel("self.algorithm.advantageEstimator == 'ppo' || "
                f"{_at_defaults('self.critic', CriticSpec)}", CRITIC_PPO_ONLY, ".critic"),
            cel("!has(self.schedule.evalInterval) || size(self.data.evalSets) > 0",
                EVAL_NEEDS_BOTH, ".schedule.evalInterval"),
            cel("size(self.data.evalSets) == 0 || has(self.schedule.evalInterval)",
                EVAL_NEEDS_BOTH, ".data.evalSets"),
            *(cel(f"{_HAS_GPU_PODS} || {_at_default('self.network', NetworkSpec, name)}",
                  NETWORK_NEEDS_GPUS, f".network.{to_camel(name)}")
              for name in NETWORK_FIELDS),
            cel("self.placement == 'colocate' || "
                f"{_at_defaults('self.training.offload', OffloadSpec)}",
                OFFLOAD_COLOCATED_ONLY, ".training.offload"),
            cel("self.placement != 'colocate' || self.rollout.engine != 'sglang' || "
                "!has(self.rollout.engineArgs) || "
                "!('enable-memory-saver' in self.rollout.engineArgs) || "
                "self.rollout.engineArgs['enable-memory-saver'] != 'false'",
                MEMORY_SAVER_COLOCATED, ".rollout.engineArgs"),
            cel("self.placement != 'disaggregated' || has(self.rollout.gpus)",
                "rollout.gpus is required when placement is disaggregated", ".rollout.gpus"),
            cel("self.placement != 'colocate' || !has(self.rollout.gpus) || "
                f"{_gpus_outside('self.training')} || "
                "self.rollout.gpus == (self.training.gpusPerNode == 0 ? 0 : "
                "self.training.nodes * self.training.gpusPerNode)",
                "colocated rollout uses the training GPUs: rollout.gpus must equal "
                "training.nodes * training.gpusPerNode", ".rollout.gpus"),
            cel("self.placement != 'colocate' || self.training.gpusPerNode == 0 || "
                f"{_outside('self.training.gpusPerNode', 0, MAX_GPUS_PER_NODE)} || "
                f"{_outside('self.rollout.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
                "self.training.gpusPerNode % self.rollout.gpusPerEngine == 0",
                "colocated engines must tile a training node: rollout.gpusPerEngine must "
                "divide training.gpusPerNode", ".rollout.gpusPerEngine"),
            cel("!has(self.algorithm.overlongBuffer) || "
                "self.algorithm.overlongBuffer <= self.data.maxResponseLen",
                "algorithm.overlongBuffer must not exceed data.maxResponseLen",
                ".algorithm.overlongBuffer"),
            cel("(self.algorithm.sftCoef > 0.0) == has(self.data.sft)",
                "algorithm.sftCoef > 0 needs data.sft, and data.sft is used only with it",
                ".data.sft"),
            cel(f"!has(self.data.sft) || {_gpus_outside('self.training')} || "
                f"{_mp_outside('self.training')} || {_BATCH_OUTSIDE} || {_DP} < 1 || "
                f"{_outside('self.data.sft.batchSize', 1, MAX_ROLLOUT_BATCH)} || "
                f"(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % {_GBS} != 0 || "
                "self.data.sft.batchSize % "
                f"({_DP} * ((self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) / {_GBS}))"
                " == 0",
                "data.sft.batchSize must split evenly over the step's optimizer steps and "
                "data-parallel ranks: a multiple of dataParallel * (rolloutBatchSize * "
                "nSamplesPerPrompt / globalBatchSize)", ".data.sft.batchSize"),
            cel("self.algorithm.advantageEstimator != 'rloo' || self.data.nSamplesPerPrompt >= 2",
                "advantageEstimator rloo needs data.nSamplesPerPrompt >= 2 (the baseline is "
                "the other samples' mean)", ".data.nSamplesPerPrompt"),
            cel("self.placement != 'colocate' || (size(self.rollout.nodePool.nodeSelector) == 0"
                " && size(self.rollout.nodePool.tolerations) == 0)",
                "colocated rollout runs on the training pool: set training.nodePool only",
                ".rollout.nodePool"),
            cel(f"{_BATCH_OUTSIDE} || "
                "(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % "
                "(has(self.training.globalBatchSize) ? self.training.globalBatchSize : "
                "self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) == 0",
                "training.globalBatchSize must divide rolloutBatchSize * nSamplesPerPrompt",
                ".training.globalBatchSize"),
            cel("self.algorithm.advantageEstimator != 'ppo' || self.critic.placement != "
                f"'dedicated' || {_outside('self.critic.nodes', 1, MAX_NODES)} || "
                f"{_outside('self.critic.gpusPerNode', 0, MAX_GPUS_PER_NODE)} || "
                f"{_outside('self.training.microBatchSize', 1, MAX_MICRO_BATCH)} || "
                f"{_BATCH_OUTSIDE} || "
                f"(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % {_GBS} != 0 || "
                f"{_GBS} % (self.training.microBatchSize * {_CRITIC_WORLD}) == 0",
                "the global batch must split evenly into micro-batches across the dedicated "
                "critic workers: training.microBatchSize * critic workers must divide it",
                ".critic.nodes"),
            # dataParallel is 0 only when tp*pp*cp exceeds the GPUs, which the training rule
            # reports; that guard keeps this rule from failing with a modulus-by-zero error.
            cel(f"{_gpus_outside('self.training')} || {_mp_outside('self.training')} || "
                f"{_outside('self.training.microBatchSize', 1, MAX_MICRO_BATCH)} || "
                f"{_BATCH_OUTSIDE} || {_DP} < 1 || (has(self.training.globalBatchSize) ? "
                "self.training.globalBatchSize : "
                "self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % "
                f"(self.training.microBatchSize * {_DP}) == 0",
                "the global batch must split evenly into micro-batches across data-parallel "
                "ranks: globalBatchSize % (microBatchSize * dataParallel) == 0",
                ".training.microBatchSize"),
            cel("!has(self.training.maxTokensPerMicroBatch) || "
                "self.training.maxTokensPerMicroBatch >= "
                "self.data.maxPromptLen + self.data.maxResponseLen",
                "training.maxTokensPerMicroBatch must hold the longest sample: at least "
                "data.maxPromptLen + data.maxResponseLen", ".training.maxTokensPerMicroBatch"),
            cel("!has(self.model.storage) || !has(self.data.storage) || "
                "self.model.storage.mountPath != self.data.storage.mountPath",
                "model and data PVCs need different storage.mountPath values",
                ".data.storage.mountPath"),
            cel("!has(self.model.storage) || self.model.storage.mountPath != "
                "self.checkpoint.path",
                "checkpoint.path must differ from model.storage.mountPath", ".checkpoint.path"),
            cel("!has(self.data.storage) || self.data.storage.mountPath != self.checkpoint.path",
                "checkpoint.path must differ from data.storage.mountPath", ".checkpoint.path"),
        )
    }

    model: ModelSpec
    data: DataSpec
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    critic: CriticSpec = Field(default_factory=CriticSpec)
    placement: Placement = "colocate"
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate, then train, then push weights, each step; async: "
        "engines generate while the trainers train, within async.maxStaleness (disaggregated "
        "only).")
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

    @model_validator(mode="after")
    def _cross_section(self) -> RLJobSpec:
        check(self.mode == "sync" or self.placement == "disaggregated", "mode", self.mode,
              ASYNC_DISAGGREGATED)
        check(self.mode == "async" or self.async_ == AsyncSpec(), "async",
              _shown(self.async_), ASYNC_SETTINGS_ASYNC_ONLY)
        restarts = self.rollout.max_engine_restarts
        check(self.placement == "disaggregated" or not restarts, "rollout.maxEngineRestarts",
              restarts, ENGINE_RESTARTS_DISAGGREGATED)
        check(self.engine_restart_budget > 0 or self.rollout.health_probe == HealthProbe(),
              "rollout.healthProbe", _shown(self.rollout.health_probe),
              HEALTH_PROBE_NEEDS_RESTARTS)
        if self.placement == "disaggregated":
            check(self.rollout.gpus is not None, "rollout.gpus", None,
                  "rollout.gpus is required when placement is disaggregated")
            self._check_disaggregated()
        else:
            self._check_colocated()
        self._check_rollout_devices()
        self._check_batches()
        self._check_mounts()
        self._check_algorithm()
        self._check_sft()
        self._check_eval()
        self._check_network()
        return self

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

    def _check_disaggregated(self) -> None:
        check(self.training.offload == OffloadSpec(), "training.offload",
              _shown(self.training.offload), OFFLOAD_COLOCATED_ONLY)
        r = self.rollout
        assert r.gpus is not None  # required: checked first
        gpe, gpn = r.gpus_per_engine, r.gpus_per_node
        tiles = (gpe % gpn == 0 or (gpe < gpn if r.gpus == 0
                                    else (r.gpus <= gpn or gpn % gpe == 0)))
        check(tiles, "rollout.gpusPerEngine", gpe,
              f"{ENGINE_TILES_NODES} (gpusPerNode = {gpn})")
        if not r.gpus:
            return
        check(r.gpus <= r.gpus_per_node or r.gpus % r.gpus_per_node == 0, "rollout.gpus",
              r.gpus, f"rollout.gpus above one node must fill whole nodes (a multiple of "
              f"rollout.gpusPerNode = {r.gpus_per_node})")

    def _check_rollout_devices(self) -> None:
        on_cpu = self.rollout_gpus == 0
        check(not on_cpu or self.rollout.engine == "reference", "rollout.engine",
              self.rollout.engine, SGLANG_NEEDS_GPUS)
        check(on_cpu or self.rollout.engines is None, "rollout.engines", self.rollout.engines,
              ENGINES_ON_CPU_ONLY)
        saver = self.rollout.engine_args.get("enable-memory-saver")
        check(not (self.placement == "colocate" and self.rollout.engine == "sglang"
                   and saver == "false"), "rollout.engineArgs",
              {"enable-memory-saver": saver}, MEMORY_SAVER_COLOCATED)

    def _check_eval(self) -> None:
        interval, sets = self.schedule.eval_interval, self.data.eval_sets
        check(interval is None or bool(sets), "schedule.evalInterval", interval,
              EVAL_NEEDS_BOTH)
        check(not sets or interval is not None, "data.evalSets", [e.name for e in sets],
              EVAL_NEEDS_BOTH)

    def _check_network(self) -> None:
        if self.has_gpu_pods:
            return
        for name in NETWORK_FIELDS:
            check(_is_default(self.network, name), f"network.{to_camel(name)}",
                  _shown(getattr(self.network, name)), NETWORK_NEEDS_GPUS)

    def _check_sft(self) -> None:
        sft = self.data.sft
        check((self.algorithm.sft_coef > 0) == (sft is not None), "data.sft",
              sft.model_dump(by_alias=True) if sft else None,
              "algorithm.sftCoef > 0 needs data.sft, and data.sft is used only with it")
        samples = self.data.rollout_batch_size * self.data.n_samples_per_prompt
        if sft is None or samples % self.global_batch_size:
            return
        parts = self.training.data_parallel * (samples // self.global_batch_size)
        check(parts > 0 and sft.batch_size % parts == 0, "data.sft.batchSize", sft.batch_size,
              f"data.sft.batchSize must split evenly over the step's optimizer steps and "
              f"data-parallel ranks: a multiple of dataParallel * (rolloutBatchSize * "
              f"nSamplesPerPrompt / globalBatchSize) = {parts}")

    def _check_algorithm(self) -> None:
        check(self.has_critic or self.critic == CriticSpec(), "critic", _shown(self.critic),
              CRITIC_PPO_ONLY)
        buffer = self.algorithm.overlong_buffer
        check(buffer is None or buffer <= self.data.max_response_len,
              "algorithm.overlongBuffer", buffer,
              "algorithm.overlongBuffer must not exceed data.maxResponseLen")
        check(self.algorithm.advantage_estimator != "rloo" or self.data.n_samples_per_prompt >= 2,
              "data.nSamplesPerPrompt", self.data.n_samples_per_prompt,
              "advantageEstimator rloo needs data.nSamplesPerPrompt >= 2 (the baseline is the "
              "other samples' mean)")

    def _check_mounts(self) -> None:
        """Two volumes at one mount point make the API server refuse the pod."""
        model = self.model.storage.mount_path if self.model.storage else None
        data = self.data.storage.mount_path if self.data.storage else None
        ckpt = self.checkpoint.path
        check(model is None or model != data, "data.storage.mountPath", data,
              "model and data PVCs need different storage.mountPath values")
        check(model != ckpt, "checkpoint.path", ckpt,
              "checkpoint.path must differ from model.storage.mountPath")
        check(data != ckpt, "checkpoint.path", ckpt,
              "checkpoint.path must differ from data.storage.mountPath")

    def _check_colocated(self) -> None:
        if self.rollout.gpus is not None:
            check(self.rollout.gpus == self.training_gpus, "rollout.gpus", self.rollout.gpus,
                  f"colocated rollout uses the training GPUs: rollout.gpus must equal "
                  f"training.nodes * training.gpusPerNode = {self.training_gpus} (or be unset)")
        per_node = self.training.gpus_per_node
        if per_node:
            check(per_node % self.rollout.gpus_per_engine == 0, "rollout.gpusPerEngine",
                  self.rollout.gpus_per_engine,
                  f"colocated engines must tile a training node: gpusPerEngine must divide "
                  f"training.gpusPerNode = {per_node}")
        pool = self.rollout.node_pool
        check(not pool.node_selector and not pool.tolerations, "rollout.nodePool", _shown(pool),
              "colocated rollout runs on the training pool: set training.nodePool only")
        for name in COLOCATED_FROM_TRAINING:
            check(_is_default(self.rollout, name), f"rollout.{to_camel(name)}",
                  _shown(getattr(self.rollout, name)), _colocated_from_training(name))

    def _check_batches(self) -> None:
        longest = self.data.max_prompt_len + self.data.max_response_len
        budget = self.training.max_tokens_per_micro_batch
        check(budget is None or budget >= longest, "training.maxTokensPerMicroBatch", budget,
              f"must hold the longest sample: at least data.maxPromptLen + "
              f"data.maxResponseLen = {longest}")
        samples = self.data.rollout_batch_size * self.data.n_samples_per_prompt
        gbs = self.global_batch_size
        if self.has_critic and self.critic.placement == "dedicated" and samples % gbs == 0:
            per_step = self.training.micro_batch_size * self.critic_world_size
            check(gbs % per_step == 0, "critic.nodes", self.critic.nodes,
                  f"the global batch ({gbs}) must split evenly into micro-batches across the "
                  f"dedicated critic workers: training.microBatchSize * critic workers "
                  f"({self.training.micro_batch_size} * {self.critic_world_size}) must divide it")
        check(samples % gbs == 0, "training.globalBatchSize", gbs,
              f"globalBatchSize must divide rolloutBatchSize * nSamplesPerPrompt = {samples}")
        per_step = self.training.micro_batch_size * self.training.data_parallel
        check(gbs % per_step == 0, "training.microBatchSize", self.training.micro_batch_size,
              f"the global batch ({gbs}) must split evenly into micro-batches across "
              f"data-parallel ranks: microBatchSize * dataParallel "
              f"({self.training.micro_batch_size} * {self.training.data_parallel}) must divide it")
