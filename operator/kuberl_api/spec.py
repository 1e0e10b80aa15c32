"""The RLJob spec: what a user writes. One model for the CRD schema, the operator and the trainer.

Each section is its own small model; rules that involve one section live on it, rules that
span sections live on `RLJobSpec`. Every rule has a CEL twin (see `base.py`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kuberl_api.base import ApiModel, cel, cel_rules, check

# Kubernetes' own quantity grammar (resource.Quantity), so "500m", "64Gi" and "1e3" pass here
# exactly when the API server would accept them.
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
IMPORT_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
PVC_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

# Bounds keep CEL cost estimates finite (the API server refuses rules over unbounded lists).
MAX_STR = 1024
MAX_ITEMS = 64

# Mount points kuberl itself uses in every pod (config, shared memory for NCCL).
RESERVED_PATHS = ("/etc/kuberl", "/dev/shm")

# Upper bounds of the integers that CEL rules multiply, divide or take a modulus of: far above
# any real job, and low enough that no product in a rule can overflow CEL's int64 (the largest,
# microBatchSize * dataParallel, is at most 65536 * (4096 * 16) = 2**32).
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 16
MAX_PARALLEL = 1024  # tp, pp, cp (and ep)
MAX_MICRO_BATCH = 65536
MAX_GLOBAL_BATCH = 16777216
MAX_ROLLOUT_BATCH = 65536
MAX_SAMPLES_PER_PROMPT = 1024
MAX_ROLLOUT_GPUS = 65536
MAX_GPUS_PER_ENGINE = 64

# A CEL rule that multiplies, divides or takes a modulus first passes when one of its operands
# lies outside its schema range: the API server still runs the CEL rules after such a schema
# error (a minimum or a maximum; only a wrong type, a missing field, an enum or a length stops
# them), and an unguarded rule would add "division by zero" or "integer overflow evaluating
# rule", or a cross-field message worked out from the refused value, to the field's own minimum
# or maximum error. The Python twins never see such values (pydantic runs a model validator
# only once every field is valid).


def _outside(path: str, low: int, high: int, *, optional: bool = False) -> str:
    """CEL: the integer at `path` lies outside [low, high] (an unset optional one does not)."""
    test = f"{path} < {low} || {path} > {high}"
    return f"(has({path}) && ({test}))" if optional else test


def _gpus_outside(training: str) -> str:
    """CEL: nodes or gpusPerNode of the training section at `training` is out of range."""
    return (f"{_outside(f'{training}.nodes', 1, MAX_NODES)} || "
            f"{_outside(f'{training}.gpusPerNode', 0, MAX_GPUS_PER_NODE)}")


def _mp_outside(training: str) -> str:
    """CEL: tp, pp or cp of the training section at `training` is out of range."""
    return " || ".join(_outside(f"{training}.parallelism.{p}", 1, MAX_PARALLEL)
                       for p in ("tp", "pp", "cp"))


DEFAULT_TRAINER_IMAGE = "ghcr.io/kuberl/trainer:0.1.0"
DEFAULT_ROLLOUT_IMAGE = "ghcr.io/kuberl/rollout:0.1.0"

class Storage(ApiModel):
    """A PersistentVolumeClaim mounted into every pod of the job at `mountPath`."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.mountPath.startsWith('/')", "mountPath must be an absolute path",
                ".mountPath"),
            cel(f"!(self.mountPath in {list(RESERVED_PATHS)})",
                f"mountPath may not be one of {', '.join(RESERVED_PATHS)} (used by kuberl)",
                ".mountPath"),
        )
    }

    pvc: str = Field(min_length=1, max_length=253, pattern=PVC_NAME_PATTERN,
                     description="Name of a PersistentVolumeClaim in the RLJob's namespace.")
    mount_path: str = Field(min_length=1, max_length=MAX_STR,
                            description="Where the claim is mounted in the pods.")
    sub_path: str | None = Field(None, max_length=MAX_STR,
                                 description="Mount only this sub-directory of the claim.")
    read_only: bool = Field(True, description="Mount read-only.")

    @model_validator(mode="after")
    def _absolute(self) -> Storage:
        check(self.mount_path.startswith("/"), "mountPath", self.mount_path,
              "mountPath must be an absolute path")
        check(self.mount_path not in RESERVED_PATHS, "mountPath", self.mount_path,
              f"mountPath may not be one of {', '.join(RESERVED_PATHS)} (used by kuberl)")
        return self


