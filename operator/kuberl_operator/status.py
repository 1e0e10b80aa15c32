"""What an RLJob's status should be, and what to do about it: a pure function of what is observed.

`decide(body, observed, now)` takes the RLJob as the API server returned it (a raw dict: an
invalid spec must still get a status), the RayJobs it owns, the RayCluster of the current
attempt and the time, and returns a `Decision`: the operator-owned status fields, the actions
(create attempt N, delete a RayJob, delete the RLJob for its TTL) and the Events to post.
The reconciler executes the actions, posts the Events and writes the status in one patch.

Everything is level-triggered: the decision depends only on the RLJob (spec + its own status)
and the observed children, so an operator restarted at any point recomputes the same thing.
Timers live on the objects too: a condition's `lastTransitionTime`, KubeRay's own condition
times, `status.startTime`/`completionTime` and the trainer's `progress.lastHeartbeatTime`.

Attempts: attempt N runs as RayJob `names.rayjob(job, N)`. A restart (stall, lost head, failed
RayJob) creates N+1, deletes N and counts against `backoffLimit`; a resume after `suspend`
creates N+1 and does not count (suspending is the user's choice, not a failure; this matches
Kubernetes Jobs, where suspension never consumes the backoff). The restart count is also
stamped on each RayJob (annotation `kuberl.dev/restarts`), so a crash between creating the new
attempt and patching the status loses nothing. New attempts are created *before* the old one is
deleted: a crash in between leaves two RayJobs, and the next pass deletes the older one; the
reverse order could leave none and no record of why.

Rejected alternative: reading and writing a separate attempt counter in the status. The status
schema is generated from kuberl_api (the operator may not add fields), and the attempt is
already recorded twice: in `status.rayJobName` and in the RayJob's `kuberl.dev/attempt` label.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from kuberl_api import InvalidRLJob, RLJob, parse
from kuberl_api.rljob import EDITABLE_PHASES, IMMUTABLE_SECTIONS
from kuberl_api.spec import RLJobSpec
from kuberl_api.status import CONDITION_TYPES, TERMINAL_PHASES
from kuberl_operator.render import names

# Stamped on every RayJob we create: the restart count that attempt was created with.
ANNOTATION_RESTARTS = "kuberl.dev/restarts"

# Status keys the operator owns; everything else (progress) belongs to the trainer.
OWNED_KEYS = ("phase", "conditions", "observedGeneration", "restarts", "rayJobName",
              "startTime", "completionTime", "specDigests")

RAY_TERMINAL_JOB_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})

# Reasons of ClusterReady=False that mean "it was up and went away" (a stall episode).
_UNHEALTHY = ("HeadPodNotReady", "ClusterNotFound")


# ------------------------------------------------------------------------------ inputs/outputs

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
    # The current attempt's pods, read while its cluster is not ready (see pod_problems).
    pods: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Tunables:
    """Operator-wide knobs (not in the spec)."""

    head_lost_grace: timedelta = timedelta(seconds=120)


@dataclass(frozen=True)
class CreateAttempt:
    """Create-or-patch all children, with the RayJob of this attempt."""

    attempt: int
    restarts: int


@dataclass(frozen=True)
class DeleteRayJob:
    name: str


@dataclass(frozen=True)
class DeleteRLJob:
    """ttlSecondsAfterFinished expired: delete the RLJob (its children go by garbage collection)."""


Action = CreateAttempt | DeleteRayJob | DeleteRLJob


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


# ------------------------------------------------------------------------------ small helpers

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


def _dig(obj: Mapping[str, Any] | None, *path: str) -> Any:
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
    out = {}
    for section in IMMUTABLE_SECTIONS:
        alias = RLJobSpec.model_fields[section].alias or section
        text = json.dumps(dumped.get(alias), sort_keys=True, separators=(",", ":"))
        out[section] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def attempt_of(job_name: str, rayjob: Mapping[str, Any] | str | None) -> int | None:
    """The attempt number of a RayJob (by its `kuberl.dev/attempt` label or its name)."""
    if rayjob is None:
        return None
    name = rayjob if isinstance(rayjob, str) else _dig(rayjob, "metadata", "name")
    if not isinstance(rayjob, str):
        label = _dig(rayjob, "metadata", "labels", names.LABEL_ATTEMPT)
        if isinstance(label, str) and label.isdigit():
            return int(label)
    prefix = f"{job_name}-r"
    if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):].isdigit():
        n = int(name[len(prefix):])
        if n < names.MAX_ATTEMPTS and names.rayjob(job_name, n) == name:
            return n
    return None


def _is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool(_dig(obj, "metadata", "deletionTimestamp"))


def _cond(conds: list[Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conds or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


# ------------------------------------------------------------------------------ the builder

class _Builder:
    """Accumulates the new status, actions and events from the old status."""

    def __init__(self, body: Mapping[str, Any], now: datetime) -> None:
        self.now = now
        self.name: str = str(_dig(body, "metadata", "name"))
        self.generation = _dig(body, "metadata", "generation")
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

    def finish(self, job: RLJob | None) -> Decision:
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
                        job=job, requeue_at=min(future) if future else None)


# ------------------------------------------------------------------------------ the decision

def decide(body: Mapping[str, Any], observed: Observed, now: datetime,
           tunables: Tunables | None = None) -> Decision:
    """The new status, actions and events for one RLJob (see the module docstring)."""
    tun = tunables or Tunables()
    b = _Builder(body, now)
    try:
        job = parse({k: v for k, v in body.items() if k != "status"})
    except InvalidRLJob as exc:
        return _invalid(b, exc)

    accepted_digests = dict(b.digests)
    refused = _check_immutable(b, job)
    edited = bool(accepted_digests) and accepted_digests != b.digests
    attempts = _attempts(b.name, observed, b.ray_job_name)
    current_attempt = max(attempts) if attempts else None
    current = attempts.get(current_attempt) if current_attempt is not None else None
    live_current = current if current is not None and not _is_deleting(current) else None
    if live_current is not None:
        b.ray_job_name = _dig(live_current, "metadata", "name")
        stamped = _dig(live_current, "metadata", "annotations", ANNOTATION_RESTARTS)
        if isinstance(stamped, str) and stamped.isdigit():
            b.restarts = max(b.restarts, int(stamped))
    # Older attempts left behind (a crash between "create N+1" and "delete N") go now.
    for attempt, rj in sorted(attempts.items()):
        if attempt != current_attempt and not _is_deleting(rj):
            b.actions.append(DeleteRayJob(str(_dig(rj, "metadata", "name"))))

    if b.old_phase in TERMINAL_PHASES:
        _terminal(b, job, live_current)
    elif job.spec.suspend:
        _suspend(b, live_current)
    elif b.old_phase != "Suspended" and _deadline_exceeded(b, job):
        _fail(b, "DeadlineExceeded",
              f"activeDeadlineSeconds ({job.spec.active_deadline_seconds}s since "
              f"{b.start_time}) exceeded", live_current, delete=True)
    elif live_current is None:
        if _never_ran(b) or b.old_phase == "Suspended" or _queued_never_admitted(b):
            _start(b, job, current_attempt, refused, observed)
        else:
            _restart_or_fail(b, job, current_attempt or 0, None, "RayJobLost",
                             f"RayJob {b.ray_job_name} disappeared", refused, stalled=True)
    elif _dig(live_current, "spec", "suspend") is True and not _finished(live_current):
        _queued(b, job, current_attempt or 0, live_current, observed.workload, edited)
    else:
        _track(b, job, current_attempt or 0, live_current, observed, tun, refused)
    if b.phase in TERMINAL_PHASES and b.old_phase not in TERMINAL_PHASES:
        # The pass that finishes the job schedules its TTL: nothing else is due to wake the
        # operator for it (the watch event of its own status patch may never come, and the
        # next resync can be long after the expiry).
        expiry = _ttl_expiry(b, job)
        if expiry is not None:
            b.wake(expiry)
    return b.finish(job)


def _invalid(b: _Builder, exc: InvalidRLJob) -> Decision:
    """The CRD let through something kuberl_api rejects: say so, create nothing, touch nothing."""
    message = "; ".join(exc.problems)
    old = b.old_condition("Accepted")
    if old is None or old.get("status") != "False" or old.get("message") != message:
        b.events.append(Event("Warning", "InvalidSpec", message))
    b.set("Accepted", False, "InvalidSpec", message)
    if b.phase is None:
        b.phase = "Pending"
    return b.finish(None)


def _check_immutable(b: _Builder, job: RLJob) -> list[str]:
    """Accepted, or refused for changed immutable sections (returned; the job runs on as it was
    accepted). Digests are (re)recorded while the phase is still editable."""
    digests = section_digests(job.spec)
    frozen = b.old_phase is not None and b.old_phase not in EDITABLE_PHASES
    changed = [s for s in IMMUTABLE_SECTIONS
               if frozen and s in b.digests and b.digests[s] != digests[s]]
    if not changed:
        b.digests = digests
        b.set("Accepted", True, "Accepted", "the spec is valid")
        return []
    fields = ", ".join(f"spec.{s}" for s in changed)
    message = (f"{fields} changed after the job started and cannot be applied to a running "
               "job; the job continues with the accepted spec. Revert the change, or delete "
               "and recreate the RLJob")
    old = b.old_condition("Accepted")
    if old is None or old.get("reason") != "ImmutableFieldChanged" or old.get("message") != message:
        b.events.append(Event("Warning", "ImmutableFieldChanged", message))
    b.set("Accepted", False, "ImmutableFieldChanged", message)
    return changed


def _attempts(job_name: str, observed: Observed, status_name: str | None) -> dict[int, Any]:
    """attempt -> RayJob body, plus the status' attempt (value None) when that RayJob is gone."""
    out: dict[int, Any] = {}
    for rj in observed.rayjobs:
        n = attempt_of(job_name, rj)
        if n is not None:
            out[n] = rj
    recorded = attempt_of(job_name, status_name)
    if recorded is not None and recorded not in out:
        out[recorded] = None
    return out


