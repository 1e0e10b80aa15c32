"""The reward section: a built-in reward function, the user's own, or a reward service over
HTTP (docs/rewards.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.alias_generators import to_camel

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR

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
# The fields only a reward service reads (snake_case); url has its own rule (required there).
REMOTE_ONLY = ("timeout_seconds", "max_retries", "batch_size", "max_concurrent_requests",
               "on_error")
BATCH_NEEDS_CUSTOM = ("batch applies only to type custom: it says that function takes the "
                      "step's samples at once")


def _remote_only(name: str) -> Rule:
    """Field `name` (snake_case) stays unset unless the reward is a service's."""
    field = to_camel(name)
    return Rule(f"!has(self.{field}) || self.type == 'remote'",
                lambda r: r.type == "remote" or getattr(r, name) is None,
                f"{field} applies only to type remote (a reward service)", field,
                detail=lambda r: f"type = {r.type}")


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
        *(_remote_only(name) for name in REMOTE_ONLY),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    type: Literal["math", "exact", "f1", "custom", "remote", "environment"] = Field(
        "math", description="How a trajectory is graded. math, exact, f1, custom: its answer "
        "(the last model turn's text) against the sample's label. remote: the same, by a "
        "reward service over HTTP (url). environment: the sum of its environment's step "
        "rewards (environment.class), or the Trajectory.reward a rollout.function sets.")
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
    timeout_seconds: int | None = Field(
        None, ge=1, le=MAX_TIMEOUT_SECONDS,
        description="Type remote: how long one request may take before it is retried. "
        f"Default {DEFAULT_TIMEOUT_SECONDS}.")
    max_retries: int | None = Field(
        None, ge=0, le=MAX_RETRIES,
        description="Type remote: times a batch is sent again after a transport error, a "
        "timeout, HTTP 408, 429 or 5xx (exponential backoff with jitter; Retry-After "
        "honoured); any other answer fails the job at once. Default "
        f"{DEFAULT_MAX_RETRIES}.")
    batch_size: int | None = Field(
        None, ge=1, le=MAX_BATCH_SIZE,
        description="Type remote: samples per request at most (a batch may hold samples of "
        f"several prompts). Default {DEFAULT_BATCH_SIZE}.")
    max_concurrent_requests: int | None = Field(
        None, ge=1, le=MAX_CONCURRENT_REQUESTS,
        description="Type remote: requests in flight at once; a step's other batches wait "
        f"for a free slot. Default {DEFAULT_MAX_CONCURRENT_REQUESTS}.")
    on_error: Literal["fail", "drop"] | None = Field(
        None, description="Type remote: a batch still failing after maxRetries. fail "
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
    def sees_metadata(self) -> bool:
        """The reward reads each sample's metadata (data.metadataKeys): a service's request
        carries it, a batch function's inputs too."""
        return self.type == "remote" or self.batch
