"""The rollout section: the inference engines (SGLang or the reference engine), their GPUs
and pods, restarts and health probes, the router, and the engine server flags a user may
add (rollout.engineArgs / engineListArgs, checked against engine_flags' tables)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, model_validator

from kuberl_api.base import ApiModel, FieldError, Rule, key_rule, rules_schema
from kuberl_api.engine_flags import (
    ENGINE_ARG_NAMES,
    ENGINE_ARG_PATTERN,
    ENGINE_FLAG_REFUSAL,
    ENGINE_FLAGS_REFUSED,
    ENGINE_LIST_ARGS_TWICE,
    KUBERL_ENGINE_FLAG_SOURCE,
    KUBERL_ENGINE_FLAGS,
    MAX_ENGINE_LIST_ITEMS,
    REFERENCE_ENGINE_ARGS,
    REFERENCE_ENGINE_FLAGS,
    REFERENCE_ENGINE_LIST_ARGS,
    engine_arg_problem,
    engine_list_arg_problem,
)
from kuberl_api.spec.common import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_ROLLOUT_IMAGE,
    IMPORT_PATH_PATTERN,
    MAX_ENGINE_RESTARTS,
    MAX_GPUS_PER_ENGINE,
    MAX_GPUS_PER_NODE,
    MAX_ROLLOUT_GPUS,
    MAX_STR,
    _outside,
)
from kuberl_api.spec.pods import NodePool, Resources

DEFAULT_ENGINE_RESTARTS = 3  # engine deaths a disaggregated run survives by default
# The share of each GPU a colocated engine's static pool (weights, KV cache) takes unless
# rollout.memoryFraction says otherwise. SGLang sizes its pool as if alone on the GPU (up to
# ~0.9 of large cards); colocated, the training ranks keep their CUDA context, NCCL buffers and
# whatever they do not offload beside it while the engines generate. 0.7 is what slime's
# colocated example scripts pass (--sglang-mem-fraction-static 0.7); with the optimizer and
# weights offloaded it leaves a 7B model's ranks on 8x80 GB ~20 GB a GPU.
COLOCATED_MEMORY_FRACTION = 0.7


class HealthProbe(ApiModel):
    """How the training loop watches each engine while it generates and takes weights: GET
    /health every periodSeconds; an engine that has not answered failureThreshold probes in a
    row within timeoutSeconds each is lost (its requests go to the other engines) and is
    replaced like a dead one (rollout.maxEngineRestarts). Not while weights are being sent
    (SGLang's /health generates a token, which waits for the update), and not without a
    restart budget (colocated engines)."""

    period_seconds: int = Field(5, ge=1, le=300)
    timeout_seconds: int = Field(10, ge=1, le=600)
    failure_threshold: int = Field(3, ge=1, le=100)


MEMORY_SAVER_COLOCATED = ("colocated SGLang engines need enable-memory-saver to release their "
                          "GPU memory to the trainers between phases: leave it on")


def _flag_name(key: str) -> bool:
    return re.fullmatch(ENGINE_ARG_PATTERN, key) is not None


def _none_of(flags: tuple[str, ...], message: str) -> Rule:
    """A rule on a map of engine flags: no key is one of `flags`."""
    return key_rule(f"!self.exists(k, k in {list(flags)})", lambda k: k not in flags, message)


def engine_flag_rules(field: str,
                      sources: Mapping[str, tuple[str, ...]] = KUBERL_ENGINE_FLAGS,
                      refused: Mapping[str, tuple[str, ...]] = ENGINE_FLAGS_REFUSED
                      ) -> tuple[Rule, ...]:
    """The rules on the keys of engineArgs or engineListArgs (`field`, as the messages name
    it): flag names, none of them one kuberl sets itself (`sources`: where each comes from,
    engine_flags.KUBERL_ENGINE_FLAGS for the policy's engines) or refuses (`refused`)."""
    return (
        key_rule(f"self.all(k, k.matches('{ENGINE_ARG_PATTERN}'))", _flag_name,
                 ENGINE_ARG_NAMES.replace("engineArgs", field)),
        *(_none_of(flags, f"{field} may not set {' or '.join(flags)} (kuberl sets it from "
                          f"{source})")
          for source, flags in sources.items()),
        *(_none_of(flags, f"{field} may not set {' or '.join(flags)}: {reason}")
          for reason, flags in refused.items()),
    )


ENGINE_ARGS_RULES = engine_flag_rules("engineArgs")
ENGINE_LIST_ARGS_RULES = engine_flag_rules("engineListArgs")

_ROLLOUT_GPUS_OUTSIDE = _outside("self.gpus", 0, MAX_ROLLOUT_GPUS)
# engineArgs keys the reference engine takes, or that a rule of their own reports.
_REFERENCE_OR_NAMED_FLAGS = [*REFERENCE_ENGINE_FLAGS, *KUBERL_ENGINE_FLAG_SOURCE,
                             *ENGINE_FLAG_REFUSAL]


def _not_for_reference(key: str) -> bool:
    """An engineArgs key the reference engine does not take, and no other rule reports."""
    return key not in _REFERENCE_OR_NAMED_FLAGS and _flag_name(key)


def _twice(rollout: RolloutSpec) -> list[str]:
    """The flags in both engineArgs and engineListArgs."""
    return sorted(set(rollout.engine_args) & set(rollout.engine_list_args))


FUNCTION_ARGS_NEED_FUNCTION = "functionArgs applies only with function"
MAX_TURNS = 1024
MAX_ROWS_PER_SAMPLE = 64
# (user code's settings: string maps, as environment variables are)
UserArgs = dict[str, Annotated[str, Field(max_length=MAX_STR)]]


class RolloutSpec(ApiModel):
    RULES = (
        Rule(f"!has(self.gpus) || {_ROLLOUT_GPUS_OUTSIDE} || "
             f"{_outside('self.gpusPerEngine', 1, MAX_GPUS_PER_ENGINE)} || "
             "self.gpus % self.gpusPerEngine == 0",
             lambda r: r.gpus is None or r.gpus % r.gpus_per_engine == 0,
             "gpus must be a multiple of gpusPerEngine", "gpus",
             detail=lambda r: f"gpusPerEngine = {r.gpus_per_engine}"),
        # Keys that are malformed or kuberl's own are reported by the field's rules.
        Rule("self.engine != 'reference' || self.engineArgs.all(k, "
             f"k in {_REFERENCE_OR_NAMED_FLAGS} || "
             f"!k.matches('{ENGINE_ARG_PATTERN}'))",
             lambda r: r.engine != "reference" or not any(map(_not_for_reference,
                                                              r.engine_args)),
             REFERENCE_ENGINE_ARGS, "engineArgs",
             value=lambda r: next(k for k in r.engine_args if _not_for_reference(k))),
        Rule("!self.engineListArgs.exists(k, k in self.engineArgs)", lambda r: not _twice(r),
             ENGINE_LIST_ARGS_TWICE, "engineListArgs", value=_twice),
        Rule("self.engine != 'reference' || size(self.engineListArgs) == 0",
             lambda r: r.engine != "reference" or not r.engine_list_args,
             REFERENCE_ENGINE_LIST_ARGS, "engineListArgs",
             value=lambda r: sorted(r.engine_list_args)),
        Rule("size(self.functionArgs) == 0 || has(self.function)",
             lambda r: not r.function_args or r.function is not None,
             FUNCTION_ARGS_NEED_FUNCTION, "functionArgs", value=lambda r: sorted(r.function_args)),
    )
    FIELD_RULES = {"engine_args": ENGINE_ARGS_RULES, "engine_list_args": ENGINE_LIST_ARGS_RULES}
    model_config = {"json_schema_extra": rules_schema(RULES)}

    engine: Literal["sglang", "reference"] = Field(
        "sglang", description="sglang in clusters (needs rollout GPUs); reference is the "
        "project's HF engine (CPU or GPU).")
    image: str = Field(DEFAULT_ROLLOUT_IMAGE, min_length=1, max_length=MAX_STR,
                       description="Image of the rollout pods (placement: disaggregated only).")
    gpus: int | None = Field(
        None, ge=0, le=MAX_ROLLOUT_GPUS,
        description="Total rollout GPUs. Colocated: defaults to (and must equal) the training "
        "GPUs. Disaggregated: required. 0: engines on CPU.")
    gpus_per_engine: int = Field(
        1, ge=1, le=MAX_GPUS_PER_ENGINE,
        description="Tensor parallel size of an engine. Disaggregated: divides gpusPerNode "
        "(engines share a node), or a multiple of it for an engine wider than a node (it "
        "spans gpusPerEngine / gpusPerNode rollout pods, SGLang's --nnodes). Colocated: "
        "divides training.gpusPerNode. On CPU (gpus: 0) the reference engine runs this many "
        "processes.")
    gpus_per_node: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE,
                               description="GPUs per rollout pod (placement: disaggregated "
                               "only). On CPU (gpus: 0): the most engine processes a rollout "
                               "pod holds, so an engine of more processes spans pods.")
    engines: int | None = Field(
        None, ge=1, le=4096, description="Engine count when rollout runs on CPU (no rollout "
        "GPUs) only; default 1. With GPUs the count is rollout GPUs / gpusPerEngine.")
    max_engine_restarts: int | None = Field(
        None, ge=0, le=MAX_ENGINE_RESTARTS,
        description="How many times in a run an engine that dies is replaced (placement: "
        "disaggregated): its requests are retried on the other engines, and the replacement "
        "starts in the dead one's place and gets the current weights before the next step. "
        "One more death fails the run with the engine's last log lines. Default "
        + str(DEFAULT_ENGINE_RESTARTS) + " (disaggregated), 0 (colocated: engines share the "
        "training GPUs and are not replaced).")
    health_probe: HealthProbe = Field(default_factory=HealthProbe)
    router: Literal["none", "sglang"] = Field(
        "none", description="How generate requests reach the engines. none: the trainer's "
        "own client balances whole GRPO groups over the engines (one batched request per "
        "engine). sglang: through SGLang's router (sglang-router), started beside the "
        "training loop, one request per sample with a GRPO group kept on one engine (its "
        "prefix cache); weight updates still go to every engine directly, and an engine "
        "replaced or found silent is taken out of the router first.")
    node_pool: NodePool = Field(default_factory=NodePool)
    resources: Resources = Field(default_factory=Resources,
                                 description="CPU and memory per rollout pod (placement: "
                                 "disaggregated only).")
    memory_fraction: float | None = Field(
        None, gt=0, lt=1,
        description="The share of each engine GPU the engine's static pool takes: its weights "
        "and KV cache (SGLang's --mem-fraction-static), between 0 and 1 exclusive. Colocated "
        "engines on GPUs default to " + str(COLOCATED_MEMORY_FRACTION) + " (they release the "
        "pool while the trainers train; the training ranks keep their CUDA context and what "
        "they do not offload beside it while the engines generate). Otherwise unset: SGLang "
        "sizes the pool itself, the reference engine reserves none.")
    engine_args: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra engine server flags without the leading '--', e.g. "
        "{chunked-prefill-size: '4096'}; a switch (SGLang's store_true flags) is 'true' (or '') "
        "for on and 'false' for off (e.g. enable-memory-saver: 'true'); not the flags kuberl "
        "sets itself (model-path, tokenizer-path, host, port, nccl-port, tp-size, "
        "random-seed/seed, device, torch-threads, dist-init-addr, nnodes, node-rank, "
        "mem-fraction-static: see memoryFraction, api-key and config: the job's engine API "
        "key, enable-lora, max-lora-rank, lora-target-modules, max-loaded-loras and "
        "max-loras-per-batch: training.lora) nor dp-size, pp-size, base-gpu-id, gpu-id-step, "
        "skip-tokenizer-init. SGLang "
        "engines: names, switches, value types and choices are checked against SGLang "
        "0.5.6's own flags when the job is validated. "
        "Colocated SGLang engines on GPUs get enable-memory-saver (the memory handoff needs "
        "it: 'false' is refused there). The reference engine takes only "
        + ", ".join(REFERENCE_ENGINE_FLAGS) + ".",
        json_schema_extra=rules_schema(ENGINE_ARGS_RULES))
    engine_list_args: dict[str, Annotated[
        list[Annotated[str, Field(max_length=MAX_STR)]],
        Field(min_length=1, max_length=MAX_ENGINE_LIST_ITEMS)]] = Field(
        default_factory=dict, max_length=16,
        description="Engine server flags that take several values (SGLang's nargs flags, e.g. "
        "{cuda-graph-bs: ['1', '2', '4']}): passed as one flag followed by its values "
        "(--cuda-graph-bs 1 2 4). Same names and limits as engineArgs; a flag is in one of "
        "the two maps; each list holds 1 to " + str(MAX_ENGINE_LIST_ITEMS) + " values (a "
        "switch goes in engineArgs). SGLang engines only.",
        json_schema_extra=rules_schema(ENGINE_LIST_ARGS_RULES))

    function: str | None = Field(
        None, max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
        description="`module:function`: an async rollout function, `run(ctx, **functionArgs) "
        "-> Trajectory | list[Trajectory]`, called once per sample and seed to make its "
        "trajectory (or up to maxRowsPerSample of them) with ctx.generate (docs/agents.md); "
        "the module must be importable on the head. Unset: one turn per sample (or "
        "environment.class).")
    function_args: UserArgs = Field(default_factory=dict, max_length=64,
                                    description="Keyword arguments of rollout.function.")
    max_turns: int = Field(1, ge=1, le=MAX_TURNS, description="The model's turns per "
                           "trajectory at most; more than 1 only with rollout.function or "
                           "environment.class.")
    max_rows_per_sample: int = Field(
        1, ge=1, le=MAX_ROWS_PER_SAMPLE,
        description="The trajectories (training rows) rollout.function may return for one "
        "sample, at most (a multi-agent or a context-reset agent); more than 1 only with "
        "rollout.function and a group-relative advantageEstimator (grpo, dr_grpo, rloo). A "
        "sample's rows share its one reward and advantage, and count as one sample of its "
        "GRPO group and of globalBatchSize; a sample with fewer rows is padded with empty rows "
        "out of the loss.")

    # Python only, not a Rule: CEL cannot carry SGLang's flag table, so the API server
    # admits what this refuses (and the message is worked out per flag). Listed in
    # tests/unit/test_api_rules.py's PYTHON_ONLY; runs after the rules above.
    @model_validator(mode="after")
    def _sglang_engine_flags(self, info: ValidationInfo) -> RolloutSpec:
        """Values SGLang's own parser would refuse at start (engine_flags' table of the
        pinned release)."""
        if self.engine == "sglang":
            for key, value in sorted(self.engine_args.items()):
                problem = engine_arg_problem(key, value)
                if problem is not None:
                    self.refuse(FieldError("engineArgs", {key: value}, problem), info)
            for key, values in sorted(self.engine_list_args.items()):
                problem = engine_list_arg_problem(key, values)
                if problem is not None:
                    self.refuse(FieldError("engineListArgs", {key: values}, problem), info)
        return self
