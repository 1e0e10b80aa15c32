"""The whole RLJob object (apiVersion, kind, metadata, spec, status) and its top-level rules."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kuberl_api.base import ApiModel, FieldError, cel
from kuberl_api.spec import KUEUE_QUEUE_LABEL, RLJobSpec
from kuberl_api.status import RLJobStatus

GROUP = "kuberl.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

# Children are named "<rljob>-<suffix>"; KubeRay refuses RayJob names over 47 characters and
# derives more names from them, so RLJob names stay short (see kuberl_operator.render.names).
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Once the trainer started, these sections are baked into the running Ray job; changing them
# would silently not apply, so they are refused. The rest (suspend, deadlines, TTL,
# backoffLimit, heartbeatTimeoutSeconds) are read by the operator and may change any time.
IMMUTABLE_SECTIONS = ("model", "data", "reward", "algorithm", "training", "rollout",
                      "environment", "critic", "placement", "mode", "schedule", "checkpoint",
                      "network", "scheduling", "code")
# Phases in which nothing has run yet, so the spec may still change freely.
EDITABLE_PHASES = ("Pending",)


def immutability_rules() -> list[dict[str, str]]:
    not_started = ("!has(oldSelf.status) || !has(oldSelf.status.phase) || "
                   + " || ".join(f"oldSelf.status.phase == '{p}'" for p in EDITABLE_PHASES))
    return [
        cel(f"{not_started} || self.spec.{s} == oldSelf.spec.{s}",
            f"spec.{s} is immutable once the job has started; delete and recreate the RLJob",
            f".spec.{s}")
        for s in IMMUTABLE_SECTIONS
    ]


def root_rules() -> list[dict[str, str]]:
    # No fieldPath: the API server accepts one only into properties the schema declares, and
    # metadata's are not declared (it is the server's ObjectMeta). The messages name the field.
    name_rule = cel(f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                    f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
                    "(child object names are derived from it)")
    dns_rule = cel(f"self.metadata.name.matches('{NAME_PATTERN}')",
                   "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', "
                   "starting with a letter")
    return [name_rule, dns_rule, *immutability_rules()]


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta we read; server-set fields pass through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = Field(None, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _no_queue_label(cls, labels: dict[str, str]) -> dict[str, str]:
        # The RLJob's labels are copied onto its children; this one would queue the RayJob
        # without the suspend that makes Kueue admit it as one gang.
        if KUEUE_QUEUE_LABEL in labels:
            raise FieldError(f"labels.{KUEUE_QUEUE_LABEL}", labels[KUEUE_QUEUE_LABEL],
                             "kuberl sets this label on the RayJob from "
                             "spec.scheduling.queueName: set that field instead")
        return labels


class RLJob(ApiModel):
    """An LLM reinforcement-learning post-training job (GRPO, PPO, ...) run on KubeRay."""

    api_version: Literal["kuberl.dev/v1alpha1"] = Field("kuberl.dev/v1alpha1", alias="apiVersion")
    kind: Literal["RLJob"] = "RLJob"
    metadata: ObjectMeta
    spec: RLJobSpec
    status: RLJobStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"
