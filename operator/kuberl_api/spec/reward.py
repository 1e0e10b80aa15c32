"""The reward section: a built-in reward function or the user's own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kuberl_api.base import ApiModel, cel, cel_rules, check
from kuberl_api.spec.common import IMPORT_PATH_PATTERN, MAX_STR


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
