"""Where a group of pods runs and what it gets besides GPUs: node pools (node selectors and
tolerations) and CPU and memory resources; shared by the training, rollout and critic
sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kuberl_api.base import ApiModel, cel, cel_rules, check
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

    model_config = {
        "json_schema_extra": cel_rules(
            cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
                TOLERATION_EXISTS_HAS_NO_VALUE, ".value"),
            cel("self.operator != 'Equal' || (has(self.key) && self.key != '')",
                TOLERATION_EQUAL_NEEDS_KEY, ".key"),
            cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                TOLERATION_SECONDS_NO_EXECUTE, ".tolerationSeconds"),
        )
    }

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(
        None, ge=0, description="effect NoExecute only: how long the pod stays bound to a "
        "node after the taint appears.")

    @model_validator(mode="after")
    def _valid_for_kubernetes(self) -> Toleration:
        check(self.operator != "Exists" or not self.value, "value", self.value,
              TOLERATION_EXISTS_HAS_NO_VALUE)
        check(self.operator != "Equal" or bool(self.key), "key", self.key,
              TOLERATION_EQUAL_NEEDS_KEY)
        check(self.toleration_seconds is None or self.effect == "NoExecute",
              "tolerationSeconds", self.toleration_seconds, TOLERATION_SECONDS_NO_EXECUTE)
        return self


class NodePool(ApiModel):
    """Which nodes a group's pods may run on."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_ITEMS)


class Resources(ApiModel):
    """CPU and memory per pod, besides GPUs (requests = limits, so pods are Guaranteed)."""

    cpu: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(None, max_length=64, pattern=QUANTITY_PATTERN)