def _never_ran(b: _Builder) -> bool:
    return b.old_phase in (None, "Pending") and b.ray_job_name is None


def _queued_never_admitted(b: _Builder) -> bool:
    """A first attempt that waited in a Kueue queue and never ran (its RayJob is gone: deleted
    while queued, or replaced after an edit): starting again costs no restart."""
    queued = b.old_condition("Queued")
    return (b.old_phase == "Pending" and queued is not None
            and queued.get("status") == "True")


def _finished(rayjob: Mapping[str, Any]) -> bool:
    return bool(_dig(rayjob, "status", "jobStatus") == "SUCCEEDED")


def _deadline_exceeded(b: _Builder, job: RLJob) -> bool:
    limit = job.spec.active_deadline_seconds
    started = parse_time(b.start_time)
    if limit is None or started is None:
        return False
    expiry = started + timedelta(seconds=limit)
    b.wake(expiry)
    return b.now >= expiry


# ---- phases

def _start(b: _Builder, job: RLJob, last_attempt: int | None, refused: list[str],
           observed: Observed) -> None:
    resuming = b.old_phase == "Suspended"
    if refused:  # only reachable when resuming: never run a spec that was refused
        b.set("Suspended", True, "ResumeBlocked",
              "resume is held until the refused spec change is reverted")
        b.phase = "Suspended"
        return
    if observed.priority_class_problem:  # the pods would be refused: create nothing yet
        message = (f"spec.scheduling.priorityClassName: {observed.priority_class_problem}; "
                   "nothing is created until it exists")
        old = b.old_condition("Accepted")
        if old is None or old.get("message") != message:
            b.events.append(Event("Warning", "PriorityClassNotFound", message))
        b.set("Accepted", False, "PriorityClassNotFound", message)
        b.phase = b.phase or "Pending"
        return
    attempt = 0 if last_attempt is None else last_attempt + 1
    if attempt >= names.MAX_ATTEMPTS:
        _fail(b, "AttemptsExhausted", f"{names.MAX_ATTEMPTS} RayJob attempts used", None)
        return
    name = names.rayjob(job.name, attempt)
    b.actions.append(CreateAttempt(attempt, b.restarts))
    b.ray_job_name = name
    queue = job.spec.scheduling.queue_name
    # activeDeadlineSeconds counts from the (re)start; with a queue, from the admission.
    b.start_time = None if queue else fmt_time(b.now)
    _submitted(b, job, name)
    b.set("Preempted", False, "NotPreempted")
    b.set("ClusterReady", False, "Provisioning", f"RayJob {name} created")
    b.set("Training", False, "Provisioning", "waiting for the Ray cluster")
    b.set("Stalled", False, "Progressing")
    b.set("Succeeded", False, "Running")
    b.set("Failed", False, "Running")
    phase = "Pending" if queue else "Provisioning"
    if resuming:
        b.set("Suspended", False, "Resumed", f"resumed from the last checkpoint as {name}")
        b.to_phase(phase, Event("Normal", "Resumed",
                                f"resumed from the last checkpoint as RayJob {name}"))
    else:
        b.set("Suspended", False, "NotSuspended")
        where = f" in LocalQueue {queue}" if queue else ""
        b.to_phase(phase, Event("Normal", "Created", f"created RayJob {name}{where}"))


