"""The schedule and checkpoint sections: how many steps, how often to evaluate and save, and
where checkpoints go."""

from __future__ import annotations

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import MAX_STR, PVC_NAME_PATTERN, RESERVED_PATHS


class ScheduleSpec(ApiModel):
    num_rollouts: int = Field(100, ge=1, le=10_000_000, description="Training steps.")
    eval_interval: int | None = Field(None, ge=1, description="Evaluate data.evalSets every "
                                      "N steps (both or neither).")
    save_interval: int | None = Field(None, ge=1, description="Checkpoint every N steps.")


class CheckpointSpec(ApiModel):
    """Where checkpoints go. Without a PVC they live on the head's disk and a restart starts
    over, so set one whenever backoffLimit > 0 matters to you."""

    RULES = (
        Rule("self.path.startsWith('/')", lambda c: c.path.startswith("/"),
             "checkpoint path must be absolute", "path"),
        Rule(f"!(self.path in {list(RESERVED_PATHS)})", lambda c: c.path not in RESERVED_PATHS,
             f"checkpoint path may not be one of {', '.join(RESERVED_PATHS)}", "path"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    pvc: str | None = Field(None, min_length=1, max_length=253, pattern=PVC_NAME_PATTERN)
    path: str = Field("/checkpoints", min_length=1, max_length=MAX_STR)
    keep: int = Field(2, ge=1, le=1000, description="How many recent checkpoints to keep.")
