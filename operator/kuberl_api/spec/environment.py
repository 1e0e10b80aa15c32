"""The environment section: a class the trajectories run in, one instance per trajectory, in
the head's process (docs/agents.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR
from kuberl_api.spec.rollout import UserArgs

ENVIRONMENT_ARGS_NEED_CLASS = "args applies only with class"


class EnvironmentSpec(ApiModel):
    """Multi-turn trajectories in an environment: the model's turn, the environment's step
    and observation (out of the loss), until it is done, rollout.maxTurns or the budget
    (data.maxResponseLen)."""

    RULES = (
        Rule("size(self.args) == 0 || has(self.class)",
             lambda e: not e.args or e.class_ is not None, ENVIRONMENT_ARGS_NEED_CLASS, "args",
             value=lambda e: sorted(e.args)),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    class_: str | None = Field(
        None, alias="class", max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
        description="`module:Class` with async reset(sample, **args), step(action_ids, "
        "action_text) and close() (kuberl_trainer.agents); the module must be importable on "
        "the head. Unset: no environment.")
    args: UserArgs = Field(default_factory=dict, max_length=64,
                           description="Keyword arguments of the environment's reset.")
    on_error: Literal["fail", "drop"] = Field(
        "fail", description="An episode whose environment fails (reset or step raises; a "
        "rollout.function raises kuberl_trainer.agents.EnvironmentFailure). fail: the job "
        "fails with the error. drop: the episode's whole GRPO group leaves the step (never "
        "scored 0) and env_errors counts it; a step whose groups are all dropped is rolled "
        "out again with the next prompts, twice at most, then the job fails. drop applies "
        "only with environment.class or rollout.function.")
