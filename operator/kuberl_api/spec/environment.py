"""The environment section: a class the trajectories run in, one instance per trajectory, in
the head's process, or (with `image`) served over HTTP by pods of the environment's own image
that the operator runs beside the job (docs/agents.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.alias_generators import to_camel

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR, env_name_rules
from kuberl_api.spec.pods import NodePool, Resources
from kuberl_api.spec.rollout import UserArgs

ENVIRONMENT_ARGS_NEED_CLASS = "args applies only with class"
ARGS_NO_SEED = ("args may not name seed: kuberl gives a reset that declares seed the "
                "trajectory's seed")
IMAGE_NEEDS_CLASS = ("image needs class: the module:Class inside the image that its server "
                     "serves")
DEFAULT_REPLICAS = 1
DEFAULT_TIMEOUT_SECONDS = 60
MAX_REPLICAS = 1024
MAX_TIMEOUT_SECONDS = 3600


def _image_only(name: str, unset: str) -> Rule:
    """Field `name` (snake_case) stays unset without an image; `unset` is CEL's test of that."""
    field = to_camel(name)
    return Rule(f"{unset} || has(self.image)",
                lambda e: e.image is not None or not getattr(e, name),
                f"{field} applies only with image (the environment's own pods)", field)


ENV_RULES = env_name_rules("environment.env")


class EnvironmentSpec(ApiModel):
    """Multi-turn trajectories in an environment: the model's turn, the environment's step
    and observation (out of the loss), until it is done, rollout.maxTurns or the budget
    (data.maxResponseLen)."""

    RULES = (
        Rule("size(self.args) == 0 || has(self.class)",
             lambda e: not e.args or e.class_ is not None, ENVIRONMENT_ARGS_NEED_CLASS, "args",
             value=lambda e: sorted(e.args)),
        Rule("!('seed' in self.args)", lambda e: "seed" not in e.args, ARGS_NO_SEED, "args"),
        Rule("!has(self.image) || has(self.class)",
             lambda e: e.image is None or e.class_ is not None, IMAGE_NEEDS_CLASS, "image"),
        _image_only("replicas", "!has(self.replicas)"),
        _image_only("timeout_seconds", "!has(self.timeoutSeconds)"),
        _image_only("resources", "!has(self.resources)"),
        _image_only("node_pool", "!has(self.nodePool)"),
        _image_only("env", "size(self.env) == 0"),
    )
    FIELD_RULES = {"env": ENV_RULES}
    model_config = {"json_schema_extra": rules_schema(RULES)}

    class_: str | None = Field(
        None, alias="class", max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
        description="`module:Class` with async reset(sample, **args), step(action_ids, "
        "action_text) and close() (kuberl_trainer.agents). Without image the module must be "
        "importable on the head and runs in its process; with image, the server inside the "
        "image serves it. Unset: no environment.")
    args: UserArgs = Field(default_factory=dict, max_length=64,
                           description="Keyword arguments of the environment's reset.")
    on_error: Literal["fail", "drop"] = Field(
        "fail", description="An episode whose environment fails (reset or step raises; a "
        "rollout.function raises kuberl_trainer.agents.EnvironmentFailure). fail: the job "
        "fails with the error. drop: the episode's whole GRPO group leaves the step (never "
        "scored 0) and env_errors counts it; a step whose groups are all dropped is rolled "
        "out again with the next prompts, twice at most, then the job fails. drop applies "
        "only with environment.class or rollout.function.")
    image: str | None = Field(
        None, min_length=1, max_length=MAX_STR,
        description="Run the environment as a service of its own: pods of this image (built "
        "FROM kuberl's environment image, with class importable) serve class over HTTP "
        "(`python -m kuberl_env`), as a Deployment and a headless Service owned by the RLJob; "
        "each episode stays on one replica. `kuberl run` serves class as a local subprocess "
        "instead, or uses --environment-url. Unset: class runs in the head's process.")
    replicas: int | None = Field(
        None, ge=1, le=MAX_REPLICAS,
        description=f"Pods serving the environment (image only); default {DEFAULT_REPLICAS}.")
    timeout_seconds: int | None = Field(
        None, ge=1, le=MAX_TIMEOUT_SECONDS,
        description="How long one reset, step or close may take (image only); a call that "
        "times out or loses its connection is retried a few times, then fails the job. "
        f"Default {DEFAULT_TIMEOUT_SECONDS}.")
    resources: Resources | None = Field(
        None, description="CPU and memory per environment pod (image only).")
    node_pool: NodePool | None = Field(
        None, description="Where the environment pods run (image only).")
    env: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Environment variables of the environment pods (image only).",
        json_schema_extra=rules_schema(ENV_RULES))

    @property
    def replica_count(self) -> int:
        return self.replicas or DEFAULT_REPLICAS

    @property
    def call_timeout_seconds(self) -> int:
        return self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
