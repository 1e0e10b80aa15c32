"""The rules that span sections of the spec (RLJobSpec.RULES), each as a `Rule`: its CEL over the
whole spec and its Python twin over an RLJobSpec, side by side, with their messages and the
CEL fragments (and Python twins) they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic.alias_generators import to_camel

from kuberl_api.base import Rule
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
    under,
    under_cel,
)
from kuberl_api.spec.critic import CriticSpec
from kuberl_api.spec.model import Storage
from kuberl_api.spec.network import NetworkSpec
from kuberl_api.spec.rollout import (
    _ROLLOUT_GPUS_OUTSIDE,
    MEMORY_SAVER_COLOCATED,
    HealthProbe,
    RolloutSpec,
)
from kuberl_api.spec.scheduling import AsyncSpec
from kuberl_api.spec.training import OFFLOAD_COLOCATED_ONLY, OffloadSpec

if TYPE_CHECKING:
    from kuberl_api.spec.job import RLJobSpec

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


def _samples(spec: RLJobSpec) -> int:
    """The samples of one rollout (Python's twin of CEL's rolloutBatchSize * nSamplesPerPrompt;
    spec.global_batch_size is `_GBS`'s, spec.training.data_parallel `_DP`'s)."""
    return spec.data.rollout_batch_size * spec.data.n_samples_per_prompt


def _longest(spec: RLJobSpec) -> int:
    """The longest sample, in tokens."""
    return spec.data.max_prompt_len + spec.data.max_response_len


# Whether rollout runs on CPU (no rollout GPUs) or on GPUs, as CEL over the spec. A
# disaggregated job without rollout.gpus is neither: the rule that requires it reports that.
_ROLLOUT_ON_CPU = ("(has(self.rollout.gpus) ? self.rollout.gpus == 0 : "
                   "(self.placement == 'colocate' && self.training.gpusPerNode == 0))")
_ROLLOUT_ON_GPU = ("(has(self.rollout.gpus) ? self.rollout.gpus > 0 : "
                   "(self.placement == 'colocate' && self.training.gpusPerNode > 0))")
# Whether any pod of the job has GPUs: training, rollout, a dedicated PPO critic, or a served
# reward model.
_HAS_GPU_PODS = (f"(self.training.gpusPerNode > 0 || !{_ROLLOUT_ON_CPU} || "
                 "(self.algorithm.advantageEstimator == 'ppo' && self.critic.placement == "
                 "'dedicated' && self.critic.gpusPerNode > 0) || "
                 "(self.reward.type == 'model' && has(self.reward.model) && "
                 "self.reward.model.gpusPerReplica > 0))")


# The Python twins of the three above, neither-nor included (so both forms of a rule agree on
# a disaggregated job without rollout.gpus; RLJobSpec's properties count its rollout GPUs as 0).
def _rollout_on_cpu(spec: RLJobSpec) -> bool:
    if spec.rollout.gpus is not None:
        return spec.rollout.gpus == 0
    return spec.placement == "colocate" and spec.training.gpus_per_node == 0


def _rollout_on_gpu(spec: RLJobSpec) -> bool:
    if spec.rollout.gpus is not None:
        return spec.rollout.gpus > 0
    return spec.placement == "colocate" and spec.training.gpus_per_node > 0


def _has_gpu_pods(spec: RLJobSpec) -> bool:
    critic = (spec.has_critic and spec.critic.placement == "dedicated"
              and spec.critic.gpus_per_node > 0)
    reward = (spec.reward.type == "model" and spec.reward.model is not None
              and spec.reward.model.gpus_per_replica > 0)
    return spec.training.gpus_per_node > 0 or not _rollout_on_cpu(spec) or critic or reward


ENGINE_RESTARTS_DISAGGREGATED = ("rollout.maxEngineRestarts above 0 needs placement: "
                                 "disaggregated (colocated engines share the training GPUs and "
                                 "are not replaced)")
HEALTH_PROBE_NEEDS_RESTARTS = ("rollout.healthProbe applies only where engines are replaced "
                               "(placement: disaggregated, rollout.maxEngineRestarts above 0): "
                               "leave it at its defaults")
ASYNC_DISAGGREGATED = ("mode: async needs placement: disaggregated (colocated engines and "
                       "trainers take turns with the same GPUs: there is nothing to overlap)")
ASYNC_ENGINE_OLD = ("algorithm.oldLogprobs: engine cannot go with mode: async: decoupled PPO "
                    "clips around the trainer's proximal policy, which the engines' log-probs "
                    "of older weights are not (use oldLogprobs: trainer)")
ASYNC_CORRECTION_NONE_UNUSED = (
    "async.offPolicyCorrection: none has no effect while algorithm.tisCap or "
    "algorithm.importanceMask is set (they are the correction, in either setting): unset them "
    "for no correction, or leave offPolicyCorrection at truncated")
ASYNC_SETTINGS_ASYNC_ONLY = ("async settings apply to mode: async only: leave them at their "
                             "defaults")
SGLANG_NEEDS_GPUS = "engine sglang needs GPUs (rollout on CPU): use engine: reference"
ENGINES_ON_CPU_ONLY = ("rollout.engines applies only when rollout runs on CPU (no rollout "
                       "GPUs); with GPUs the engine count is rollout GPUs / gpusPerEngine")
CRITIC_PPO_ONLY = "critic applies to advantageEstimator: ppo only"
ADAPTER_REFERENCE_TP = ("training.lora.sync adapter: the reference engine serves adapters on "
                        "one process only; set rollout.gpusPerEngine to 1, use engine sglang, "
                        "or use sync merged")
REPLAY_ROLLOUT_SGLANG = ("algorithm.routingReplay rollout needs the engine to return the experts "
                         "it routed each token to; SGLang 0.5.6 (the pinned release) has no "
                         "such request field (return_routed_experts arrives in 0.5.7): use "
                         "engine reference, or routingReplay training or none")
REPLAY_ROLLOUT_ROUTER = ("algorithm.routingReplay rollout: sglang-router (0.3.2) does not pass "
                         "a request's return_routed_experts on to the engines, so no route "
                         "would come back: use rollout.router none (kuberl's own client "
                         "spreads the requests)")
EVAL_MODE_NEEDS_SETS = ("mode: eval evaluates data.evalSets once and trains nothing: it needs "
                        "at least one eval set")
EVAL_NEEDS_BOTH = ("schedule.evalInterval needs data.evalSets, and data.evalSets are evaluated "
                   "only every schedule.evalInterval steps")
NETWORK_NEEDS_GPUS = ("network settings apply to GPU pods; this job has none (training."
                      "gpusPerNode is 0, and neither rollout, a dedicated critic nor a served "
                      "reward model has GPUs)")
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


def _colocated_from_training_rule(name: str) -> Rule:
    return Rule(f"self.placement != 'colocate' || "
                f"{_at_default('self.rollout', RolloutSpec, name)}",
                lambda s: s.placement != "colocate" or _is_default(s.rollout, name),
                _colocated_from_training(name), f"rollout.{to_camel(name)}")


def _network_needs_gpus_rule(name: str) -> Rule:
    return Rule(f"{_HAS_GPU_PODS} || {_at_default('self.network', NetworkSpec, name)}",
                lambda s: _has_gpu_pods(s) or _is_default(s.network, name),
                NETWORK_NEEDS_GPUS, f"network.{to_camel(name)}")


def _engines_tile_nodes(spec: RLJobSpec) -> bool:
    r = spec.rollout
    if spec.placement != "disaggregated" or r.gpus is None:
        return True
    gpe, gpn = r.gpus_per_engine, r.gpus_per_node
    return gpe % gpn == 0 or (gpe < gpn if r.gpus == 0 else (r.gpus <= gpn or gpn % gpe == 0))


def _sft_parts(spec: RLJobSpec) -> int:
    """What data.sft.batchSize must be a multiple of: dataParallel * optimizer steps a step."""
    return spec.training.data_parallel * (_samples(spec) // spec.global_batch_size)


def _sft_splits(spec: RLJobSpec) -> bool:
    sft = spec.data.sft
    if sft is None or _samples(spec) % spec.global_batch_size or _sft_parts(spec) < 1:
        return True
    return sft.batch_size % _sft_parts(spec) == 0


def _critic_batch_splits(spec: RLJobSpec) -> bool:
    if not (spec.has_critic and spec.critic.placement == "dedicated"):
        return True
    if _samples(spec) % spec.global_batch_size:
        return True  # the global batch rule's to report
    return spec.global_batch_size % (spec.training.micro_batch_size
                                     * spec.critic_world_size) == 0


def _micro_batches_split(spec: RLJobSpec) -> bool:
    per_step = spec.training.micro_batch_size * spec.training.data_parallel
    return per_step < 1 or spec.global_batch_size % per_step == 0


FUNCTION_OR_ENVIRONMENT = ("rollout.function and environment.class both make trajectories: set "
                           "one (a function runs its own environment)")
MAX_TURNS_NEED_AGENT = ("rollout.maxTurns above 1 needs rollout.function or environment.class "
                        "(one turn per sample otherwise)")
ON_ERROR_NEEDS_EPISODES = ("environment.onError: drop needs environment.class or "
                           "rollout.function (a single-turn job has no episode to drop)")
ENVIRONMENT_REWARD_NEEDS_EPISODES = (
    "reward.type environment needs environment.class (the sum of its step rewards) or "
    "rollout.function (the Trajectory.reward it sets)")
METADATA_NEEDS_READER = (
    "data.metadataKeys needs rollout.function, environment.class, reward.type remote or "
    "reward.batch (only they see a sample's metadata)")
ROWS_NEED_FUNCTION = ("rollout.maxRowsPerSample above 1 needs rollout.function (the built-in "
                      "loop and a single turn make one row per sample)")
CODE_NEEDS_USER_CODE = (
    "code mounts modules that only the job's own functions import: it needs "
    "rollout.function, environment.class without environment.image (an image serves its own "
    "class), reward.function or algorithm.lossFunction")
# The estimators that give a sample's rows its one advantage: group-relative, per sequence.
ROW_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
ROWS_NEED_SEQUENCE_ESTIMATOR = (
    "rollout.maxRowsPerSample above 1 needs advantageEstimator " + ", ".join(ROW_ESTIMATORS[:-1])
    + " or " + ROW_ESTIMATORS[-1] + " (every row takes its sample's group-relative advantage; "
    "the others would score each row as an episode of its own)")
# Whether the job makes episodes (a user's rollout function or kuberl's loop over an
# environment), as CEL over the spec, and its Python twin.
_EPISODES = "(has(self.rollout.function) || has(self.environment.class))"


def _episodes(spec: RLJobSpec) -> bool:
    return spec.rollout.function is not None or spec.environment.class_ is not None


def _on_model_storage_rule(field: str, get: Callable[[RLJobSpec], str | None],
                           section: str | None = None) -> Rule:
    """`field` (a model directory, optional; in the optional `section`, if given) lies under
    model.storage.mountPath when a PVC holds the model, as model.path must."""
    present = f"!has(self.{section}) || " if section else ""
    return Rule(f"!has(self.model.storage) || {present}!has(self.{field}) || "
                f"{under_cel(f'self.{field}', 'self.model.storage.mountPath')}",
                lambda s: (s.model.storage is None or get(s) is None
                           or under(str(get(s)), s.model.storage.mount_path)),
                f"{field} must lie under model.storage.mountPath when a PVC holds the model",
                field, detail=lambda s: f"model.storage.mountPath = {s.model.storage.mount_path}")


@dataclass(frozen=True)
class _StorageField:
    """A section's PVC (a `Storage`), mounted in the job's Ray pods at its mountPath."""

    field: str  # the spec's path to it
    present: str  # CEL: the job has it
    get: Callable[[RLJobSpec], Storage | None]

    @property
    def cel(self) -> str:
        return f"self.{self.field}"


STORAGES = (
    _StorageField("model.storage", "has(self.model.storage)", lambda s: s.model.storage),
    _StorageField("data.storage", "has(self.data.storage)", lambda s: s.data.storage),
    _StorageField("reward.model.storage",
                  "has(self.reward.model) && has(self.reward.model.storage)",
                  lambda s: s.reward.model.storage if s.reward.model is not None else None),
)


def _same_storage(a: Storage, b: Storage) -> bool:
    """One claim's same directory, mounted alike: what one volume can serve for both."""
    return (a.pvc == b.pvc and (a.sub_path or "") == (b.sub_path or "")
            and a.read_only == b.read_only)