def _submitted(b: _Builder, job: RLJob, name: str) -> None:
    """Queued as a new RayJob is created: True with a queue (Kueue admits it), else False."""
    queue = job.spec.scheduling.queue_name
    if queue:
        b.set("Queued", True, "Submitted", f"RayJob {name} created suspended in LocalQueue "
              f"{queue}; waiting for Kueue to admit it")
    else:
        b.set("Queued", False, "NoQueue", "spec.scheduling.queueName is not set")


def _suspend(b: _Builder, current: Mapping[str, Any] | None) -> None:
    if current is not None:
        b.actions.append(DeleteRayJob(str(_dig(current, "metadata", "name"))))
    b.set("Suspended", True, "Suspended",
          "spec.suspend is true: the RayJob is deleted; set it to false to resume from the "
          "last checkpoint")
    b.set("ClusterReady", False, "Suspended")
    b.set("Training", False, "Suspended")
    b.set("Stalled", False, "Suspended")
    b.keep("Succeeded", "Suspended")
    b.keep("Failed", "Suspended")
    b.to_phase("Suspended", Event("Normal", "Suspended",
                                  "suspended: the RayJob is deleted until spec.suspend is false"))


def _terminal(b: _Builder, job: RLJob, current: Mapping[str, Any] | None) -> None:
    """Succeeded and Failed are final. Free a cluster that still runs after a failure the
    operator declared, and honour ttlSecondsAfterFinished."""
    if (b.old_phase == "Failed" and current is not None
            and _dig(current, "status", "jobStatus") not in RAY_TERMINAL_JOB_STATUSES):
        b.actions.append(DeleteRayJob(str(_dig(current, "metadata", "name"))))
    expiry = _ttl_expiry(b, job)
    if expiry is not None:
        if b.now >= expiry:
            b.actions.append(DeleteRLJob())
            b.events.append(Event("Normal", "TTLExpired", f"deleting the RLJob "
                                  f"{job.spec.ttl_seconds_after_finished}s after it finished"))
        else:
            b.wake(expiry)