class ModelSpec(ApiModel):
    """The policy's starting point: a Hugging Face checkpoint directory."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("!has(self.storage) || self.path.startsWith(self.storage.mountPath)",
                "path must lie under storage.mountPath when a PVC holds the model", ".path"),
        )
    }

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="HF checkpoint directory (config.json + safetensors).")
    tokenizer: str | None = Field(None, max_length=MAX_STR,
                                  description="Tokenizer directory; defaults to `path`.")
    storage: Storage | None = Field(None, description="PVC that holds the model.")

    @model_validator(mode="after")
    def _under_mount(self) -> ModelSpec:
        if self.storage is not None:
            check(self.path.startswith(self.storage.mount_path), "path", self.path,
                  f"path must lie under storage.mountPath ({self.storage.mount_path}) "
                  "when a PVC holds the model")
        return self


class EvalSet(ApiModel):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$")
    path: str = Field(min_length=1, max_length=MAX_STR, description="JSONL or Parquet file.")
    n_samples_per_prompt: int = Field(1, ge=1, le=1024)


class SftData(ApiModel):
    """Demonstrations for the SFT (NLL) term (algorithm.sftCoef): prompt and target response,
    under the data section's inputKey and labelKey."""

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="JSONL or Parquet file, as seen from the head pod.")
    batch_size: int = Field(16, ge=1, le=MAX_ROLLOUT_BATCH,
                            description="Demonstrations per step, split evenly over the step's "
                            "optimizer steps and data-parallel ranks.")


