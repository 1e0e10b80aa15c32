"""Waiting in a Kueue queue (spec.scheduling.queueName): queued, admitted, preempted,
admitted again; what the RLJob shows comes from the RayJob's `suspend` (Kueue owns it) and
Kueue's Workload, in Kueue's own words."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kuberl_api import RLJob
from kuberl_operator.render import names
from kuberl_operator.status import phases
from kuberl_operator.status.builder import Builder, cond, dig, fmt_time
from kuberl_operator.status.model import CreateAttempt, DeleteRayJob, Event

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # metav1.Condition's


def waiting(b: Builder, job: RLJob, attempt: int, rayjob: Mapping[str, Any],
            workload: Mapping[str, Any] | None, edited: bool) -> None:
    """The current RayJob is suspended: Kueue has not admitted it yet, or has evicted it
    (preemption). Nothing runs, so there is no head or heartbeat to check; the operator waits
    and never touches `suspend` (Kueue owns it)."""
    rname = str(dig(rayjob, "metadata", "name"))
    conds = dig(workload, "status", "conditions")
    evicted = cond(conds, "Evicted")
    old_queued = b.old_condition("Queued")
    was_admitted = b.old.get("rayJobName") == rname and (
        b.old_phase == "Preempted"
        or (old_queued is not None and old_queued.get("reason") == "Admitted"))
    was_admitted = was_admitted or (evicted is not None and evicted.get("status") == "True")
    if edited and not was_admitted and b.old_phase == "Pending":
        requeue_edited(b, job, attempt, rname)
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
    preempted = cond(conds, "Preempted")
    cause = next((c for c in (preempted, evicted) if c is not None and c.get("status") == "True"),
                 None)
    why = str((cause or {}).get("message") or f"Kueue suspended RayJob {rname}")
    checkpoint = dig(b.old, "progress", "lastCheckpoint", "step")
    resume = (f"the trainer resumes from its newest checkpoint (step {checkpoint} or later)"
              if checkpoint is not None else
              "the trainer resumes from the checkpoint it saves as it stops, if any")
    b.set("Preempted", True, _reason((cause or {}).get("reason"), "Evicted"),
          f"{why}; {resume} once Kueue admits RayJob {rname} again")
    b.to_phase("Preempted", Event("Warning", "Preempted", f"Kueue evicted RayJob {rname}: "
                                  f"{why}; {resume} when admitted again (no restart counted)"))


def requeue_edited(b: Builder, job: RLJob, attempt: int, rname: str) -> None:
    """The spec changed while the job waited for its first admission: the queued RayJob was
    rendered from the old one, so it is replaced (at the back of the queue)."""
    if attempt + 1 >= names.MAX_ATTEMPTS:
        phases.fail(b, "AttemptsExhausted", f"{names.MAX_ATTEMPTS} RayJob attempts used", None)
        return
    new = names.rayjob(job.name, attempt + 1)
    b.actions.append(CreateAttempt(attempt + 1, b.restarts))
    b.actions.append(DeleteRayJob(rname))
    b.ray_job_name = new
    phases.submitted(b, job, new)
    b.phase = "Pending"
    b.events.append(Event("Normal", "Requeued", f"the spec changed while queued: RayJob {new} "
                          f"replaces {rname} in LocalQueue {job.spec.scheduling.queue_name}"))


def _queue_state(workload: Mapping[str, Any] | None, queue: str, rname: str) -> tuple[str, str]:
    """(reason, message) of Queued=True: Kueue's own words from the Workload when it has any."""
    if workload is None:
        return ("WaitingForWorkload", f"RayJob {rname} is suspended in LocalQueue {queue}; Kueue "
                "has made no Workload for it yet (is Kueue running, with the ray.io/rayjob "
                "integration enabled?)")
    wname = dig(workload, "metadata", "name")
    reserved = cond(dig(workload, "status", "conditions"), "QuotaReserved")
    if reserved is not None and reserved.get("status") == "True":
        return "QuotaReserved", (f"Workload {wname} holds quota; waiting for its admission "
                                 "checks")
    if reserved is not None and reserved.get("message"):
        return _reason(reserved.get("reason"), "Pending"), f"{reserved['message']} ({wname})"
    return "Pending", f"Workload {wname} is waiting in LocalQueue {queue}"


def _reason(value: object, default: str) -> str:
    return value if isinstance(value, str) and _REASON.match(value) else default


def admitted(b: Builder, job: RLJob, rname: str) -> None:
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