def _ttl_expiry(b: _Builder, job: RLJob) -> datetime | None:
    """When ttlSecondsAfterFinished deletes the finished job (None: no TTL, or not finished)."""
    ttl = job.spec.ttl_seconds_after_finished
    done = parse_time(b.completion_time)
    if ttl is None or done is None:
        return None
    # completionTime holds whole seconds (as Kubernetes writes times): the job finished
    # somewhere in that second, so count from its end. Never early (a TTL of 1 s could
    # otherwise fire 5 ms after the finish), at most 1 s late.
    return done + timedelta(seconds=ttl + 1)


def _succeed(b: _Builder, message: str) -> None:
    b.completion_time = fmt_time(b.now)
    b.set("Succeeded", True, "Succeeded", message)
    b.set("Failed", False, "Succeeded")
    b.set("Training", False, "Completed", message)
    b.set("ClusterReady", False, "JobFinished")
    b.set("Stalled", False, "Completed")
    b.to_phase("Succeeded", Event("Normal", "Succeeded", message))


def _fail(b: _Builder, reason: str, message: str, current: Mapping[str, Any] | None,
          delete: bool = False) -> None:
    running = _dig(current, "status", "jobStatus") not in RAY_TERMINAL_JOB_STATUSES
    if delete and current is not None and running:  # a finished RayJob stays for inspection
        b.actions.append(DeleteRayJob(str(_dig(current, "metadata", "name"))))
    b.completion_time = fmt_time(b.now)
    b.set("Failed", True, reason, message)
    b.set("Succeeded", False, reason)
    b.set("Training", False, reason, message)
    b.set("ClusterReady", False, "JobFinished")
    b.keep("Stalled", "Failed")
    b.to_phase("Failed", Event("Warning", reason, message))