class DataSpec(ApiModel):
    """Where prompts come from and how many are generated per step."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("!has(self.storage) || self.prompts.startsWith(self.storage.mountPath)",
                "prompts must lie under storage.mountPath when a PVC holds the data",
                ".prompts"),
        )
    }

    prompts: str = Field(min_length=1, max_length=MAX_STR,
                         description="Prompt file (JSONL or Parquet) as seen from the head pod.")
    input_key: str = Field("prompt", min_length=1, max_length=253)
    label_key: str = Field("label", min_length=1, max_length=253)
    rollout_batch_size: int = Field(32, ge=1, le=MAX_ROLLOUT_BATCH,
                                    description="Prompts per step.")
    n_samples_per_prompt: int = Field(8, ge=1, le=MAX_SAMPLES_PER_PROMPT,
                                      description="Responses per prompt.")
    max_prompt_len: int = Field(1024, ge=1, le=1048576, description="Tokens.")
    max_response_len: int = Field(1024, ge=1, le=1048576, description="Tokens.")
    storage: Storage | None = Field(None, description="PVC that holds the data.")
    eval_sets: list[EvalSet] = Field(default_factory=list, max_length=16)
    sft: SftData | None = Field(None, description="Demonstrations for algorithm.sftCoef's "
                                "NLL term, trained on beside every RL step.")

    @model_validator(mode="after")
    def _under_mount(self) -> DataSpec:
        if self.storage is not None:
            check(self.prompts.startswith(self.storage.mount_path), "prompts", self.prompts,
                  f"prompts must lie under storage.mountPath ({self.storage.mount_path}) "
                  "when a PVC holds the data")
        return self


class RewardSpec(ApiModel):
    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.type == 'custom' ? has(self.function) : !has(self.function)",
                "function is required when type is custom, and allowed only then",
                ".function"),
        )
    }

    type: Literal["math", "exact", "f1", "custom"] = "math"
    function: str | None = Field(None, max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
                                 description="`module:function` for type custom.")

    @model_validator(mode="after")
    def _function_iff_custom(self) -> RewardSpec:
        if self.type == "custom":
            check(self.function is not None, "function", self.function,
                  "function (`module:function`) is required when type is custom")
        else:
            check(self.function is None, "function", self.function,
                  f"function is only allowed when type is custom, not {self.type}")
        return self


AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
    "on_policy_distillation",
]
# Estimators whose advantages are per token (returns over the response), which is what a KL
# penalty folded into the rewards needs.
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
PolicyLoss = Literal["ppo", "gspo"]
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
]
KlPenalty = Literal["loss", "reward"]


class AlgorithmSpec(ApiModel):
    """The RL algorithm; docs/algorithms.md has each option's formula and paper."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("!has(self.epsClipHigh) || self.epsClipHigh >= self.epsClip",
                "epsClipHigh must be at least epsClip", ".epsClipHigh"),
            cel("self.klPenalty != 'reward' || self.advantageEstimator in "
                f"{list(TOKEN_LEVEL_ESTIMATORS)}",
                "klPenalty: reward needs a token-level advantageEstimator ("
                + " or ".join(TOKEN_LEVEL_ESTIMATORS) + ")", ".klPenalty"),
            cel("(self.advantageEstimator == 'on_policy_distillation') == has(self.teacherPath)",
                "teacherPath is required by advantageEstimator on_policy_distillation, and "
                "only used by it", ".teacherPath"),
        )
    }

    advantage_estimator: AdvantageEstimator = Field(
        "grpo", description="grpo, dr_grpo (no std division), rloo (leave-one-out baseline), "
        "reinforce_plus_plus (token returns, batch-whitened), reinforce_plus_plus_baseline "
        "(group mean subtracted first), ppo (GAE with the value model of the critic section), "
        "on_policy_distillation (per token: the teacher's log-prob minus the student's).")
    teacher_path: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="on_policy_distillation: the "
        "teacher, an HF causal LM directory sharing the model's tokenizer (on the model's "
        "storage); its log-probs of the student's samples are the training signal.")
    policy_loss: PolicyLoss = Field(
        "ppo", description="ppo: the clipped per-token ratio; gspo: the clipped sequence "
        "ratio (geometric mean of a response's token ratios; use small clip ranges, e.g. "
        "epsClip 3e-4, epsClipHigh 4e-4).")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="How token losses become the loss: token-mean, "
        "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: divided "
        "by sequences * data.maxResponseLen).")
    lr: float = Field(1e-6, gt=0, le=1, description="Learning rate.")
    lr_warmup_steps: int = Field(
        0, ge=0, le=10_000_000, description="Optimizer steps of linear LR warmup, from "
        "lr/lrWarmupSteps up to lr.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: constant, or decayed (linear or cosine) to "
        "lr * minLrRatio at the run's last optimizer step.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of lr "
                                "when lrDecayStyle decays.")
    eps_clip: float = Field(0.2, gt=0, le=10, description="PPO clip range (lower side).")
    eps_clip_high: float | None = Field(None, gt=0, le=10,
                                        description="Upper clip range (clip-higher); = epsClip.")
    eps_clip_c: float | None = Field(None, gt=1, le=100, description="Dual-clip constant.")
    tis_cap: float | None = Field(
        None, gt=0, le=100, description="Truncated importance sampling: weight each token's "
        "policy loss by min(pi_old / pi_rollout, tisCap), correcting for the engines' own "
        "log-probs differing from the trainer's; unset: off.")
    kl_coef: float = Field(0.0, ge=0, le=100, description="Weight of the KL term.")
    kl_loss_type: KlType = "low_var_kl"
    kl_penalty: KlPenalty = Field(
        "loss", description="Where klCoef applies: loss (a KL(policy || reference) term in "
        "the loss) or reward (a per-token penalty in the rewards; token-level estimators).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of token-level returns "
                         "(reinforce_plus_plus, ppo).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE's lambda (ppo): 1 is the "
                              "Monte-Carlo return, 0 the one-step TD error.")
    entropy_coef: float = Field(0.0, ge=0, le=100)
    sft_coef: float = Field(0.0, ge=0, le=100, description="Weight of an SFT (NLL) term on "
                            "data.sft's demonstrations, added to every optimizer step (mixed "
                            "RL + SFT training); 0: off.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature.")
    drop_constant_groups: bool = Field(
        False, description="Leave out of the loss the prompt groups whose rewards are all "
        "equal (they carry no GRPO signal but dilute the token mean).")
    dynamic_sampling_rounds: int = Field(
        0, ge=0, le=100, description="DAPO dynamic sampling: up to this many extra rounds of "
        "prompts per step to replace groups whose rewards are all equal; groups still equal "
        "after the last round leave the loss. 0: off.")
    overlong_buffer: int | None = Field(
        None, ge=1, le=1048576, description="DAPO overlong shaping: over the last this many "
        "tokens of data.maxResponseLen the reward ramps down by up to overlongPenalty; "
        "unset: off.")
    overlong_penalty: float = Field(1.0, ge=0, le=100, description="The overlong shaping's "
                                    "penalty at data.maxResponseLen.")

    @model_validator(mode="after")
    def _clip_order(self) -> AlgorithmSpec:
        if self.eps_clip_high is not None:
            check(self.eps_clip_high >= self.eps_clip, "epsClipHigh", self.eps_clip_high,
                  f"epsClipHigh must be at least epsClip ({self.eps_clip})")
        distill = self.advantage_estimator == "on_policy_distillation"
        check(distill == (self.teacher_path is not None), "teacherPath", self.teacher_path,
              "teacherPath is required by advantageEstimator on_policy_distillation, and only "
              "used by it")
        check(self.kl_penalty != "reward" or self.advantage_estimator in TOKEN_LEVEL_ESTIMATORS,
              "klPenalty", self.kl_penalty,
              "klPenalty: reward needs a token-level advantageEstimator ("
              + " or ".join(TOKEN_LEVEL_ESTIMATORS) + ")")
        return self