def _same_storage_cel(a: str, b: str) -> str:
    sub = "(has({0}.subPath) ? {0}.subPath : '')"
    return (f"{a}.pvc == {b}.pvc && {sub.format(a)} == {sub.format(b)} && "
            f"{a}.readOnly == {b}.readOnly")


def _one_storage_per_mount(a: _StorageField, b: _StorageField) -> Rule:
    """`a` and `b` at one mountPath are one storage, which the pods mount once (a reward
    model on the policy's PVC); two claims, or two directories of one, need two mountPaths."""
    def holds(s: RLJobSpec) -> bool:
        x, y = a.get(s), b.get(s)
        return x is None or y is None or x.mount_path != y.mount_path or _same_storage(x, y)
    return Rule(f"!({a.present}) || !({b.present}) || {a.cel}.mountPath != {b.cel}.mountPath "
                f"|| ({_same_storage_cel(a.cel, b.cel)})", holds,
                f"{a.field} and {b.field} need different mountPath values, unless they are the "
                "same storage (pvc, subPath and readOnly), which is mounted once",
                f"{b.field}.mountPath", detail=lambda s: f"{a.field} = {_described(a.get(s))}")


def _checkpoint_apart_from(a: _StorageField) -> Rule:
    def holds(s: RLJobSpec) -> bool:
        storage = a.get(s)
        return storage is None or storage.mount_path != s.checkpoint.path
    return Rule(f"!({a.present}) || {a.cel}.mountPath != self.checkpoint.path", holds,
                f"checkpoint.path must differ from {a.field}.mountPath", "checkpoint.path")


