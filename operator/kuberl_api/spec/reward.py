"""The reward section: a built-in reward function, the user's own, a reward service over
HTTP, or a reward model the job serves itself (docs/rewards.md)."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator
from pydantic.alias_generators import to_camel

from kuberl_api.base import ApiModel, FieldError, Rule, rules_schema
from kuberl_api.engine_flags import (
    ENGINE_ARG_PATTERN,
    REWARD_ENGINE_FLAG_REFUSAL,
    REWARD_ENGINE_FLAG_SOURCE,
    REWARD_ENGINE_FLAGS,
    REWARD_ENGINE_FLAGS_REFUSED,
    engine_arg_problem,
)
from kuberl_api.spec.common import (
    DEFAULT_ROLLOUT_IMAGE,
    IMPORT_PATH_PATTERN,
    MAX_STR,
    PVC_NAME_PATTERN,
)
from kuberl_api.spec.model import Storage, storage_rules
from kuberl_api.spec.pods import NodePool, Resources
from kuberl_api.spec.rollout import engine_flag_rules

# An http(s) URL without whitespace: the reward service's endpoint, POSTed to as it is.
HTTP_URL_PATTERN = r"^https?://[^\s/?#]+[^\s]*$"
# What a remote reward's settings are when unset (the properties below).
DEFAULT_TIMEOUT_SECONDS = 60
DEFAULT_MAX_RETRIES = 3
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_CONCURRENT_REQUESTS = 8
MAX_TIMEOUT_SECONDS = 3600
MAX_RETRIES = 100
MAX_BATCH_SIZE = 65536
MAX_CONCURRENT_REQUESTS = 1024
# The fields only a reward service or a served reward model reads (snake_case): how the
# trainer calls it. url has its own rule (required for type remote).
REMOTE_ONLY = ("timeout_seconds", "max_retries", "batch_size", "max_concurrent_requests",
               "on_error")
CALLED_TYPES = ("remote", "model")  # the rewards the trainer calls over HTTP
BATCH_NEEDS_CUSTOM = ("batch applies only to type custom: it says that function takes the "
                      "step's samples at once")
MAX_REWARD_REPLICAS = 64
MAX_GPUS_PER_REPLICA = 8
MAX_JUDGE_TOKENS = 32768
DEFAULT_JUDGE_TOKENS = 512
# A judge's answer's score: the last number in it (an integer or a decimal, signed).
DEFAULT_SCORE_PATTERN = r"-?\d+(?:\.\d+)?"
# What a judge's prompt template may name: the sample's.
JUDGE_FIELDS = ("prompt", "response", "label")
SGLANG_NEEDS_GPUS = ("SGLang serves a reward model on GPUs: gpusPerReplica must be at least 1 "
                     "(engine reference serves one on CPU)")


def _remote_only(name: str) -> Rule:
    """Field `name` (snake_case) stays unset unless the trainer calls the reward over HTTP."""
    field = to_camel(name)
    return Rule(f"!has(self.{field}) || self.type in {list(CALLED_TYPES)}",
                lambda r: r.type in CALLED_TYPES or getattr(r, name) is None,
                f"{field} applies only to type remote or model (a reward service, or a reward "
                "model the job serves)", field, detail=lambda r: f"type = {r.type}")


# The reference engine's flags a reward model it serves takes (REFERENCE_ENGINE_FLAGS less
# those of generation and weight updates, which its --is-embedding mode refuses).
REWARD_REFERENCE_FLAGS = ("dtype", "max-batch-size", "max-prefill-tokens", "enable-metrics")
_REWARD_REFERENCE_OR_NAMED = (*REWARD_REFERENCE_FLAGS, *REWARD_ENGINE_FLAG_SOURCE,
                              *REWARD_ENGINE_FLAG_REFUSAL)
REWARD_ENGINE_ARGS_RULES = engine_flag_rules("reward.model.engineArgs", REWARD_ENGINE_FLAGS,
                                             REWARD_ENGINE_FLAGS_REFUSED)
REWARD_REFERENCE_ARGS = ("a reward model on engine reference takes only these engineArgs: "
                         + ", ".join(REWARD_REFERENCE_FLAGS))


def _not_for_reference(key: str) -> bool:
    """An engineArgs key the reference engine does not take for a reward model, and no other
    rule reports."""
    return (key not in _REWARD_REFERENCE_OR_NAMED
            and re.fullmatch(ENGINE_ARG_PATTERN, key) is not None)


def template_problem(template: str) -> str | None:
    """Why a judge's prompt template cannot be filled (str.format with the sample's
    prompt, response and label), or None."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return f"not a format string ({exc}; write a literal brace as {{{{ or }}}})"
    unknown = sorted({n for n in names if n not in JUDGE_FIELDS})
    if unknown:
        return (f"names {unknown}: a judge's prompt may name only "
                f"{{{'}, {'.join(JUDGE_FIELDS)}}} (a literal brace is {{{{ or }}}})")
    if "response" not in names:
        return "must name {response}: the judge grades the policy's response"
    return None