class Toleration(ApiModel):
    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)


class NodePool(ApiModel):
    """Which nodes a group's pods may run on."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_ITEMS)


class Resources(ApiModel):
    """CPU and memory per pod, besides GPUs (requests = limits, so pods are Guaranteed)."""

    cpu: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)


class Parallelism(ApiModel):
    """Model parallel sizes; data parallelism is what is left of the training GPUs."""

    tp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Tensor parallel size.")
    pp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Pipeline parallel size.")
    cp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Context parallel size.")
    ep: int = Field(1, ge=1, le=MAX_PARALLEL, description="Expert parallel size.")


class TrainingSpec(ApiModel):
    model_config = {
        "json_schema_extra": cel_rules(
            cel(f"{_gpus_outside('self')} || {_mp_outside('self')} || "
                "(self.gpusPerNode == 0 ? self.nodes : self.nodes * self.gpusPerNode)"
                " % (self.parallelism.tp * self.parallelism.pp * self.parallelism.cp) == 0",
                "parallelism.tp * pp * cp must divide the training GPU count"
                " (nodes * gpusPerNode)", ".parallelism"),
            cel("self.backend == 'megatron' || (self.parallelism.tp == 1 && "
                "self.parallelism.pp == 1 && self.parallelism.cp == 1 && "
                "self.parallelism.ep == 1)",
                "backend fsdp supports only data parallelism: tp, pp, cp and ep must be 1",
                ".parallelism"),
            cel("self.backend != 'megatron' || self.gpusPerNode > 0",
                "backend megatron trains on GPUs: gpusPerNode must be at least 1 (use backend "
                "fsdp to train on CPU)", ".gpusPerNode"),
            cel("self.parallelism.tp <= (self.gpusPerNode == 0 ? 1 : self.gpusPerNode)",
                "parallelism.tp must fit on one node (at most gpusPerNode)", ".parallelism.tp"),
        )
    }

    backend: Literal["megatron", "fsdp"] = "megatron"
    image: str = Field(DEFAULT_TRAINER_IMAGE, min_length=1, max_length=MAX_STR)
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Training pods, one per node.")
    gpus_per_node: int = Field(8, ge=0, le=MAX_GPUS_PER_NODE,
                               description="0 trains on CPU (one worker a pod).")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    micro_batch_size: int = Field(1, ge=1, le=MAX_MICRO_BATCH,
                                  description="Samples per forward pass.")
    global_batch_size: int | None = Field(
        None, ge=1, le=MAX_GLOBAL_BATCH,
        description="Samples per optimizer step; default: one step per rollout "
        "(rolloutBatchSize * nSamplesPerPrompt).")
    node_pool: NodePool = Field(default_factory=NodePool)
    resources: Resources = Field(default_factory=Resources)

    @property
    def world_size(self) -> int:
        """Training processes: one per GPU, or one per node on CPU."""
        return self.nodes * self.gpus_per_node if self.gpus_per_node else self.nodes

    @property
    def data_parallel(self) -> int:
        p = self.parallelism
        return self.world_size // (p.tp * p.pp * p.cp)

    @model_validator(mode="after")
    def _parallel_layout(self) -> TrainingSpec:
        p = self.parallelism
        model_parallel = p.tp * p.pp * p.cp
        check(self.world_size % model_parallel == 0, "parallelism", p.model_dump(),
              f"tp * pp * cp = {model_parallel} must divide the training GPU count "
              f"nodes * gpusPerNode = {self.world_size}")
        if self.backend == "fsdp":
            check(model_parallel * p.ep == 1, "parallelism", p.model_dump(),
                  "backend fsdp supports only data parallelism: tp, pp, cp and ep must be 1 "
                  "(use backend megatron for model parallelism)")
        check(self.backend != "megatron" or self.gpus_per_node > 0, "gpusPerNode",
              self.gpus_per_node, "backend megatron trains on GPUs: gpusPerNode must be at "
              "least 1 (use backend fsdp to train on CPU)")
        check(p.tp <= max(self.gpus_per_node, 1), "parallelism.tp", p.tp,
              f"tensor parallelism must fit on one node: tp must be at most gpusPerNode "
              f"({self.gpus_per_node})")
        return self


_ROLLOUT_GPUS_OUTSIDE = _outside("self.gpus", 0, MAX_ROLLOUT_GPUS)


class RolloutSpec(ApiModel):
    model_config = {
        "json_schema_extra": cel_rules(
            cel(f"!has(self.gpus) || {_ROLLOUT_GPUS_OUTSIDE} || "
                f"{_outside('self.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
                "self.gpus % self.gpusPerEngine == 0",
                "gpus must be a multiple of gpusPerEngine", ".gpus"),
            cel("!has(self.gpus) || self.gpus == 0 || self.gpusPerEngine <= self.gpusPerNode",
                "an engine must fit on one node: gpusPerEngine must be at most gpusPerNode",
                ".gpusPerEngine"),
            cel(f"!has(self.gpus) || {_ROLLOUT_GPUS_OUTSIDE} || "
                f"{_outside('self.gpusPerNode', 1, MAX_GPUS_PER_NODE)} || "
                "self.gpus <= self.gpusPerNode || self.gpus % self.gpusPerNode == 0",
                "gpus above one node must fill whole nodes (a multiple of gpusPerNode)",
                ".gpus"),
        )
    }

    engine: Literal["sglang", "reference"] = Field(
        "sglang", description="sglang in clusters; reference is the project's HF engine.")
    image: str = Field(DEFAULT_ROLLOUT_IMAGE, min_length=1, max_length=MAX_STR)
    gpus: int | None = Field(
        None, ge=0, le=MAX_ROLLOUT_GPUS,
        description="Total rollout GPUs. Colocated: defaults to (and must equal) the training "
        "GPUs. Disaggregated: required.")
    gpus_per_engine: int = Field(1, ge=1, le=MAX_GPUS_PER_ENGINE,
                                 description="Tensor parallel size of an engine.")
    gpus_per_node: int = Field(8, ge=1, le=MAX_GPUS_PER_NODE,
                               description="GPUs per rollout pod (disaggregated).")
    engines: int | None = Field(
        None, ge=1, le=4096, description="Engine count when rollout runs on CPU (gpus: 0).")
    node_pool: NodePool = Field(default_factory=NodePool)
    resources: Resources = Field(default_factory=Resources)
    engine_args: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra engine server flags, e.g. {mem-fraction-static: '0.8'}.")

    @model_validator(mode="after")
    def _engine_layout(self) -> RolloutSpec:
        if self.gpus is None or self.gpus == 0:
            return self
        check(self.gpus % self.gpus_per_engine == 0, "gpus", self.gpus,
              f"rollout gpus must be a multiple of gpusPerEngine ({self.gpus_per_engine})")
        check(self.gpus_per_engine <= self.gpus_per_node, "gpusPerEngine",
              self.gpus_per_engine,
              f"an engine must fit on one node: at most gpusPerNode ({self.gpus_per_node})")
        check(self.gpus <= self.gpus_per_node or self.gpus % self.gpus_per_node == 0, "gpus",
              self.gpus, f"rollout gpus above one node must fill whole nodes "
              f"(a multiple of gpusPerNode = {self.gpus_per_node})")
        return self


class ScheduleSpec(ApiModel):
    num_rollouts: int = Field(100, ge=1, le=10_000_000, description="Training steps.")
    eval_interval: int | None = Field(None, ge=1, description="Evaluate every N steps.")
    save_interval: int | None = Field(None, ge=1, description="Checkpoint every N steps.")


class CheckpointSpec(ApiModel):
    """Where checkpoints go. Without a PVC they live on the head's disk and a restart starts
    over, so set one whenever backoffLimit > 0 matters to you."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.path.startsWith('/')", "checkpoint path must be absolute", ".path"),
            cel(f"!(self.path in {list(RESERVED_PATHS)})",
                f"checkpoint path may not be one of {', '.join(RESERVED_PATHS)}", ".path"),
        )
    }

    pvc: str | None = Field(None, min_length=1, max_length=253, pattern=PVC_NAME_PATTERN)
    path: str = Field("/checkpoints", min_length=1, max_length=MAX_STR)
    keep: int = Field(2, ge=1, le=1000, description="How many recent checkpoints to keep.")

    @model_validator(mode="after")
    def _absolute(self) -> CheckpointSpec:
        check(self.path.startswith("/"), "path", self.path, "checkpoint path must be absolute")
        check(self.path not in RESERVED_PATHS, "path", self.path,
              f"checkpoint path may not be one of {', '.join(RESERVED_PATHS)}")
        return self