def _described(storage: Storage | None) -> str:
    if storage is None:
        return "unset"
    return str(storage.model_dump(by_alias=True, exclude_none=True))


# Optional fields only training uses, which mode eval refuses rather than ignores (why each is
# meaningless there)
_TRAINING_ONLY: tuple[tuple[str, Callable[[RLJobSpec], object], str], ...] = (
    ("schedule.evalInterval", lambda s: s.schedule.eval_interval,
     "is for evaluations between training steps"),
    ("schedule.saveInterval", lambda s: s.schedule.save_interval,
     "is for checkpoints of training"),
    ("data.prompts", lambda s: s.data.prompts, "is the prompts to train on"),
    ("data.sft", lambda s: s.data.sft, "is demonstrations to train on"),
    ("training.lora", lambda s: s.training.lora, "is an adapter to train (to evaluate one, "
     "point model.path at a checkpoint's model/, the merged weights)"),
)



def _training_only_rule(field: str, get: Callable[[RLJobSpec], object], why: str) -> Rule:
    return Rule(f"self.mode != 'eval' || !has(self.{field})",
                lambda s: s.mode != "eval" or get(s) is None,
                f"{field} {why}: mode eval trains nothing (it evaluates model.path once)",
                field)


JOB_RULES = (
    Rule("self.mode != 'async' || self.placement == 'disaggregated'",
         lambda s: s.mode != "async" or s.placement == "disaggregated", ASYNC_DISAGGREGATED,
         "mode"),
    Rule("self.mode == 'sync' || self.algorithm.oldLogprobs == 'trainer'",
         lambda s: s.mode == "sync" or s.algorithm.old_logprobs == "trainer", ASYNC_ENGINE_OLD,
         "algorithm.oldLogprobs"),
    Rule(f"self.mode == 'async' || {_at_defaults('self.async', AsyncSpec)}",
         lambda s: s.mode == "async" or s.async_ == AsyncSpec(), ASYNC_SETTINGS_ASYNC_ONLY,
         "async"),
    Rule("self.async.offPolicyCorrection != 'none' || "
         "(!has(self.algorithm.tisCap) && !has(self.algorithm.importanceMask))",
         lambda s: (s.async_.off_policy_correction != "none"
                    or (s.algorithm.tis_cap is None and s.algorithm.importance_mask is None)),
         ASYNC_CORRECTION_NONE_UNUSED, "async.offPolicyCorrection"),
    Rule("self.placement == 'disaggregated' || !has(self.rollout.maxEngineRestarts) || "
         "self.rollout.maxEngineRestarts == 0",
         lambda s: s.placement == "disaggregated" or not s.rollout.max_engine_restarts,
         ENGINE_RESTARTS_DISAGGREGATED, "rollout.maxEngineRestarts"),
    Rule("(self.placement == 'disaggregated' && (!has(self.rollout.maxEngineRestarts) "
         "|| self.rollout.maxEngineRestarts > 0)) || "
         f"{_at_defaults('self.rollout.healthProbe', HealthProbe)}",
         lambda s: ((s.placement == "disaggregated" and s.rollout.max_engine_restarts != 0)
                    or s.rollout.health_probe == HealthProbe()),
         HEALTH_PROBE_NEEDS_RESTARTS, "rollout.healthProbe"),
    Rule(f"!{_ROLLOUT_ON_CPU} || self.rollout.engine == 'reference'",
         lambda s: not _rollout_on_cpu(s) or s.rollout.engine == "reference",
         SGLANG_NEEDS_GPUS, "rollout.engine"),
    Rule(f"!has(self.rollout.engines) || !{_ROLLOUT_ON_GPU}",
         lambda s: s.rollout.engines is None or not _rollout_on_gpu(s), ENGINES_ON_CPU_ONLY,
         "rollout.engines"),
    *(_colocated_from_training_rule(name) for name in COLOCATED_FROM_TRAINING),
    # On CPU (gpus 0) an engine's TP processes stand in for its GPUs, gpusPerNode of them to
    # a pod; one smaller pod holds every rollout GPU when they fit one node.
    Rule("self.placement != 'disaggregated' || !has(self.rollout.gpus) || "
         f"{_ROLLOUT_GPUS_OUTSIDE.replace('self.gpus', 'self.rollout.gpus')} || "
         f"{_outside('self.rollout.gpusPerNode', 1, MAX_GPUS_PER_NODE)} || "
         f"{_outside('self.rollout.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
         "self.rollout.gpusPerEngine % self.rollout.gpusPerNode == 0 || "
         "(self.rollout.gpus == 0 ? self.rollout.gpusPerEngine < self.rollout.gpusPerNode"
         " : (self.rollout.gpus <= self.rollout.gpusPerNode || "
         "self.rollout.gpusPerNode % self.rollout.gpusPerEngine == 0))",
         _engines_tile_nodes, ENGINE_TILES_NODES, "rollout.gpusPerEngine",
         detail=lambda s: f"rollout.gpusPerNode = {s.rollout.gpus_per_node}"),
    Rule("self.placement != 'disaggregated' || !has(self.rollout.gpus) || "
         f"{_outside('self.rollout.gpus', 0, MAX_ROLLOUT_GPUS)} || "
         f"{_outside('self.rollout.gpusPerNode', 1, MAX_GPUS_PER_NODE)} || "
         "self.rollout.gpus <= self.rollout.gpusPerNode || "
         "self.rollout.gpus % self.rollout.gpusPerNode == 0",
         lambda s: (s.placement != "disaggregated" or s.rollout.gpus is None
                    or s.rollout.gpus <= s.rollout.gpus_per_node
                    or s.rollout.gpus % s.rollout.gpus_per_node == 0),
         ROLLOUT_WHOLE_NODES, "rollout.gpus",
         detail=lambda s: f"rollout.gpusPerNode = {s.rollout.gpus_per_node}"),
    Rule("self.algorithm.advantageEstimator == 'ppo' || "
         f"{_at_defaults('self.critic', CriticSpec)}",
         lambda s: s.has_critic or s.critic == CriticSpec(), CRITIC_PPO_ONLY, "critic"),
    Rule("!has(self.schedule.evalInterval) || size(self.data.evalSets) > 0",
         lambda s: s.schedule.eval_interval is None or bool(s.data.eval_sets),
         EVAL_NEEDS_BOTH, "schedule.evalInterval"),
    Rule("self.mode == 'eval' || size(self.data.evalSets) == 0 || "
         "has(self.schedule.evalInterval)",
         lambda s: s.mode == "eval" or not s.data.eval_sets or s.schedule.eval_interval is not None,
         EVAL_NEEDS_BOTH, "data.evalSets", value=lambda s: [e.name for e in s.data.eval_sets]),
    # mode eval: the engines serve model.path, the eval sets are evaluated once, nothing trains
    Rule("self.mode == 'eval' || has(self.data.prompts)",
         lambda s: s.mode == "eval" or s.data.prompts is not None,
         "data.prompts is required: the prompts to train on (only mode eval trains nothing)",
         "data.prompts"),
    Rule("self.mode != 'eval' || size(self.data.evalSets) > 0",
         lambda s: s.mode != "eval" or bool(s.data.eval_sets), EVAL_MODE_NEEDS_SETS,
         "data.evalSets"),
    *(_training_only_rule(field, get, why) for field, get, why in _TRAINING_ONLY),
    *(_network_needs_gpus_rule(name) for name in NETWORK_FIELDS),
    Rule("!has(self.training.lora) || self.training.lora.sync != 'adapter' || "
         "self.rollout.engine != 'reference' || self.rollout.gpusPerEngine == 1",
         lambda s: not s.adapter_sync or s.rollout.engine != "reference"
         or s.rollout.gpus_per_engine == 1, ADAPTER_REFERENCE_TP, "rollout.gpusPerEngine"),
    Rule("self.algorithm.routingReplay != 'rollout' || self.rollout.engine != 'sglang'",
         lambda s: s.algorithm.routing_replay != "rollout" or s.rollout.engine != "sglang",
         REPLAY_ROLLOUT_SGLANG, "algorithm.routingReplay"),
    Rule("self.algorithm.routingReplay != 'rollout' || self.rollout.router != 'sglang'",
         lambda s: s.algorithm.routing_replay != "rollout" or s.rollout.router != "sglang",
         REPLAY_ROLLOUT_ROUTER, "rollout.router"),
    Rule("self.placement == 'colocate' || "
         f"{_at_defaults('self.training.offload', OffloadSpec)}",
         lambda s: s.placement == "colocate" or s.training.offload == OffloadSpec(),
         OFFLOAD_COLOCATED_ONLY, "training.offload"),
    Rule("self.placement != 'colocate' || self.rollout.engine != 'sglang' || "
         "!has(self.rollout.engineArgs) || "
         "!('enable-memory-saver' in self.rollout.engineArgs) || "
         "self.rollout.engineArgs['enable-memory-saver'] != 'false'",
         lambda s: (s.placement != "colocate" or s.rollout.engine != "sglang"
                    or s.rollout.engine_args.get("enable-memory-saver") != "false"),
         MEMORY_SAVER_COLOCATED, "rollout.engineArgs",
         value=lambda s: {"enable-memory-saver": s.rollout.engine_args["enable-memory-saver"]}),
    Rule("self.placement != 'disaggregated' || has(self.rollout.gpus)",
         lambda s: s.placement != "disaggregated" or s.rollout.gpus is not None,
         "rollout.gpus is required when placement is disaggregated", "rollout.gpus"),
    Rule("self.placement != 'colocate' || !has(self.rollout.gpus) || "
         f"{_gpus_outside('self.training')} || "
         "self.rollout.gpus == (self.training.gpusPerNode == 0 ? 0 : "
         "self.training.nodes * self.training.gpusPerNode)",
         lambda s: (s.placement != "colocate" or s.rollout.gpus is None
                    or s.rollout.gpus == s.training_gpus),
         "colocated rollout uses the training GPUs: rollout.gpus must equal "
         "training.nodes * training.gpusPerNode (or be unset)", "rollout.gpus",
         detail=lambda s: f"training.nodes * training.gpusPerNode = {s.training_gpus}"),
    Rule("self.placement != 'colocate' || self.training.gpusPerNode == 0 || "
         f"{_outside('self.training.gpusPerNode', 0, MAX_GPUS_PER_NODE)} || "
         f"{_outside('self.rollout.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
         "self.training.gpusPerNode % self.rollout.gpusPerEngine == 0",
         lambda s: (s.placement != "colocate" or s.training.gpus_per_node == 0
                    or s.training.gpus_per_node % s.rollout.gpus_per_engine == 0),
         "colocated engines must tile a training node: rollout.gpusPerEngine must "
         "divide training.gpusPerNode", "rollout.gpusPerEngine",
         detail=lambda s: f"training.gpusPerNode = {s.training.gpus_per_node}"),
    Rule("!has(self.algorithm.overlongBuffer) || "
         "self.algorithm.overlongBuffer <= self.data.maxResponseLen",
         lambda s: (s.algorithm.overlong_buffer is None
                    or s.algorithm.overlong_buffer <= s.data.max_response_len),
         "algorithm.overlongBuffer must not exceed data.maxResponseLen",
         "algorithm.overlongBuffer"),
    Rule("(self.algorithm.sftCoef > 0.0) == has(self.data.sft)",
         lambda s: (s.algorithm.sft_coef > 0) == (s.data.sft is not None),
         "algorithm.sftCoef > 0 needs data.sft, and data.sft is used only with it", "data.sft",
         value=lambda s: s.data.sft.model_dump(by_alias=True) if s.data.sft else None),
    Rule(f"!has(self.data.sft) || {_gpus_outside('self.training')} || "
         f"{_mp_outside('self.training')} || {_BATCH_OUTSIDE} || {_DP} < 1 || "
         f"{_outside('self.data.sft.batchSize', 1, MAX_ROLLOUT_BATCH)} || "
         f"(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % {_GBS} != 0 || "
         "self.data.sft.batchSize % "
         f"({_DP} * ((self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) / {_GBS}))"
         " == 0",
         _sft_splits,
         "data.sft.batchSize must split evenly over the step's optimizer steps and "
         "data-parallel ranks: a multiple of dataParallel * (rolloutBatchSize * "
         "nSamplesPerPrompt / globalBatchSize)", "data.sft.batchSize",
         detail=lambda s: f"dataParallel = {s.training.data_parallel}, rolloutBatchSize * "
         f"nSamplesPerPrompt / globalBatchSize = {_samples(s) // s.global_batch_size}"),
    Rule("self.algorithm.advantageEstimator != 'rloo' || self.data.nSamplesPerPrompt >= 2",
         lambda s: s.algorithm.advantage_estimator != "rloo" or s.data.n_samples_per_prompt >= 2,
         "advantageEstimator rloo needs data.nSamplesPerPrompt >= 2 (the baseline is "
         "the other samples' mean)", "data.nSamplesPerPrompt"),
    Rule("self.placement != 'colocate' || (size(self.rollout.nodePool.nodeSelector) == 0"
         " && size(self.rollout.nodePool.tolerations) == 0)",
         lambda s: (s.placement != "colocate" or (not s.rollout.node_pool.node_selector
                                                  and not s.rollout.node_pool.tolerations)),
         "colocated rollout runs on the training pool: set training.nodePool only",
         "rollout.nodePool"),
    Rule(f"{_BATCH_OUTSIDE} || "
         "(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % "
         "(has(self.training.globalBatchSize) ? self.training.globalBatchSize : "
         "self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) == 0",
         lambda s: _samples(s) % s.global_batch_size == 0,
         "training.globalBatchSize must divide rolloutBatchSize * nSamplesPerPrompt",
         "training.globalBatchSize", value=lambda s: s.global_batch_size,
         detail=lambda s: f"rolloutBatchSize * nSamplesPerPrompt = {_samples(s)}"),
    Rule("self.algorithm.advantageEstimator != 'ppo' || self.critic.placement != "
         f"'dedicated' || {_outside('self.critic.nodes', 1, MAX_NODES)} || "
         f"{_outside('self.critic.gpusPerNode', 0, MAX_GPUS_PER_NODE)} || "
         f"{_outside('self.training.microBatchSize', 1, MAX_MICRO_BATCH)} || "
         f"{_BATCH_OUTSIDE} || "
         f"(self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % {_GBS} != 0 || "
         f"{_GBS} % (self.training.microBatchSize * {_CRITIC_WORLD}) == 0",
         _critic_batch_splits,
         "the global batch must split evenly into micro-batches across the dedicated "
         "critic workers: training.microBatchSize * critic workers must divide it",
         "critic.nodes",
         detail=lambda s: f"global batch = {s.global_batch_size}, training.microBatchSize * "
         f"critic workers = {s.training.micro_batch_size} * {s.critic_world_size}"),
    # dataParallel is 0 only when tp*pp*cp exceeds the GPUs, which the training rule
    # reports; that guard keeps this rule from failing with a modulus-by-zero error.
    Rule(f"{_gpus_outside('self.training')} || {_mp_outside('self.training')} || "
         f"{_outside('self.training.microBatchSize', 1, MAX_MICRO_BATCH)} || "
         f"{_BATCH_OUTSIDE} || {_DP} < 1 || (has(self.training.globalBatchSize) ? "
         "self.training.globalBatchSize : "
         "self.data.rolloutBatchSize * self.data.nSamplesPerPrompt) % "
         f"(self.training.microBatchSize * {_DP}) == 0",
         _micro_batches_split,
         "the global batch must split evenly into micro-batches across data-parallel "
         "ranks: globalBatchSize % (microBatchSize * dataParallel) == 0",
         "training.microBatchSize",
         detail=lambda s: f"global batch = {s.global_batch_size}, microBatchSize * "
         f"dataParallel = {s.training.micro_batch_size} * {s.training.data_parallel}"),
    Rule("!has(self.training.maxTokensPerMicroBatch) || "
         "self.training.maxTokensPerMicroBatch >= "
         "self.data.maxPromptLen + self.data.maxResponseLen",
         lambda s: (s.training.max_tokens_per_micro_batch is None
                    or s.training.max_tokens_per_micro_batch >= _longest(s)),
         "training.maxTokensPerMicroBatch must hold the longest sample: at least "
         "data.maxPromptLen + data.maxResponseLen", "training.maxTokensPerMicroBatch",
         detail=lambda s: f"data.maxPromptLen + data.maxResponseLen = {_longest(s)}"),
    # Two volumes at one mount point make the API server refuse the pod: storages at one
    # mountPath must be one storage (mounted once), and the checkpoints' path none of theirs.
    *(_one_storage_per_mount(a, b) for i, a in enumerate(STORAGES) for b in STORAGES[i + 1:]),
    *(_checkpoint_apart_from(a) for a in STORAGES),
    # The other models a job loads live where the policy does: with a PVC for the model, a
    # path outside its mount is a typo, refused at apply rather than after a cluster starts.
    *(_on_model_storage_rule(field, get) for field, get in (
        ("algorithm.teacherPath", lambda s: s.algorithm.teacher_path),
        ("critic.modelPath", lambda s: s.critic.model_path))),
    _on_model_storage_rule("training.lora.path",
                           lambda s: s.training.lora.path if s.training.lora else None,
                           section="training.lora"),
    # Trajectories come from one maker: a user's function (which runs its own environment
    # if it has one) or kuberl's loop over environment.class.
    Rule("!has(self.rollout.function) || !has(self.environment.class)",
         lambda s: s.rollout.function is None or s.environment.class_ is None,
         FUNCTION_OR_ENVIRONMENT, "environment.class"),
    Rule("self.rollout.maxTurns == 1 || has(self.rollout.function) || "
         "has(self.environment.class)",
         lambda s: (s.rollout.max_turns == 1 or s.rollout.function is not None
                    or s.environment.class_ is not None),
         MAX_TURNS_NEED_AGENT, "rollout.maxTurns"),
    Rule(f"self.environment.onError == 'fail' || {_EPISODES}",
         lambda s: s.environment.on_error == "fail" or _episodes(s), ON_ERROR_NEEDS_EPISODES,
         "environment.onError"),
    Rule(f"self.reward.type != 'environment' || {_EPISODES}",
         lambda s: s.reward.type != "environment" or _episodes(s),
         ENVIRONMENT_REWARD_NEEDS_EPISODES, "reward.type"),
    Rule(f"size(self.data.metadataKeys) == 0 || {_EPISODES} || self.reward.type == 'remote' "
         "|| self.reward.batch",
         lambda s: not s.data.metadata_keys or _episodes(s) or s.reward.sees_metadata,
         METADATA_NEEDS_READER, "data.metadataKeys", value=lambda s: s.data.metadata_keys),
    Rule("self.rollout.maxRowsPerSample == 1 || has(self.rollout.function)",
         lambda s: s.rollout.max_rows_per_sample == 1 or s.rollout.function is not None,
         ROWS_NEED_FUNCTION, "rollout.maxRowsPerSample"),
    Rule("self.rollout.maxRowsPerSample == 1 || self.algorithm.advantageEstimator in "
         f"{list(ROW_ESTIMATORS)}",
         lambda s: (s.rollout.max_rows_per_sample == 1
                    or s.algorithm.advantage_estimator in ROW_ESTIMATORS),
         ROWS_NEED_SEQUENCE_ESTIMATOR, "rollout.maxRowsPerSample",
         detail=lambda s: f"advantageEstimator = {s.algorithm.advantage_estimator}"),
    # Mounted code that nothing imports is a mistake (most likely: the class of an
    # environment.image, which lives in that image and never sees this mount).
    Rule("!(has(self.code.configMap) || has(self.code.pvc)) || has(self.rollout.function) || "
         "(has(self.environment.class) && !has(self.environment.image)) || "
         "has(self.reward.function) || has(self.algorithm.lossFunction)",
         lambda s: (s.code.source is None or s.rollout.function is not None
                    or (s.environment.class_ is not None and s.environment.image is None)
                    or s.reward.function is not None
                    or s.algorithm.loss_function is not None),
         CODE_NEEDS_USER_CODE, "code"),
)
