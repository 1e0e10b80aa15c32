"""A running attempt: the RayJob's and RayCluster's state, the head's health and the
trainer's heartbeat decide between Provisioning, Running, a restart and the end."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kuberl_api import RLJob
from kuberl_operator.status import phases, pods, queueing
from kuberl_operator.status.builder import Builder, cond, dig, fmt_time, parse_time
from kuberl_operator.status.model import Event, Observed, Tunables


def track(b: Builder, job: RLJob, attempt: int, rayjob: Mapping[str, Any],
           observed: Observed, tun: Tunables, refused: list[str]) -> None:
    rstatus = dig(rayjob, "status") or {}
    js = rstatus.get("jobStatus") or ""
    ds = rstatus.get("jobDeploymentStatus") or ""
    rname = str(dig(rayjob, "metadata", "name"))
    detail = "; ".join(str(x) for x in (rstatus.get("reason"), rstatus.get("message")) if x)
    queueing.admitted(b, job, rname)
    b.start_time = b.start_time or fmt_time(b.now)  # a crash may have lost the first patch
    suspended = b.old_condition("Suspended")
    if suspended is None or suspended.get("status") != "False":  # else keep "Resumed"
        b.set("Suspended", False, "NotSuspended")
    b.keep("Succeeded", "Running")
    b.keep("Failed", "Running")

    if js == "SUCCEEDED":
        phases.succeed(b, f"RayJob {rname} succeeded")
        return
    if ds == "ValidationFailed":  # a retry would fail the same way
        phases.fail(b, "RayJobValidationFailed", f"KubeRay refused RayJob {rname}: {detail}",
                    rayjob)
        return
    if js == "STOPPED":  # someone ran `ray job stop`: a decision, not a crash
        phases.fail(b, "RayJobStopped", f"the Ray job of {rname} was stopped", rayjob)
        return
    if js == "FAILED" or ds == "Failed":
        phases.restart_or_fail(b, job, attempt, rayjob, "RayJobFailed",
                         f"RayJob {rname} failed" + (f": {detail}" if detail else ""),
                         refused, stalled=False)
        return

    health = _cluster_health(b, rayjob, observed.raycluster, rname)
    pods.causes(b, observed.pods)
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
            phases.restart_or_fail(b, job, attempt, rayjob, "HeadLost",
                             f"{why} for over {int(tun.head_lost_grace.total_seconds())}s "
                             f"while RayJob {rname} reports RUNNING", refused, stalled=True)
            return
        b.wake(expiry)

    stale = _heartbeat_stale(b, job, rayjob, rname)
    if stale is not None:
        phases.restart_or_fail(b, job, attempt, rayjob, "HeartbeatTimeout", stale, refused,
                         stalled=True)
        return
    step = dig(b.old, "progress", "step")
    starting = _starting_phase(b, rayjob)
    b.set("Training", True, "Running",
          f"trainer starting on RayJob {rname}: {starting}" if starting else
          f"training on RayJob {rname}" + (f" at step {step}" if step is not None else ""))
    b.set("Stalled", False, "Progressing")
    b.to_phase("Running", Event("Normal", "Running", f"training started on RayJob {rname}"))


def _cluster_health(b: Builder, rayjob: Mapping[str, Any], cluster: Mapping[str, Any] | None,
                    rname: str) -> tuple[datetime, str] | None:
    """Set ClusterReady; return (since, why) when a cluster that was up has lost its head."""
    cluster_name = dig(rayjob, "status", "rayClusterName")
    rstatus = dig(rayjob, "status") or {}
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
    cstatus = dig(cluster, "status") if cluster is not None else rstatus.get("rayClusterStatus")
    cstatus = cstatus if isinstance(cstatus, Mapping) else {}
    conds = cstatus.get("conditions")
    head = cond(conds, "HeadPodReady")
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


def _running_since(b: Builder, rayjob: Mapping[str, Any], rname: str) -> datetime:
    """When this attempt's Ray job started (else when Training turned True on it, else now)."""
    running_since = parse_time(dig(rayjob, "status", "rayJobInfo", "startTime"))
    if running_since is None:
        old = b.old_condition("Training")
        if old is not None and old.get("status") == "True" and b.old.get("rayJobName") == rname:
            running_since = parse_time(old.get("lastTransitionTime"))
    return running_since or b.now


def _this_attempts_phase(b: Builder, rayjob: Mapping[str, Any]) -> str | None:
    """progress.trainerPhase when this attempt's trainer reported it (a heartbeat since its
    Ray job started), else None: an earlier attempt's phase says nothing about this one."""
    rname = str(dig(rayjob, "metadata", "name"))
    beat = parse_time(dig(b.old, "progress", "lastHeartbeatTime"))
    phase = dig(b.old, "progress", "trainerPhase")
    if beat is None or not isinstance(phase, str) or beat < _running_since(b, rayjob, rname):
        return None
    return phase


def _starting_phase(b: Builder, rayjob: Mapping[str, Any]) -> str | None:
    """The start-up phase this attempt's trainer last reported, in words, or None."""
    phase = _this_attempts_phase(b, rayjob)
    return STARTUP_WORDS.get(phase) if phase is not None else None


# progress.trainerPhase's start-up phases (kuberl_api.status.STARTUP_PHASES), as the Training
# condition's message says them.
STARTUP_WORDS = {
    "Starting": "starting Ray and the engines (Starting)",
    "Placing": "placing the training ranks (Placing)",
    "EnginesStarting": "waiting for the engines to start (EnginesStarting)",
    "Loading": "loading the models (Loading)",
    "FirstStep": "first weights and first step (FirstStep)",
}


def _heartbeat_stale(b: Builder, job: RLJob, rayjob: Mapping[str, Any], rname: str) -> str | None:
    """The trainer must report within heartbeatTimeoutSeconds of its last report, or of the
    moment this attempt's Ray job started (so a heartbeat from an earlier attempt, or none yet,
    never counts against a fresh one). During start-up the trainer reports every 30 s with
    the phase it is in (progress.trainerPhase), so a slow start is not a stall; each phase
    beats only within its own limit (kuberl_trainer/report/heartbeat.py), so a start-up that
    hangs goes silent and is caught here like a hung step."""
    timeout = timedelta(seconds=job.spec.heartbeat_timeout_seconds)
    running_since = _running_since(b, rayjob, rname)
    beat = parse_time(dig(b.old, "progress", "lastHeartbeatTime"))
    reference = max(beat, running_since) if beat is not None else running_since
    expiry = reference + timeout
    if b.now < expiry:
        b.wake(expiry)
        return None
    age = int((b.now - reference).total_seconds())
    fresh_beat = beat is not None and beat >= running_since
    phase = _this_attempts_phase(b, rayjob) if fresh_beat else None
    what = ("since the last heartbeat" + (f", in trainer phase {phase}" if phase else "")
            if fresh_beat else "no heartbeat since the job started")
    return (f"trainer silent for {age}s ({what}; heartbeatTimeoutSeconds "
            f"{job.spec.heartbeat_timeout_seconds}) on RayJob {rname}")