class RdmaSpec(ApiModel):
    resource: str = Field(min_length=1, max_length=253, pattern=LABEL_KEY_PATTERN,
                          description="Device-plugin resource, e.g. rdma/rdma_shared_device_a.")
    count: int = Field(1, ge=1, le=64)


class NetworkSpec(ApiModel):
    nccl_socket_ifname: str | None = Field(
        None, max_length=253, description="NCCL_SOCKET_IFNAME, e.g. eth0 or ^lo,docker.")
    host_network: bool = Field(False, description="Run GPU pods on the host network.")
    rdma: RdmaSpec | None = None
    weight_sync_port: int = Field(29600, ge=1024, le=65535,
                                  description="Port of the trainer-to-engines NCCL group.")
    env: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra NCCL_* (or other) variables for GPU pods.",
        # Kubernetes refuses a pod whose env names are not C identifiers; without this the
        # job would sit in Provisioning while KubeRay fails to create its GPU pods.
        json_schema_extra=cel_rules(cel(
            f"self.all(k, k.matches('{ENV_NAME_PATTERN}'))",
            "network.env names must be C identifiers: letters, digits and '_', not starting "
            "with a digit (e.g. NCCL_DEBUG)")))

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            check(re.fullmatch(ENV_NAME_PATTERN, name) is not None, "env", name,
                  "network.env names must be C identifiers: letters, digits and '_', not "
                  "starting with a digit (e.g. NCCL_DEBUG)")
        return env


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


