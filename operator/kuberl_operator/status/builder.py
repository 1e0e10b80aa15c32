"""The status being built from the old one (conditions that keep their transition times,
phase changes that post an Event once), and the small readers of raw objects."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kuberl_api import RLJob, RuleFailure
from kuberl_api.rljob import IMMUTABLE_SECTIONS
from kuberl_api.spec import RLJobSpec
from kuberl_api.status import CONDITION_TYPES
from kuberl_operator.render import names
from kuberl_operator.status.model import Action, Decision, Event


def fmt_time(t: datetime) -> str:
    """metav1.Time: RFC 3339, UTC, whole seconds."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def dig(obj: Mapping[str, Any] | None, *path: str) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(key)
    return cur


def section_digests(spec: RLJobSpec) -> dict[str, str]:
    """A short hash per immutable section, of the values the user set (defaults left out, so an
    operator upgrade that adds a defaulted field does not look like a user's edit)."""
    dumped = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return {section: _digest(dumped.get(RLJobSpec.model_fields[section].alias or section))
            for section in IMMUTABLE_SECTIONS}


def _digest(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# The digest of a section left at its defaults (what a section an earlier release did not have
# yet, and so did not record, held: the CRD of that release pruned any value).
UNSET_DIGEST = _digest(None)


def attempt_of(job_name: str, rayjob: Mapping[str, Any] | str | None) -> int | None:
    """The attempt number of a RayJob (by its `kuberl.dev/attempt` label or its name)."""
    if rayjob is None:
        return None
    name = rayjob if isinstance(rayjob, str) else dig(rayjob, "metadata", "name")
    if not isinstance(rayjob, str):
        label = dig(rayjob, "metadata", "labels", names.LABEL_ATTEMPT)
        if isinstance(label, str) and label.isdigit():
            return int(label)
    prefix = f"{job_name}-r"
    if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):].isdigit():
        n = int(name[len(prefix):])
        if n < names.MAX_ATTEMPTS and names.rayjob(job_name, n) == name:
            return n
    return None


def is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool(dig(obj, "metadata", "deletionTimestamp"))


def cond(conds: list[Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conds or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


class Builder:
    """Accumulates the new status, actions and events from the old status."""

    def __init__(self, body: Mapping[str, Any], now: datetime) -> None:
        self.now = now
        self.name: str = str(dig(body, "metadata", "name"))
        self.generation = dig(body, "metadata", "generation")
        old = body.get("status")
        self.old: Mapping[str, Any] = old if isinstance(old, Mapping) else {}
        self.old_phase: str | None = self.old.get("phase")
        self.old_conditions = {c["type"]: c for c in self.old.get("conditions") or []
                               if isinstance(c, Mapping) and "type" in c}
        self.phase: str | None = self.old_phase
        self.conditions: dict[str, dict[str, Any]] = {}
        restarts = self.old.get("restarts")
        self.restarts: int = restarts if isinstance(restarts, int) else 0
        self.ray_job_name: str | None = self.old.get("rayJobName")
        self.start_time: str | None = self.old.get("startTime")
        self.completion_time: str | None = self.old.get("completionTime")
        digests = self.old.get("specDigests")
        self.digests: dict[str, str] = dict(digests) if isinstance(digests, Mapping) else {}
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.wakeups: list[datetime] = []

    # conditions
    def old_condition(self, type_: str) -> Mapping[str, Any] | None:
        return self.old_conditions.get(type_)

    def set(self, type_: str, status: bool, reason: str, message: str = "",
            since: datetime | None = None) -> None:
        """Set a condition. lastTransitionTime moves only when the status flips (Kubernetes'
        convention), unless `since` says when this episode began."""
        value = "True" if status else "False"
        old = self.old_conditions.get(type_)
        if since is not None:
            ltt = fmt_time(since)
        elif old is not None and old.get("status") == value and old.get("lastTransitionTime"):
            ltt = str(old["lastTransitionTime"])
        else:
            ltt = fmt_time(self.now)
        cond: dict[str, Any] = {"type": type_, "status": value, "reason": reason,
                                "message": message, "lastTransitionTime": ltt}
        if isinstance(self.generation, int):
            cond["observedGeneration"] = self.generation
        self.conditions[type_] = cond

    def keep(self, type_: str, default_reason: str) -> None:
        """Carry a condition over unchanged (or create it False); never undoes a `set`."""
        if type_ in self.conditions:
            return
        old = self.old_conditions.get(type_)
        if old is not None and old.get("status") in ("True", "False", "Unknown"):
            self.conditions[type_] = dict(old)
        else:
            self.set(type_, False, default_reason)

    def to_phase(self, phase: str, event: Event | None = None) -> None:
        """Move to `phase`; the event is posted only on an actual transition."""
        if phase != self.phase and event is not None and phase != self.old_phase:
            self.events.append(event)
        self.phase = phase

    def wake(self, at: datetime) -> None:
        self.wakeups.append(at)

    def finish(self, job: RLJob | None, waived: tuple[RuleFailure, ...] = ()) -> Decision:
        for type_ in CONDITION_TYPES:
            if type_ not in self.conditions:
                self.keep(type_, "NotStarted")
        status: dict[str, Any] = {
            "phase": self.phase or "Pending",
            "conditions": [self.conditions[t] for t in CONDITION_TYPES],
            "observedGeneration": self.generation if isinstance(self.generation, int) else None,
            "restarts": self.restarts,
            "rayJobName": self.ray_job_name,
            "startTime": self.start_time,
            "completionTime": self.completion_time,
            "specDigests": self.digests or None,
        }
        future = [t for t in self.wakeups if t > self.now]
        return Decision(status=status, actions=tuple(self.actions), events=tuple(self.events),
                        job=job, waived=waived, requeue_at=min(future) if future else None)