def _restart_or_fail(b: _Builder, job: RLJob, attempt: int, current: Mapping[str, Any] | None,
                     reason: str, message: str, refused: list[str], stalled: bool) -> None:
    """Replace attempt N by N+1 from the last checkpoint while backoffLimit allows, else Failed
    (the RayJob is deleted so a hung cluster frees its GPUs)."""
    limit = job.spec.backoff_limit
    stall_reason = reason if stalled else "Progressing"
    b.set("Stalled", stalled, stall_reason, message if stalled else "")
    if b.restarts >= limit:
        _fail(b, "BackoffLimitExceeded",
              f"{message}; backoffLimit ({limit}) reached after {b.restarts} restarts",
              current, delete=True)
        return
    if attempt + 1 >= names.MAX_ATTEMPTS:
        _fail(b, "AttemptsExhausted", f"{message}; {names.MAX_ATTEMPTS} RayJob attempts used",
              current, delete=True)
        return
    if refused:
        held = f"{message}; the restart is held until the refused spec change is reverted"
        old = b.old_condition("Stalled")
        if old is None or old.get("reason") != "RestartBlocked":
            b.events.append(Event("Warning", "RestartBlocked", held))
        b.set("Stalled", True, "RestartBlocked", held)
        return
    new = names.rayjob(job.name, attempt + 1)
    b.restarts += 1
    b.actions.append(CreateAttempt(attempt + 1, b.restarts))
    if current is not None:
        b.actions.append(DeleteRayJob(str(_dig(current, "metadata", "name"))))
    checkpoint = _dig(b.old, "progress", "lastCheckpoint", "step")
    origin = (f"checkpoint step {checkpoint}" if checkpoint is not None
              else "the start (no checkpoint reported yet)")
    b.ray_job_name = new
    _submitted(b, job, new)
    b.set("ClusterReady", False, "Restarting", f"RayJob {new} created")
    b.set("Training", False, "Restarting", message)
    b.phase = "Restarting"
    b.events.append(Event("Warning", "Restarting",
                          f"{message}; restarting from {origin} as RayJob {new} "
                          f"(restart {b.restarts} of {limit})"))


# ---- waiting in a Kueue queue

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # metav1.Condition's


def _queued(b: _Builder, job: RLJob, attempt: int, rayjob: Mapping[str, Any],
            workload: Mapping[str, Any] | None, edited: bool) -> None:
    """The current RayJob is suspended: Kueue has not admitted it yet, or has evicted it
    (preemption). Nothing runs, so there is no head or heartbeat to check; the operator waits
    and never touches `suspend` (Kueue owns it)."""
    rname = str(_dig(rayjob, "metadata", "name"))
    conds = _dig(workload, "status", "conditions")
    evicted = _cond(conds, "Evicted")
    old_queued = b.old_condition("Queued")
    was_admitted = b.old.get("rayJobName") == rname and (
        b.old_phase == "Preempted"
        or (old_queued is not None and old_queued.get("reason") == "Admitted"))
    was_admitted = was_admitted or (evicted is not None and evicted.get("status") == "True")
    if edited and not was_admitted and b.old_phase == "Pending":
        _requeue_edited(b, job, attempt, rname)
        return
    reason, message = _queue_state(workload, job.spec.scheduling.queue_name or "", rname)
    b.set("Queued", True, reason, message)
    b.set("ClusterReady", False, "Queued", f"RayJob {rname} is suspended until Kueue admits it")
    b.set("Training", False, "Queued", message)
    b.set("Stalled", False, "Queued")
    b.keep("Suspended", "NotSuspended")
    b.keep("Succeeded", "Running")
    b.keep("Failed", "Running")
    if not was_admitted:
        b.keep("Preempted", "NotPreempted")
        b.phase = "Restarting" if b.old_phase == "Restarting" else "Pending"
        return
    preempted = _cond(conds, "Preempted")
    cause = next((c for c in (preempted, evicted) if c is not None and c.get("status") == "True"),
                 None)
    why = str((cause or {}).get("message") or f"Kueue suspended RayJob {rname}")
    checkpoint = _dig(b.old, "progress", "lastCheckpoint", "step")
    resume = (f"the trainer resumes from its newest checkpoint (step {checkpoint} or later)"
              if checkpoint is not None else
              "the trainer resumes from the checkpoint it saves as it stops, if any")
    b.set("Preempted", True, _reason((cause or {}).get("reason"), "Evicted"),
          f"{why}; {resume} once Kueue admits RayJob {rname} again")
    b.to_phase("Preempted", Event("Warning", "Preempted", f"Kueue evicted RayJob {rname}: "
                                  f"{why}; {resume} when admitted again (no restart counted)"))


