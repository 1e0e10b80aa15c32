"""Where a group of pods runs and what it gets besides GPUs: node pools (node selectors and
tolerations) and CPU and memory resources; shared by the training, rollout and critic
sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel, Rule, rules_schema
from kuberl_api.spec.common import MAX_ITEMS, QUANTITY_PATTERN

# Kubernetes refuses such tolerations when KubeRay creates the pods, which would leave the job
# waiting for pods that never come; refused here instead, in Kubernetes' own terms.
TOLERATION_EXISTS_HAS_NO_VALUE = ("value must be empty with operator Exists (it tolerates the "
                                  "key's taints whatever their value)")
TOLERATION_EQUAL_NEEDS_KEY = ("operator Equal needs a key (only operator Exists may leave key "
                              "empty, to tolerate every taint)")
TOLERATION_SECONDS_NO_EXECUTE = "tolerationSeconds applies only to effect NoExecute"


class Toleration(ApiModel):
    """A Kubernetes pod toleration, as in a pod spec."""

    RULES = (
        Rule("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             lambda t: t.operator != "Exists" or not t.value, TOLERATION_EXISTS_HAS_NO_VALUE,
             "value"),
        Rule("self.operator != 'Equal' || (has(self.key) && self.key != '')",
             lambda t: t.operator != "Equal" or bool(t.key), TOLERATION_EQUAL_NEEDS_KEY, "key"),
        Rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
             TOLERATION_SECONDS_NO_EXECUTE, "tolerationSeconds"),
    )
    model_config = {"json_schema_extra": rules_schema(RULES)}

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(
        None, ge=0, description="effect NoExecute only: how long the pod stays bound to a "
        "node after the taint appears.")


class NodePool(ApiModel):
    """Which nodes a group's pods may run on."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_ITEMS)


class Resources(ApiModel):
    """CPU and memory per pod, besides GPUs (requests = limits, so pods are Guaranteed)."""

    cpu: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)
