"""Phase transitions: start an attempt (or hold it), suspend, finish, fail, restart."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kuberl_api import RLJob
from kuberl_operator.render import names
from kuberl_operator.status.builder import Builder, dig, fmt_time, parse_time
from kuberl_operator.status.model import (
    RAY_TERMINAL_JOB_STATUSES,
    CreateAttempt,
    DeleteRayJob,
    DeleteRLJob,
    Event,
    Observed,
)


def start(b: Builder, job: RLJob, last_attempt: int | None, refused: list[str],
           observed: Observed) -> None:
    resuming = b.old_phase == "Suspended"
    if refused:  # only reachable when resuming: never run a spec that was refused
        b.set("Suspended", True, "ResumeBlocked",
              "resume is held until the refused spec change is reverted")
        b.phase = "Suspended"
        return
    unheld = unheld_checkpoints(job)
    if unheld:  # a cluster-only refusal: see unheld_checkpoints
        old = b.old_condition("Accepted")
        if old is None or old.get("message") != unheld:
            b.events.append(Event("Warning", "CheckpointNotHeld", unheld))
        b.set("Accepted", False, "CheckpointNotHeld", unheld)
        b.phase = b.phase or "Pending"
        return
    # an input the pods need is missing: create nothing yet, say which (once per message)
    missing = (("spec.scheduling.priorityClassName", observed.priority_class_problem,
                "PriorityClassNotFound"),  # the pods would be refused
               ("spec.code.configMap", observed.code_problem,
                "CodeNotFound"))  # the pods would sit in ContainerCreating
    for field, problem, reason in missing:
        if problem:
            message = f"{field}: {problem}; nothing is created until it exists"
            old = b.old_condition("Accepted")
            if old is None or old.get("message") != message:
                b.events.append(Event("Warning", reason, message))
            b.set("Accepted", False, reason, message)
            b.phase = b.phase or "Pending"
            return
    attempt = 0 if last_attempt is None else last_attempt + 1
    if attempt >= names.MAX_ATTEMPTS:
        fail(b, "AttemptsExhausted", f"{names.MAX_ATTEMPTS} RayJob attempts used", None)
        return
    name = names.rayjob(job.name, attempt)
    b.actions.append(CreateAttempt(attempt, b.restarts))
    b.ray_job_name = name
    queue = job.spec.scheduling.queue_name
    # activeDeadlineSeconds counts from the (re)start; with a queue, from the admission.
    b.start_time = None if queue else fmt_time(b.now)
    submitted(b, job, name)
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


CHECKPOINT_NOT_HELD = (
    "spec.checkpoint.pvc: schedule.saveInterval needs a checkpoint PVC in a cluster: without one "
    "the head and the train pods each write their part of a checkpoint to their own emptyDir, "
    "so no pod holds a whole one and a restart resumes from nothing; set checkpoint.pvc (a "
    "ReadWriteMany claim when training spans nodes) or drop schedule.saveInterval")


ADAPTERS_NOT_SHARED = (
    "spec.checkpoint.pvc: training.lora.sync adapter needs a checkpoint PVC in a cluster: the "
    "trainer writes each step's adapter under checkpoint.path and the engines, in pods of "
    "their own, load it from there; set checkpoint.pvc (a ReadWriteMany claim) or use "
    "training.lora.sync merged")


def unheld_checkpoints(job: RLJob) -> str | None:
    """Why the job's checkpoints would be held by no pod, or None.

    In a cluster the driver runs on the head, which hosts no training rank (render/layout.py),
    and train pods always exist: the head writes trainer_state.json and the COMPLETE marker,
    the ranks their model and optimizer files, so without a shared claim the parts land in
    different emptyDirs. The CRD cannot refuse it: the same manifest is right for `kuberl run`,
    where one filesystem holds the whole checkpoint (under --output-dir), and the model that
    validates both is one. So the operator refuses it before creating anything."""
    spec = job.spec
    if spec.schedule.save_interval is not None and spec.checkpoint.pvc is None:
        return CHECKPOINT_NOT_HELD
    if spec.adapter_sync and spec.checkpoint.pvc is None:
        return ADAPTERS_NOT_SHARED
    return None


def submitted(b: Builder, job: RLJob, name: str) -> None:
    """Queued as a new RayJob is created: True with a queue (Kueue admits it), else False."""
    queue = job.spec.scheduling.queue_name
    if queue:
        b.set("Queued", True, "Submitted", f"RayJob {name} created suspended in LocalQueue "
              f"{queue}; waiting for Kueue to admit it")
    else:
        b.set("Queued", False, "NoQueue", "spec.scheduling.queueName is not set")


def suspend(b: Builder, current: Mapping[str, Any] | None) -> None:
    if current is not None:
        b.actions.append(DeleteRayJob(str(dig(current, "metadata", "name"))))
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


def terminal(b: Builder, job: RLJob, current: Mapping[str, Any] | None) -> None:
    """Succeeded and Failed are final. Free a cluster that still runs after a failure the
    operator declared, and honour ttlSecondsAfterFinished."""
    if (b.old_phase == "Failed" and current is not None
            and dig(current, "status", "jobStatus") not in RAY_TERMINAL_JOB_STATUSES):
        b.actions.append(DeleteRayJob(str(dig(current, "metadata", "name"))))
    expiry = ttl_expiry(b, job)
    if expiry is not None:
        if b.now >= expiry:
            b.actions.append(DeleteRLJob())
            b.events.append(Event("Normal", "TTLExpired", f"deleting the RLJob "
                                  f"{job.spec.ttl_seconds_after_finished}s after it finished"))
        else:
            b.wake(expiry)


def ttl_expiry(b: Builder, job: RLJob) -> datetime | None:
    """When ttlSecondsAfterFinished deletes the finished job (None: no TTL, or not finished)."""
    ttl = job.spec.ttl_seconds_after_finished
    done = parse_time(b.completion_time)
    if ttl is None or done is None:
        return None
    # completionTime holds whole seconds (as Kubernetes writes times): the job finished
    # somewhere in that second, so count from its end. Never early (a TTL of 1 s could
    # otherwise fire 5 ms after the finish), at most 1 s late.
    return done + timedelta(seconds=ttl + 1)


def succeed(b: Builder, message: str) -> None:
    b.completion_time = fmt_time(b.now)
    b.set("Succeeded", True, "Succeeded", message)
    b.set("Failed", False, "Succeeded")
    b.set("Training", False, "Completed", message)
    b.set("ClusterReady", False, "JobFinished")
    b.set("Stalled", False, "Completed")
    b.to_phase("Succeeded", Event("Normal", "Succeeded", message))


def fail(b: Builder, reason: str, message: str, current: Mapping[str, Any] | None,
          delete: bool = False) -> None:
    running = dig(current, "status", "jobStatus") not in RAY_TERMINAL_JOB_STATUSES
    if delete and current is not None and running:  # a finished RayJob stays for inspection
        b.actions.append(DeleteRayJob(str(dig(current, "metadata", "name"))))
    b.completion_time = fmt_time(b.now)
    b.set("Failed", True, reason, message)
    b.set("Succeeded", False, reason)
    b.set("Training", False, reason, message)
    b.set("ClusterReady", False, "JobFinished")
    b.keep("Stalled", "Failed")
    b.to_phase("Failed", Event("Warning", reason, message))


def restart_or_fail(b: Builder, job: RLJob, attempt: int, current: Mapping[str, Any] | None,
                     reason: str, message: str, refused: list[str], stalled: bool) -> None:
    """Replace attempt N by N+1 from the last checkpoint while backoffLimit allows, else Failed
    (the RayJob is deleted so a hung cluster frees its GPUs)."""
    limit = job.spec.backoff_limit
    stall_reason = reason if stalled else "Progressing"
    b.set("Stalled", stalled, stall_reason, message if stalled else "")
    if b.restarts >= limit:
        fail(b, "BackoffLimitExceeded",
              f"{message}; backoffLimit ({limit}) reached after {b.restarts} restarts",
              current, delete=True)
        return
    if attempt + 1 >= names.MAX_ATTEMPTS:
        fail(b, "AttemptsExhausted", f"{message}; {names.MAX_ATTEMPTS} RayJob attempts used",
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
        b.actions.append(DeleteRayJob(str(dig(current, "metadata", "name"))))
    checkpoint = dig(b.old, "progress", "lastCheckpoint", "step")
    origin = (f"checkpoint step {checkpoint}" if checkpoint is not None
              else "the start (no checkpoint reported yet)")
    b.ray_job_name = new
    submitted(b, job, new)
    b.set("ClusterReady", False, "Restarting", f"RayJob {new} created")
    b.set("Training", False, "Restarting", message)
    b.phase = "Restarting"
    b.events.append(Event("Warning", "Restarting",
                          f"{message}; restarting from {origin} as RayJob {new} "
                          f"(restart {b.restarts} of {limit})"))