def _requeue_edited(b: _Builder, job: RLJob, attempt: int, rname: str) -> None:
    """The spec changed while the job waited for its first admission: the queued RayJob was
    rendered from the old one, so it is replaced (at the back of the queue)."""
    if attempt + 1 >= names.MAX_ATTEMPTS:
        _fail(b, "AttemptsExhausted", f"{names.MAX_ATTEMPTS} RayJob attempts used", None)
        return
    new = names.rayjob(job.name, attempt + 1)
    b.actions.append(CreateAttempt(attempt + 1, b.restarts))
    b.actions.append(DeleteRayJob(rname))
    b.ray_job_name = new
    _submitted(b, job, new)
    b.phase = "Pending"
    b.events.append(Event("Normal", "Requeued", f"the spec changed while queued: RayJob {new} "
                          f"replaces {rname} in LocalQueue {job.spec.scheduling.queue_name}"))


def _queue_state(workload: Mapping[str, Any] | None, queue: str, rname: str) -> tuple[str, str]:
    """(reason, message) of Queued=True: Kueue's own words from the Workload when it has any."""
    if workload is None:
        return ("WaitingForWorkload", f"RayJob {rname} is suspended in LocalQueue {queue}; Kueue "
                "has made no Workload for it yet (is Kueue running, with the ray.io/rayjob "
                "integration enabled?)")
    wname = _dig(workload, "metadata", "name")
    reserved = _cond(_dig(workload, "status", "conditions"), "QuotaReserved")
    if reserved is not None and reserved.get("status") == "True":
        return "QuotaReserved", (f"Workload {wname} holds quota; waiting for its admission "
                                 "checks")
    if reserved is not None and reserved.get("message"):
        return _reason(reserved.get("reason"), "Pending"), f"{reserved['message']} ({wname})"
    return "Pending", f"Workload {wname} is waiting in LocalQueue {queue}"


def _reason(value: object, default: str) -> str:
    return value if isinstance(value, str) and _REASON.match(value) else default


def _admitted(b: _Builder, job: RLJob, rname: str) -> None:
    """The current RayJob runs (not suspended): with a queue, Kueue admitted it."""
    if not job.spec.scheduling.queue_name:
        b.set("Queued", False, "NoQueue", "spec.scheduling.queueName is not set")
        b.keep("Preempted", "NotPreempted")
        return
    old = b.old_condition("Queued")
    if (old is not None and old.get("reason") == "Admitted"
            and b.old.get("rayJobName") == rname):
        b.keep("Queued", "Admitted")
        b.keep("Preempted", "NotPreempted")
        return
    b.set("Queued", False, "Admitted", f"Kueue admitted RayJob {rname}")
    if b.old_phase == "Preempted":
        b.start_time = fmt_time(b.now)  # like a Job's activeDeadlineSeconds after a suspension
        b.set("Preempted", False, "Readmitted", f"Kueue admitted RayJob {rname} again")
        b.events.append(Event("Normal", "Readmitted", f"Kueue admitted RayJob {rname} again; "
                              "the trainer resumes from its newest checkpoint"))
    else:
        b.keep("Preempted", "NotPreempted")
        b.events.append(Event("Normal", "Admitted", f"Kueue admitted RayJob {rname}"))


# ---- a running attempt

