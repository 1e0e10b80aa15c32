"""The reward section: a built-in reward function or the user's own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR


class RewardSpec(ApiModel):
    RULES = (
        Rule("self.type == 'custom' ? has(self.function) : !has(self.function)",
             lambda r: (r.type == "custom") == (r.function is not None),
             "function is required when type is custom, and allowed only then", "function",
             detail=lambda r: f"type = {r.type}"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    type: Literal["math", "exact", "f1", "custom", "environment"] = Field(
        "math", description="How a trajectory is graded. math, exact, f1, custom: its answer "
        "(the last model turn's text) against the sample's label. environment: the sum of "
        "its environment's step rewards (environment.class), or the Trajectory.reward a "
        "rollout.function sets.")
    function: str | None = Field(None, max_length=MAX_STR, pattern=IMPORT_PATH_PATTERN,
                                 description="`module:function` for type custom.")