def pattern_problem(pattern: str) -> str | None:
    """Why a judge's score pattern cannot read a score, or None."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        return f"not a regular expression: {exc}"
    if compiled.groups > 1:
        return "may hold one group at most (the score: the group, else the whole match)"
    return None


# An HTTP header's name (RFC 9110's token) and a Secret's data key.
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
AUTHORIZATION = "Authorization"


class RewardAuth(ApiModel):
    """The reward service's credential: a key of a Secret in the RLJob's namespace, sent with
    every request. In a cluster the head reads it from the Secret (the operator gives it as
    $KUBERL_REWARD_AUTH); `kuberl run` reads $KUBERL_REWARD_AUTH."""

    secret: str = Field(min_length=1, max_length=253, pattern=PVC_NAME_PATTERN,
                        description="The Secret's name (in the RLJob's namespace).")
    key: str = Field("token", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN,
                     description="The key of the Secret's data that holds the credential.")
    header: str = Field(
        AUTHORIZATION, min_length=1, max_length=256, pattern=HEADER_NAME_PATTERN,
        description="The header it goes in: Authorization (the default) sends "
        "`Bearer <credential>`; any other header (X-API-Key, say) the credential as it is.")

    def header_value(self, credential: str) -> str:
        return f"Bearer {credential}" if self.header.lower() == "authorization" else credential


class JudgeSpec(ApiModel):
    """A generative judge: each sample's prompt is filled in, the judge answers greedily, and
    its score is read from the answer."""

    prompt: str = Field(
        min_length=1, max_length=16384,
        description="The judge's user message, a Python format string naming {response} and "
        "optionally {prompt} and {label} (the sample's); a literal brace is {{ or }}. Sent "
        "through the judge tokenizer's chat template when it has one, as it is otherwise.")
    score_pattern: str = Field(
        DEFAULT_SCORE_PATTERN, min_length=1, max_length=MAX_STR,
        description="A regular expression; the score is its last match in the judge's answer "
        "(its group when it has one), read as a number. An answer with no match has no score: "
        "an error (reward.onError), never a reward of 0. Default: the last number.")
    max_new_tokens: int = Field(
        DEFAULT_JUDGE_TOKENS, ge=1, le=MAX_JUDGE_TOKENS,
        description="The judge's answer's length at most, in tokens.")

    # Python only: CEL can neither parse a format string nor compile a regular expression.
    @model_validator(mode="after")
    def _fillable(self, info: ValidationInfo) -> JudgeSpec:
        for field, value, problem in (
                ("prompt", self.prompt, template_problem(self.prompt)),
                ("scorePattern", self.score_pattern, pattern_problem(self.score_pattern))):
            if problem is not None:
                self.refuse(FieldError(field, value, problem), info)
        return self


class RewardModelSpec(ApiModel):
    """A reward model the job serves itself: `replicas` engines of `gpusPerReplica` GPUs each
    (SGLang, or the reference engine), on pods of their own, called by the trainer like a
    reward service."""

    RULES = (
        Rule("self.engine == 'reference' || self.gpusPerReplica > 0",
             lambda m: m.engine == "reference" or m.gpus_per_replica > 0, SGLANG_NEEDS_GPUS,
             "gpusPerReplica", detail=lambda m: f"engine = {m.engine}"),
        Rule("self.form == 'judge' ? has(self.judge) : !has(self.judge)",
             lambda m: (m.form == "judge") == (m.judge is not None),
             "judge is required when form is judge, and allowed only then", "judge",
             detail=lambda m: f"form = {m.form}"),
        Rule("self.engine != 'reference' || self.engineArgs.all(k, "
             f"k in {list(_REWARD_REFERENCE_OR_NAMED)}"
             f" || !k.matches('{ENGINE_ARG_PATTERN}'))",
             lambda m: m.engine != "reference" or not any(map(_not_for_reference,
                                                              m.engine_args)),
             REWARD_REFERENCE_ARGS, "engineArgs",
             value=lambda m: next(k for k in m.engine_args if _not_for_reference(k))),
        *storage_rules("the reward model"),
    )
    FIELD_RULES = {"engine_args": REWARD_ENGINE_ARGS_RULES}
    model_config = {"json_schema_extra": rules_schema(RULES)}

    path: str = Field(min_length=1, max_length=MAX_STR,
                      description="The reward model's HF checkpoint directory: a scalar head "
                      "(*ForSequenceClassification, *ForRewardModel) for form scalar, a causal "
                      "LM for form judge. The trainer reads its tokenizer too.")
    tokenizer: str | None = Field(None, max_length=MAX_STR,
                                  description="Its tokenizer directory; defaults to `path`.")
    storage: Storage | None = Field(
        None, description="PVC that holds it, mounted in every pod of the job (the head reads "
        "its tokenizer).")
    form: Literal["scalar", "judge"] = Field(
        "scalar", description="scalar: the model's head scores the conversation (prompt, "
        "response) through its chat template (SGLang's --is-embedding and /classify); the "
        "score is the reward. judge: a causal LM answers judge.prompt greedily and the score "
        "read from its answer is the reward.")
    judge: JudgeSpec | None = Field(None, description="Form judge (required): the prompt "
                                    "and how its answer's score is read.")
    engine: Literal["sglang", "reference"] = Field(
        "sglang", description="sglang (GPUs), or the project's reference engine (CPU or GPU).")
    replicas: int = Field(1, ge=1, le=MAX_REWARD_REPLICAS,
                          description="Engines serving it; a step's batches go round them.")
    gpus_per_replica: int = Field(
        1, ge=0, le=MAX_GPUS_PER_REPLICA,
        description="GPUs of each engine (its tensor parallel size), on one pod; 0: CPU "
        "(engine reference).")
    engine_args: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra engine server flags, as rollout.engineArgs: not those kuberl sets "
        "(model-path, tokenizer-path, host, port, nccl-port, tp-size, random-seed, device, "
        "torch-threads, the multi-node flags, api-key, config; is-embedding: form scalar sets "
        "it) nor dp-size, pp-size, base-gpu-id, gpu-id-step, skip-tokenizer-init. SGLang: "
        "checked against SGLang 0.5.6's own flags (mem-fraction-static is yours to set). The "
        "reference engine takes only " + ", ".join(REWARD_REFERENCE_FLAGS) + ".",
        json_schema_extra=rules_schema(REWARD_ENGINE_ARGS_RULES))
    image: str = Field(DEFAULT_ROLLOUT_IMAGE, min_length=1, max_length=MAX_STR,
                       description="Image of the reward model's pods (an engine image).")
    node_pool: NodePool = Field(default_factory=NodePool,
                                description="Where the reward model's pods run.")
    resources: Resources = Field(default_factory=Resources,
                                 description="CPU and memory per reward model pod.")

    # Python only, as RolloutSpec's: CEL cannot carry SGLang's flag table.
    @model_validator(mode="after")
    def _sglang_engine_flags(self, info: ValidationInfo) -> RewardModelSpec:
        if self.engine == "sglang":
            for key, value in sorted(self.engine_args.items()):
                problem = engine_arg_problem(key, value)
                if problem is not None:
                    self.refuse(FieldError("engineArgs", {key: value}, problem), info)
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class RewardSpec(ApiModel):
    RULES = (
        Rule("self.type == 'custom' ? has(self.function) : !has(self.function)",
             lambda r: (r.type == "custom") == (r.function is not None),
             "function is required when type is custom, and allowed only then", "function",
             detail=lambda r: f"type = {r.type}"),
        Rule("!self.batch || self.type == 'custom'",
             lambda r: not r.batch or r.type == "custom", BATCH_NEEDS_CUSTOM, "batch",
             detail=lambda r: f"type = {r.type}"),
        Rule("self.type == 'remote' ? has(self.url) : !has(self.url)",
             lambda r: (r.type == "remote") == (r.url is not None),
             "url is required when type is remote, and allowed only then", "url",
             detail=lambda r: f"type = {r.type}"),
        Rule("!has(self.auth) || self.type == 'remote'",
             lambda r: r.auth is None or r.type == "remote",
             "auth applies only to type remote (a served reward model is called with the "
             "engines' own key)", "auth", detail=lambda r: f"type = {r.type}"),
        Rule("self.type == 'model' ? has(self.model) : !has(self.model)",
             lambda r: (r.type == "model") == (r.model is not None),
             "model is required when type is model, and allowed only then", "model",
             detail=lambda r: f"type = {r.type}"),
        *(_remote_only(name) for name in REMOTE_ONLY),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    type: Literal["math", "exact", "f1", "custom", "remote", "model", "environment"] = Field(
        "math", description="How a trajectory is graded. math, exact, f1, custom: its answer "
        "(the last model turn's text) against the sample's label. remote: the same, by a "
        "reward service over HTTP (url). model: by a reward model or judge the job serves "
        "(model). environment: the sum of its environment's step rewards "
        "(environment.class), or the Trajectory.reward a rollout.function sets.")
    function: str | None = Field(
        None, max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
        description="`module:function` for type custom: `fn(response, label) -> float`, "
        "plain or `async def`; with batch, `fn(samples) -> list[float]` (plain or async) over "
        "the step's samples (each with id, prompt, response, label and metadata).")
    batch: bool = Field(
        False, description="Type custom: function grades the step's samples in one call "
        "(a judge that batches) rather than one sample per call.")
    url: str | None = Field(
        None, max_length=MAX_STR, pattern=HTTP_URL_PATTERN,
        description="Type remote (required): the http(s) endpoint each batch is POSTed to as "
        '{"items": [{"id", "prompt", "response", "label", "metadata"}]}; it answers '
        '{"rewards": [...]} in the same order or {"results": [{"id", "reward", "metrics"}]}.')
    auth: RewardAuth | None = Field(
        None, description="Type remote: the service's credential, from a Secret, sent with "
        "every request (Authorization: Bearer, or a header of your own).")
    model: RewardModelSpec | None = Field(
        None, description="Type model (required): the reward model or judge to serve, and "
        "how it scores.")
    timeout_seconds: int | None = Field(
        None, ge=1, le=MAX_TIMEOUT_SECONDS,
        description="Type remote or model: how long one request may take before it is retried. "
        f"Default {DEFAULT_TIMEOUT_SECONDS}.")
    max_retries: int | None = Field(
        None, ge=0, le=MAX_RETRIES,
        description="Type remote or model: times a batch is sent again after a transport error, a "
        "timeout, HTTP 408, 429 or 5xx (exponential backoff with jitter; Retry-After "
        "honoured); any other answer fails the job at once. Default "
        f"{DEFAULT_MAX_RETRIES}.")
    batch_size: int | None = Field(
        None, ge=1, le=MAX_BATCH_SIZE,
        description="Type remote or model: samples per request at most (a batch may hold "
        f"samples of several prompts). Default {DEFAULT_BATCH_SIZE}.")
    max_concurrent_requests: int | None = Field(
        None, ge=1, le=MAX_CONCURRENT_REQUESTS,
        description="Type remote or model: requests in flight at once; a step's other batches wait "
        f"for a free slot. Default {DEFAULT_MAX_CONCURRENT_REQUESTS}.")
    on_error: Literal["fail", "drop"] | None = Field(
        None, description="Type remote or model: a batch still failing after maxRetries. fail "
        "(default): the job fails, naming url and the last answer. drop: the whole GRPO "
        "group of each of its samples leaves the step (never scored 0), counted as "
        "reward_errors and reward_dropped_groups; a step whose groups are all dropped is "
        "rolled out again with the next prompts, twice at most, then the job fails.")

    @property
    def request_timeout_seconds(self) -> int:
        return self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS

    @property
    def retries(self) -> int:
        return DEFAULT_MAX_RETRIES if self.max_retries is None else self.max_retries

    @property
    def request_batch_size(self) -> int:
        return self.batch_size or DEFAULT_BATCH_SIZE

    @property
    def concurrent_requests(self) -> int:
        return self.max_concurrent_requests or DEFAULT_MAX_CONCURRENT_REQUESTS

    @property
    def drops_errors(self) -> bool:
        """A failed batch drops its samples' groups (onError drop) rather than the job."""
        return self.on_error == "drop"

    @property
    def called(self) -> bool:
        """The trainer calls the reward over HTTP: a service's, or a model the job serves."""
        return self.type in CALLED_TYPES

    @property
    def sees_metadata(self) -> bool:
        """The reward reads each sample's metadata (data.metadataKeys): a service's request
        carries it, a batch function's inputs too."""
        return self.type == "remote" or self.batch