def _track(b: _Builder, job: RLJob, attempt: int, rayjob: Mapping[str, Any],
           observed: Observed, tun: Tunables, refused: list[str]) -> None:
    rstatus = _dig(rayjob, "status") or {}
    js = rstatus.get("jobStatus") or ""
    ds = rstatus.get("jobDeploymentStatus") or ""
    rname = str(_dig(rayjob, "metadata", "name"))
    detail = "; ".join(str(x) for x in (rstatus.get("reason"), rstatus.get("message")) if x)
    _admitted(b, job, rname)
    b.start_time = b.start_time or fmt_time(b.now)  # a crash may have lost the first patch
    suspended = b.old_condition("Suspended")
    if suspended is None or suspended.get("status") != "False":  # else keep "Resumed"
        b.set("Suspended", False, "NotSuspended")
    b.keep("Succeeded", "Running")
    b.keep("Failed", "Running")

    if js == "SUCCEEDED":
        _succeed(b, f"RayJob {rname} succeeded")
        return
    if ds == "ValidationFailed":  # a retry would fail the same way
        _fail(b, "RayJobValidationFailed", f"KubeRay refused RayJob {rname}: {detail}", rayjob)
        return
    if js == "STOPPED":  # someone ran `ray job stop`: a decision, not a crash
        _fail(b, "RayJobStopped", f"the Ray job of {rname} was stopped", rayjob)
        return
    if js == "FAILED" or ds == "Failed":
        _restart_or_fail(b, job, attempt, rayjob, "RayJobFailed",
                         f"RayJob {rname} failed" + (f": {detail}" if detail else ""),
                         refused, stalled=False)
        return

    health = _cluster_health(b, rayjob, observed.raycluster, rname)
    _pod_causes(b, observed.pods)
    if js != "RUNNING":
        b.set("Training", False, "Provisioning", f"Ray job status {js or 'not reported'} "
              f"(deployment {ds or 'not reported'})")
        if b.old_phase in ("Restarting", "Provisioning") and b.restarts:
            # A restarted attempt: Restarting until KubeRay takes the new RayJob up, then
            # Provisioning like a first one. Stalled stays as the restart set it (the reason
            # it restarted) until the attempt runs.
            b.keep("Stalled", "Progressing")
            b.phase = "Provisioning" if ds else "Restarting"
        else:
            b.set("Stalled", False, "Progressing")
            b.to_phase("Provisioning")
        return

    if health is not None:
        since, why = health
        expiry = since + tun.head_lost_grace
        if b.now >= expiry:
            _restart_or_fail(b, job, attempt, rayjob, "HeadLost",
                             f"{why} for over {int(tun.head_lost_grace.total_seconds())}s "
                             f"while RayJob {rname} reports RUNNING", refused, stalled=True)
            return
        b.wake(expiry)

    stale = _heartbeat_stale(b, job, rayjob, rname)
    if stale is not None:
        _restart_or_fail(b, job, attempt, rayjob, "HeartbeatTimeout", stale, refused,
                         stalled=True)
        return
    step = _dig(b.old, "progress", "step")
    b.set("Training", True, "Running",
          f"training on RayJob {rname}" + (f" at step {step}" if step is not None else ""))
    b.set("Stalled", False, "Progressing")
    b.to_phase("Running", Event("Normal", "Running", f"training started on RayJob {rname}"))


def _cluster_health(b: _Builder, rayjob: Mapping[str, Any], cluster: Mapping[str, Any] | None,
                    rname: str) -> tuple[datetime, str] | None:
    """Set ClusterReady; return (since, why) when a cluster that was up has lost its head."""
    cluster_name = _dig(rayjob, "status", "rayClusterName")
    rstatus = _dig(rayjob, "status") or {}
    old = b.old_condition("ClusterReady")
    same_attempt = b.old.get("rayJobName") == rname

    def episode(reason: str) -> datetime:
        if (same_attempt and old is not None and old.get("reason") == reason
                and old.get("status") == "False"):
            return parse_time(old.get("lastTransitionTime")) or b.now
        return b.now

    if cluster_name and cluster is None and rstatus.get("jobStatus") == "RUNNING":
        since = episode("ClusterNotFound")
        why = f"RayCluster {cluster_name} is gone"
        b.set("ClusterReady", False, "ClusterNotFound", why, since=since)
        return since, why
    cstatus = _dig(cluster, "status") if cluster is not None else rstatus.get("rayClusterStatus")
    cstatus = cstatus if isinstance(cstatus, Mapping) else {}
    conds = cstatus.get("conditions")
    head = _cond(conds, "HeadPodReady")
    ready = int(cstatus.get("readyWorkerReplicas") or 0)
    desired = int(cstatus.get("desiredWorkerReplicas") or 0)
    workers = f"{ready}/{desired} workers ready"
    if head is not None and head.get("status") == "True":
        # Not RayClusterProvisioned: KubeRay sets it once and never clears it after a loss.
        if ready >= desired:
            b.set("ClusterReady", True, "ClusterReady", f"head ready, {workers}")
        else:
            b.set("ClusterReady", False, "WorkersNotReady", f"head ready, {workers}")
        return None
    if head is not None:  # HeadPodReady False/Unknown: KubeRay says since when
        why = f"head pod not ready ({head.get('reason') or 'unknown'})"
        since = parse_time(head.get("lastTransitionTime")) or episode("HeadPodNotReady")
        b.set("ClusterReady", False, "HeadPodNotReady", why, since=since)
        return (since, why) if rstatus.get("jobStatus") == "RUNNING" else None
    if not conds and rstatus.get("jobDeploymentStatus") == "Running":
        # KubeRay without RayClusterStatusConditions: the deployment status is all we have.
        b.set("ClusterReady", True, "ClusterReady", f"RayJob {rname} deployment is Running")
        return None
    b.set("ClusterReady", False, "Provisioning",
          f"RayJob {rname}: deployment {rstatus.get('jobDeploymentStatus') or 'pending'}"
          + (f", {workers}" if desired else ""))
    return None


