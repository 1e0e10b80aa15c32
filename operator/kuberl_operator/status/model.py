"""The inputs and outputs of `decide`: what was observed, the knobs, the actions, the Events
and the Decision itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from kuberl_api import RLJob, RuleFailure

# Stamped on every RayJob we create: the restart count that attempt was created with.
ANNOTATION_RESTARTS = "kuberl.dev/restarts"

# Status keys the operator owns; everything else (progress, trainerRefusal) belongs to the
# trainer, which the operator only reads.
OWNED_KEYS = ("phase", "conditions", "observedGeneration", "restarts", "rayJobName",
              "startTime", "completionTime", "specDigests")

RAY_TERMINAL_JOB_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw. `rayjobs` holds every RayJob labelled for this RLJob and owned by
    it (deleting ones included); `raycluster` is the RayCluster named by the current RayJob's
    `status.rayClusterName` (None when absent or not named yet)."""

    rayjobs: tuple[Mapping[str, Any], ...] = ()
    raycluster: Mapping[str, Any] | None = None
    # With spec.scheduling.queueName: Kueue's Workload of the current RayJob (None: none yet).
    workload: Mapping[str, Any] | None = None
    # The API server's message when spec.scheduling.priorityClassName names no PriorityClass.
    priority_class_problem: str | None = None
    # The API server's message when spec.code.configMap names no ConfigMap (read only by a
    # pass that may create an attempt, like the PriorityClass).
    code_problem: str | None = None
    # The current attempt's pods, read while its cluster is not ready (see pod_problems).
    pods: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Tunables:
    """Operator-wide knobs (not in the spec)."""

    head_lost_grace: timedelta = timedelta(seconds=120)


@dataclass(frozen=True)
class CreateAttempt:
    """Apply all children (server-side apply), with the RayJob of this attempt."""

    attempt: int
    restarts: int


@dataclass(frozen=True)
class DeleteRayJob:
    name: str


@dataclass(frozen=True)
class DeleteRLJob:
    """ttlSecondsAfterFinished expired: delete the RLJob (its children go by garbage collection)."""


@dataclass(frozen=True)
class DeleteEnvironment:
    """The environment service's Deployment and Service (environment.image, both named
    `name`): nothing calls it once the job has finished or is suspended, and its pods would
    hold their nodes' resources until the RLJob is deleted. A resumed job's attempt applies
    them again."""

    name: str


Action = CreateAttempt | DeleteRayJob | DeleteRLJob | DeleteEnvironment


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: dict[str, Any]
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    job: RLJob | None = None
    # The rules `job` breaks, waived because an earlier release accepted it (status/ratchet.py):
    # a new attempt's config names them, for the trainer to waive too.
    waived: tuple[RuleFailure, ...] = ()
    # When time alone would change the decision next (deadline, TTL, heartbeat, head grace).
    requeue_at: datetime | None = None

    @property
    def phase(self) -> str | None:
        phase = self.status.get("phase")
        return phase if isinstance(phase, str) else None

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == type_)

    def status_patch(self, old_status: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A JSON merge patch of the owned keys that changed (None values remove a key), or None
        when nothing changed (so the patch doesn't wake the watch for nothing)."""
        old = old_status or {}
        patch = {k: self.status.get(k) for k in OWNED_KEYS if self.status.get(k) != old.get(k)}
        return patch or None
