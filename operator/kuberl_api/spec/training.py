"""The training section: backend, training pods and GPUs, model parallelism, micro-batches,
fused kernels and what colocated ranks offload; and the rules between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_TRAINER_IMAGE,
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_MICRO_BATCH,
    MAX_MICRO_BATCH_TOKENS,
    MAX_NODES,
    MAX_PARALLEL,
    MAX_STR,
    _gpus_outside,
    _mp_outside,
    _outside,
)
from kuberl_api.spec.lora import LoraSpec
from kuberl_api.spec.pods import NodePool, Resources

CP_NOT_SUPPORTED = "context parallelism (cp > 1) is not supported yet"
EP_NOT_SUPPORTED = ("expert parallelism (ep > 1) needs backend megatron (the fsdp backend "
                    "shards every parameter, experts included, over its ranks)")
ETP_NOT_SUPPORTED = "etp (expert tensor parallelism) applies to backend megatron only"


class Parallelism(ApiModel):
    """Model parallel sizes; data parallelism is what is left of the training GPUs."""

    RULES = (
        # The megatron backend builds a context-parallel grid but never splits sequences over
        # it.
        Rule(f"{_outside('self.cp', 1, MAX_PARALLEL)} || self.cp == 1", lambda p: p.cp == 1,
             CP_NOT_SUPPORTED, "cp"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    tp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Tensor parallel size.")
    pp: int = Field(1, ge=1, le=MAX_PARALLEL, description="Pipeline parallel size.")
    cp: int = Field(1, ge=1, le=MAX_PARALLEL,
                    description="Context parallel size; only 1 (not supported yet).")
    ep: int = Field(1, ge=1, le=MAX_PARALLEL,
                    description="Expert parallel size (backend megatron, mixture-of-experts "
                    "models): each expert layer's experts are split over ep ranks, carved "
                    "out of the data-parallel ranks; ep * etp * pp divides the training GPUs "
                    "and ep divides the model's expert count.")
    etp: int | None = Field(None, ge=1, le=MAX_PARALLEL,
                            description="Expert tensor parallel size (backend megatron): "
                            "each expert's matrices split over etp ranks; unset: tp.")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


class OffloadSpec(ApiModel):
    """What each training rank moves to host memory while colocated engines generate."""

    optimizer: bool = Field(True, description="The optimizer's state (Adam's moments; with "
                            "megatron also the fp32 master weights): most of a training "
                            "rank's memory. Offloaded after training, restored before the "
                            "next step's training.")
    weights: bool = Field(True, description="The weights (and the reference model's): "
                          "offloaded after the weight sync, restored before the next step's "
                          "reference and training passes.")


OFFLOAD_COLOCATED_ONLY = ("training.offload applies to placement: colocate only (disaggregated "
                          "engines have GPUs of their own): leave it at its defaults")


LORA_FSDP_ONLY = "the megatron backend has no LoRA yet; use backend fsdp"

LIGER_FSDP_GPU = ("fusedKernels liger applies to backend fsdp on GPUs (Liger Kernel's Triton "
                  "kernels in its HF models): set backend fsdp and gpusPerNode of at least "
                  "1, or fusedKernels none")


def _expert_parallel(training: TrainingSpec) -> int:
    p = training.parallelism
    return p.ep * p.expert_tp * p.pp


_ETP_CEL = "(has(self.parallelism.etp) ? self.parallelism.etp : self.parallelism.tp)"
_EP_OUTSIDE = (_outside("self.parallelism.ep", 1, MAX_PARALLEL) + " || "
               + _outside("self.parallelism.etp", 1, MAX_PARALLEL, optional=True))


def _model_parallel(training: TrainingSpec) -> int:
    p = training.parallelism
    return p.tp * p.pp * p.cp


class TrainingSpec(ApiModel):
    RULES = (
        Rule(f"{_gpus_outside('self')} || {_mp_outside('self')} || "
             "(self.gpusPerNode == 0 ? self.nodes : self.nodes * self.gpusPerNode)"
             " % (self.parallelism.tp * self.parallelism.pp * self.parallelism.cp) == 0",
             lambda t: t.world_size % _model_parallel(t) == 0,
             "parallelism.tp * pp * cp must divide the training GPU count"
             " (nodes * gpusPerNode)", "parallelism",
             detail=lambda t: f"tp * pp * cp = {_model_parallel(t)}, nodes * gpusPerNode = "
             f"{t.world_size}"),
        Rule("self.backend == 'megatron' || (self.parallelism.tp == 1 && "
             "self.parallelism.pp == 1)",
             lambda t: t.backend == "megatron" or (t.parallelism.tp == 1
                                                   and t.parallelism.pp == 1),
             "backend fsdp supports only data parallelism: tp and pp must be 1 (use backend "
             "megatron for model parallelism)", "parallelism"),
        Rule("self.backend != 'megatron' || self.gpusPerNode > 0",
             lambda t: t.backend != "megatron" or t.gpus_per_node > 0,
             "backend megatron trains on GPUs: gpusPerNode must be at least 1 (use backend "
             "fsdp to train on CPU)", "gpusPerNode"),
        Rule("self.parallelism.tp <= (self.gpusPerNode == 0 ? 1 : self.gpusPerNode)",
             lambda t: t.parallelism.tp <= max(t.gpus_per_node, 1),
             "parallelism.tp must fit on one node (at most gpusPerNode)", "parallelism.tp",
             detail=lambda t: f"gpusPerNode = {t.gpus_per_node}"),
        Rule("self.fusedKernels != 'liger' || (self.backend == 'fsdp' && "
             "self.gpusPerNode > 0)",
             lambda t: t.fused_kernels != "liger" or (t.backend == "fsdp"
                                                     and t.gpus_per_node > 0),
             LIGER_FSDP_GPU, "fusedKernels"),
        Rule("!has(self.lora) || self.backend == 'fsdp'",
             lambda t: t.lora is None or t.backend == "fsdp", LORA_FSDP_ONLY, "lora"),
        Rule(f"{_outside('self.parallelism.ep', 1, MAX_PARALLEL)} || "
             "self.parallelism.ep == 1 || self.backend == 'megatron'",
             lambda t: t.parallelism.ep == 1 or t.backend == "megatron", EP_NOT_SUPPORTED,
             "parallelism.ep"),
        Rule("!has(self.parallelism.etp) || self.backend == 'megatron'",
             lambda t: t.parallelism.etp is None or t.backend == "megatron",
             ETP_NOT_SUPPORTED, "parallelism.etp"),
        # Megatron lays the expert layers out as etp x ep x (expert data parallel) x pp over
        # the same ranks as the attention's tp x cp x dp x pp.
        Rule(f"{_gpus_outside('self')} || {_mp_outside('self')} || {_EP_OUTSIDE} || "
             "(self.gpusPerNode == 0 ? self.nodes : self.nodes * self.gpusPerNode)"
             f" % (self.parallelism.ep * {_ETP_CEL} * self.parallelism.pp) == 0",
             lambda t: t.world_size % _expert_parallel(t) == 0,
             "parallelism.ep * etp * pp must divide the training GPU count (nodes * "
             "gpusPerNode); etp is tp when unset", "parallelism.ep",
             detail=lambda t: f"ep * etp * pp = {_expert_parallel(t)}, nodes * gpusPerNode "
             f"= {t.world_size}"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    backend: Literal["megatron", "fsdp"] = "megatron"
    image: str = Field(DEFAULT_TRAINER_IMAGE, min_length=1, max_length=MAX_STR)
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Training pods, one per node.")
    gpus_per_node: int = Field(DEFAULT_GPUS_PER_NODE, ge=0, le=MAX_GPUS_PER_NODE,
                               description="0 trains on CPU (one worker a pod).")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    micro_batch_size: int = Field(1, ge=1, le=MAX_MICRO_BATCH,
                                  description="Samples per forward pass, as a token budget: "
                                  "a pass packs up to microBatchSize x the step's longest "
                                  "sample tokens, without padding.")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, le=MAX_MICRO_BATCH_TOKENS,
        description="Tokens one forward pass packs (prompts + responses, no padding), "
        "instead of the budget microBatchSize gives: bigger passes, fewer of them. At least "
        "data.maxPromptLen + data.maxResponseLen, so that any sample fits.")
    fused_kernels: Literal["none", "liger"] = Field(
        "none", description="Kernels of the fsdp backend's policy and reference models: "
        "none (PyTorch's own ops) or liger (Liger Kernel's Triton RoPE, RMSNorm and SwiGLU, "
        "for the model families Liger supports; backend fsdp on GPUs only).")
    global_batch_size: int | None = Field(
        None, ge=1, le=MAX_GLOBAL_BATCH,
        description="Samples per optimizer step; default: one step per rollout "
        "(rolloutBatchSize * nSamplesPerPrompt).")
    node_pool: NodePool = Field(default_factory=NodePool)
    resources: Resources = Field(default_factory=Resources)
    offload: OffloadSpec = Field(
        default_factory=OffloadSpec, description="placement: colocate only (disaggregated "
        "jobs leave it at its defaults). What each training rank moves to host memory while "
        "the engines generate, so their memory pool fits beside it (the engines release "
        "theirs while training runs); default: optimizer and weights. Both false keeps "
        "everything on the GPU (faster, when it fits).")

    lora: LoraSpec | None = Field(
        None, description="Train a LoRA adapter on the policy instead of all its weights "
        "(backend fsdp; docs/lora.md): the optimizer holds only the adapter, the KL reference "
        "is the base model (the adapter off), the engines get the merged weights.")

    @property
    def world_size(self) -> int:
        """Training processes: one per GPU, or one per node on CPU."""
        return self.nodes * self.gpus_per_node if self.gpus_per_node else self.nodes

    @property
    def data_parallel(self) -> int:
        p = self.parallelism
        return self.world_size // (p.tp * p.pp * p.cp)