# Why a pod does not come up, as the kubelet or scheduler says it: (reason, condition reason).
_WAITING_REASONS = {
    "ErrImagePull": "ImagePullFailed", "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed", "CreateContainerConfigError": "PodConfigError",
    "CreateContainerError": "PodConfigError", "CrashLoopBackOff": "ContainerFailed",
    "RunContainerError": "ContainerFailed",
}
MAX_POD_CAUSES = 3


def pod_problems(pods: tuple[Mapping[str, Any], ...]) -> list[tuple[str, str]]:
    """(condition reason, "pod NAME: what is wrong") for pods that cannot come up: unschedulable
    (a missing PVC, no node that fits), an image that cannot be pulled, a container config the
    kubelet refuses (a missing Secret or ConfigMap), a container that keeps crashing. KubeRay
    reports only "head pod not ready"; the cause is on the pods."""
    out = []
    for pod in pods:
        name = _dig(pod, "metadata", "name")
        scheduled = _cond(_dig(pod, "status", "conditions"), "PodScheduled")
        if scheduled is not None and scheduled.get("status") == "False" and \
                scheduled.get("reason") == "Unschedulable":
            out.append(("PodUnschedulable", f"pod {name}: unschedulable: "
                        f"{scheduled.get('message') or 'no reason given'}"))
            continue
        for cs in _dig(pod, "status", "containerStatuses") or []:
            waiting = _dig(cs, "state", "waiting") or {}
            reason = waiting.get("reason")
            if reason in _WAITING_REASONS:
                out.append((_WAITING_REASONS[reason], f"pod {name}: {reason}: "
                            f"{waiting.get('message') or cs.get('image') or ''}".rstrip(": ")))
                break
    return out


def _pod_causes(b: _Builder, pods: tuple[Mapping[str, Any], ...]) -> None:
    """Put the pods' own reasons into ClusterReady while the cluster is not ready, with one
    Warning Event each time they change."""
    ready = b.conditions.get("ClusterReady", {})
    if ready.get("status") != "False":
        return
    problems = pod_problems(pods)
    if not problems:
        return
    shown = "; ".join(m for _, m in problems[:MAX_POD_CAUSES])
    more = len(problems) - MAX_POD_CAUSES
    message = shown + (f" (and {more} more)" if more > 0 else "")
    old = b.old_condition("ClusterReady")
    if old is None or old.get("message") != message:
        b.events.append(Event("Warning", problems[0][0], message))
    b.set("ClusterReady", False, problems[0][0], message)


def _heartbeat_stale(b: _Builder, job: RLJob, rayjob: Mapping[str, Any], rname: str) -> str | None:
    """The trainer must report within heartbeatTimeoutSeconds of its last report, or of the
    moment this attempt's Ray job started (so a heartbeat from an earlier attempt, or none yet,
    never counts against a fresh one)."""
    timeout = timedelta(seconds=job.spec.heartbeat_timeout_seconds)
    running_since = parse_time(_dig(rayjob, "status", "rayJobInfo", "startTime"))
    if running_since is None:
        old = b.old_condition("Training")
        if old is not None and old.get("status") == "True" and b.old.get("rayJobName") == rname:
            running_since = parse_time(old.get("lastTransitionTime"))
    running_since = running_since or b.now
    beat = parse_time(_dig(b.old, "progress", "lastHeartbeatTime"))
    reference = max(beat, running_since) if beat is not None else running_since
    expiry = reference + timeout
    if b.now < expiry:
        b.wake(expiry)
        return None
    age = int((b.now - reference).total_seconds())
    fresh_beat = beat is not None and beat >= running_since
    what = "since the last heartbeat" if fresh_beat else "no heartbeat since the job started"
    return (f"trainer silent for {age}s ({what}; heartbeatTimeoutSeconds "
            f"{job.spec.heartbeat_timeout_seconds}) on RayJob {rname}")


__all__ = [
    "ANNOTATION_RESTARTS", "OWNED_KEYS", "Action", "CreateAttempt", "Decision", "DeleteRLJob",
    "DeleteRayJob", "Event", "Observed", "Tunables", "attempt_of", "decide", "fmt_time",
    "parse_time", "section_digests",
]