class CriticSpec(ApiModel):
    """The value model PPO trains alongside the policy (advantageEstimator: ppo)."""

    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.placement == 'dedicated' || (self.nodes == 1 && "
                "size(self.nodePool.nodeSelector) == 0 && size(self.nodePool.tolerations) == 0)",
                "critic.nodes and critic.nodePool apply to placement: dedicated only (shared "
                "critics run on the training pods)", ".placement"),
        )
    }

    model_path: str | None = Field(
        None, min_length=1, max_length=MAX_STR, description="Weights to start the value model "
        "from (an HF causal LM directory; a fresh scalar value head is added); default: "
        "model.path.")
    lr: float = Field(1e-5, gt=0, le=1, description="The value model's learning rate.")
    value_clip: float | None = Field(
        0.2, gt=0, le=1000, description="PPO value clipping: a value moves at most this far "
        "from its rollout-time estimate per update; unset: off.")
    placement: Literal["shared", "dedicated"] = Field(
        "shared", description="shared: one critic worker beside each training worker, on the "
        "training pods (sharing their GPUs); dedicated: pods of their own (nodes, "
        "gpusPerNode, nodePool).")
    image: str = Field(DEFAULT_TRAINER_IMAGE, min_length=1, max_length=MAX_STR)
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Dedicated critic pods.")
    gpus_per_node: int = Field(8, ge=0, le=MAX_GPUS_PER_NODE,
                               description="GPUs per dedicated critic pod; 0: CPU.")
    node_pool: NodePool = Field(default_factory=NodePool)
    resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _shared_has_no_pods(self) -> CriticSpec:
        check(self.placement == "dedicated" or (self.nodes == 1 and not self.node_pool.node_selector
                                                 and not self.node_pool.tolerations),
              "placement", self.placement,
              "critic.nodes and critic.nodePool apply to placement: dedicated only (shared "
              "critics run on the training pods)")
        return self


class RLJobSpec(ApiModel):
    model_config = {
        "json_schema_extra": cel_rules(
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
    mode: Literal["sync", "async"] = "sync"
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
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

    @model_validator(mode="after")
    def _cross_section(self) -> RLJobSpec:
        if self.placement == "disaggregated":
            check(self.rollout.gpus is not None, "rollout.gpus", None,
                  "rollout.gpus is required when placement is disaggregated")
        else:
            self._check_colocated()
        self._check_batches()
        self._check_mounts()
        self._check_algorithm()
        self._check_sft()
        return self

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
        check(not pool.node_selector and not pool.tolerations, "rollout.nodePool",
              pool.model_dump(exclude_defaults=True),
              "colocated rollout runs on the training pool: set training.nodePool only")

    def _check_batches(self) -> None:
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
