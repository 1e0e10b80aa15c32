"""The status/action decision as a table: observed state -> phase, conditions, actions, events.

Every row is a pure call to `kuberl_operator.status.decide`; times are fixed, so rows about
heartbeats, grace periods, deadlines and TTLs are exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kuberl_operator.render import names
from kuberl_operator.status import (
    ANNOTATION_RESTARTS,
    CreateAttempt,
    Decision,
    DeleteRayJob,
    DeleteRLJob,
    Observed,
    Tunables,
    attempt_of,
    decide,
    fmt_time,
    section_digests,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TUN = Tunables(head_lost_grace=timedelta(seconds=60))
JOB = "math"


def ago(seconds: float) -> str:
    return fmt_time(NOW - timedelta(seconds=seconds))


def spec(**extra: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"path": "/models/qwen"}, "data": {"prompts": "/data/t.jsonl"},
                         "heartbeatTimeoutSeconds": 300, "backoffLimit": 2}
    s.update(extra)
    return s


def digests(**extra: Any) -> dict[str, str]:
    from kuberl_api import parse
    return section_digests(parse(body(spec=spec(**extra)) | {"status": None}).spec)


def cond(type_: str, status: str, reason: str = "X", since: str | None = None) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": "",
            "lastTransitionTime": since or ago(3600)}


def body(status: dict[str, Any] | None = None, spec: dict[str, Any] | None = None,
         generation: int = 1) -> dict[str, Any]:
    b: dict[str, Any] = {
        "apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
        "metadata": {"name": JOB, "namespace": "ns", "uid": "u-1", "generation": generation},
        "spec": spec if spec is not None else globals()["spec"](),
    }
    if status is not None:
        b["status"] = status
    return b


def running_status(attempt: int = 0, phase: str = "Running", restarts: int = 0,
                   **extra: Any) -> dict[str, Any]:
    st = {"phase": phase, "rayJobName": names.rayjob(JOB, attempt), "restarts": restarts,
          "startTime": ago(600), "specDigests": digests(),
          "conditions": [cond("Accepted", "True", "Accepted"),
                         cond("Training", "True" if phase == "Running" else "False", "Running")]}
    st.update(extra)
    return st


def rayjob(attempt: int = 0, js: str = "", ds: str = "", cluster: str | None = None,
           restarts: int | None = None, deleting: bool = False, started: str | None = None,
           suspend: bool | None = None, **status: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": names.rayjob(JOB, attempt), "namespace": "ns",
                            "labels": {names.LABEL_JOB: JOB, names.LABEL_ATTEMPT: str(attempt)}}
    if restarts is not None:
        meta["annotations"] = {ANNOTATION_RESTARTS: str(restarts)}
    if deleting:
        meta["deletionTimestamp"] = ago(1)
    st: dict[str, Any] = {"jobStatus": js, "jobDeploymentStatus": ds, **status}
    if cluster:
        st["rayClusterName"] = cluster
    if started:
        st["rayJobInfo"] = {"startTime": started}
    out = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "status": st}
    if suspend is not None:
        out["spec"] = {"suspend": suspend}
    return out


def raycluster(head: bool = True, head_since: str | None = None, ready: int = 2,
               desired: int = 2) -> dict[str, Any]:
    conds = [{"type": "HeadPodReady", "status": "True" if head else "False",
              "reason": "HeadPodRunningAndReady" if head else "HeadPodNotFound",
              "lastTransitionTime": head_since or ago(3000)},
             {"type": "RayClusterProvisioned", "status": "True",
              "reason": "AllPodRunningAndReadyFirstTime", "lastTransitionTime": ago(3000)}]
    return {"metadata": {"name": "c0"}, "status": {"conditions": conds,
            "readyWorkerReplicas": ready, "desiredWorkerReplicas": desired}}


RJ0 = names.rayjob(JOB, 0)
RJ1 = names.rayjob(JOB, 1)
RJ2 = names.rayjob(JOB, 2)
RUNNING_RJ0 = rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(500))


@dataclass
class Row:
    id: str
    body: dict[str, Any]
    observed: Observed = field(default_factory=Observed)
    phase: str = ""
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # reasons, in order
    extra: dict[str, Any] = field(default_factory=dict)  # expected status fields


ROWS = [
    Row("fresh job: create attempt 0",
        body(), Observed(),
        phase="Provisioning",
        conditions={"Accepted": ("True", "Accepted"), "ClusterReady": ("False", "Provisioning"),
                    "Training": ("False", "Provisioning"), "Suspended": ("False", "NotSuspended"),
                    "Succeeded": ("False", "Running"), "Failed": ("False", "Running"),
                    "Stalled": ("False", "Progressing")},
        actions=[CreateAttempt(0, 0)], events=["Created"],
        extra={"rayJobName": RJ0, "restarts": 0, "startTime": fmt_time(NOW),
               "observedGeneration": 1}),
    Row("invalid spec: Accepted=False, nothing created",
        body(spec=spec(training={"nodes": 0})), Observed(),
        phase="Pending", conditions={"Accepted": ("False", "InvalidSpec")},
        actions=[], events=["InvalidSpec"], extra={"rayJobName": None}),
    Row("invalid spec already reported: no new event",
        body(spec=spec(training={"nodes": 0}), status={"phase": "Pending", "conditions": [
            {**cond("Accepted", "False", "InvalidSpec"),
             "message": "spec.training.nodes: must be >= 1 (got 0)"}]}),
        Observed(), phase="Pending", conditions={"Accepted": ("False", "InvalidSpec")},
        actions=[], events=[]),
    Row("crash after creating the RayJob, before the status patch: adopt it, no new attempt",
        body(), Observed(rayjobs=(rayjob(0),)),
        phase="Provisioning", actions=[], events=[],
        extra={"rayJobName": RJ0, "startTime": fmt_time(NOW)}),
    Row("provisioning: cluster not ready yet",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "", "Initializing", cluster="c0"),),
                 raycluster=raycluster(ready=0)),
        phase="Provisioning", conditions={"ClusterReady": ("False", "WorkersNotReady"),
                                          "Training": ("False", "Provisioning")}),
    Row("cluster ready, job pending",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "PENDING", "Running", cluster="c0"),),
                 raycluster=raycluster()),
        phase="Provisioning", conditions={"ClusterReady": ("True", "ClusterReady"),
                                          "Training": ("False", "Provisioning")}),
    Row("cluster conditions only embedded in the RayJob status",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "PENDING", "Initializing",
                                 rayClusterStatus=raycluster()["status"]),)),
        phase="Provisioning", conditions={"ClusterReady": ("True", "ClusterReady")}),
    Row("training starts",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(5)),),
                 raycluster=raycluster()),
        phase="Running", conditions={"Training": ("True", "Running"),
                                     "ClusterReady": ("True", "ClusterReady"),
                                     "Stalled": ("False", "Progressing")},
        events=["Running"]),
    Row("training with a fresh heartbeat: steady, nothing to do",
        body(running_status(progress={"step": 7, "lastHeartbeatTime": ago(10)})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Running", conditions={"Training": ("True", "Running")}, actions=[], events=[]),
    # Issue 36: start-up beats every 30 s with its phase; the Ray job has run 2000 s, far past
    # heartbeatTimeoutSeconds (300), and the job is not Stalled (each row fails without the
    # start-up heartbeat: the last heartbeat would be the start, 2000 s ago).
    Row("a slow start-up that keeps beating is not Stalled",
        body(running_status(progress={"lastHeartbeatTime": ago(20),
                                      "trainerPhase": "EnginesStarting"})),
        Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(2000)),),
                 raycluster=raycluster()),
        phase="Running", conditions={"Training": ("True", "Running"),
                                     "Stalled": ("False", "Progressing")}, actions=[]),
    Row("a start-up phase gone silent past the timeout: Stalled, restarted",
        body(running_status(progress={"lastHeartbeatTime": ago(400), "trainerPhase": "Loading"})),
        Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(2000)),),
                 raycluster=raycluster()),
        phase="Restarting", conditions={"Stalled": ("True", "HeartbeatTimeout")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)], events=["Restarting"],
        extra={"_message": "in trainer phase Loading"}),
    Row("no heartbeat yet, within the timeout of the job's start",
        body(running_status()),
        Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(200)),),
                 raycluster=raycluster()),
        phase="Running", actions=[]),
    Row("heartbeat from before this attempt started does not count against it",
        body(running_status(1, restarts=1, progress={"lastHeartbeatTime": ago(5000)})),
        Observed(rayjobs=(rayjob(1, "RUNNING", "Running", cluster="c0", started=ago(100)),),
                 raycluster=raycluster()),
        phase="Running", actions=[]),
    Row("stale heartbeat: restart as attempt 1",
        body(running_status(progress={"lastHeartbeatTime": ago(400),
                                      "lastCheckpoint": {"step": 40, "path": "/c/40"}})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Restarting", conditions={"Stalled": ("True", "HeartbeatTimeout"),
                                        "Training": ("False", "Restarting")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)], events=["Restarting"],
        extra={"restarts": 1, "rayJobName": RJ1}),
    Row("stale heartbeat at backoffLimit: Failed, RayJob deleted",
        body(running_status(2, restarts=2, progress={"lastHeartbeatTime": ago(400)})),
        Observed(rayjobs=(rayjob(2, "RUNNING", "Running", cluster="c0", started=ago(500)),),
                 raycluster=raycluster()),
        phase="Failed", conditions={"Failed": ("True", "BackoffLimitExceeded"),
                                    "Stalled": ("True", "HeartbeatTimeout")},
        actions=[DeleteRayJob(RJ2)], events=["BackoffLimitExceeded"],
        extra={"completionTime": fmt_time(NOW), "restarts": 2}),
    Row("head pod not ready within the grace period: wait",
        body(running_status(progress={"lastHeartbeatTime": ago(10)})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster(head=False, head_since=ago(30))),
        phase="Running", conditions={"ClusterReady": ("False", "HeadPodNotReady")}, actions=[]),
    Row("head pod lost past the grace period while RayJob says RUNNING: restart",
        body(running_status(progress={"lastHeartbeatTime": ago(10)})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster(head=False, head_since=ago(90))),
        phase="Restarting", conditions={"Stalled": ("True", "HeadLost")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)], events=["Restarting"]),
    Row("RayCluster gone while RUNNING: first sighting starts the grace period",
        body(running_status(progress={"lastHeartbeatTime": ago(10)})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=None),
        phase="Running", conditions={"ClusterReady": ("False", "ClusterNotFound")}, actions=[]),
    Row("RayCluster gone past the grace period: restart",
        body(running_status(progress={"lastHeartbeatTime": ago(10)}, conditions=[
            cond("Training", "True", "Running"),
            cond("ClusterReady", "False", "ClusterNotFound", since=ago(61))])),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=None),
        phase="Restarting", conditions={"Stalled": ("True", "HeadLost")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)]),
    Row("RayJob SUCCEEDED: Succeeded, RayJob kept for inspection",
        body(running_status()),
        Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete", cluster="c0"),)),
        phase="Succeeded", conditions={"Succeeded": ("True", "Succeeded"),
                                       "Training": ("False", "Completed"),
                                       "Failed": ("False", "Succeeded")},
        actions=[], events=["Succeeded"], extra={"completionTime": fmt_time(NOW)}),
    Row("RayJob FAILED: restart (not a stall)",
        body(running_status()),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed", reason="AppFailed"),)),
        phase="Restarting", conditions={"Stalled": ("False", "Progressing")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)], events=["Restarting"]),
    Row("RayJob FAILED at backoffLimit: Failed",
        body(running_status(2, restarts=2)),
        Observed(rayjobs=(rayjob(2, "FAILED", "Failed", reason="AppFailed"),)),
        phase="Failed", conditions={"Failed": ("True", "BackoffLimitExceeded")},
        actions=[], events=["BackoffLimitExceeded"]),
    Row("backoffLimit 0: the first failure is final",
        body(running_status(), spec=spec(backoffLimit=0)),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),)),
        phase="Failed", actions=[], events=["BackoffLimitExceeded"]),
    Row("KubeRay ValidationFailed: Failed without a restart",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "", "ValidationFailed", reason="ValidationFailed"),)),
        phase="Failed", conditions={"Failed": ("True", "RayJobValidationFailed")},
        events=["RayJobValidationFailed"]),
    Row("restarted attempt not taken up by KubeRay yet: stays Restarting, Stalled kept",
        body(running_status(1, phase="Restarting", restarts=1, conditions=[
            cond("Stalled", "True", "HeartbeatTimeout")])),
        Observed(rayjobs=(rayjob(1, "", "", restarts=1),)),
        phase="Restarting", conditions={"Stalled": ("True", "HeartbeatTimeout")}, actions=[]),
    Row("restarted attempt provisioning: Provisioning, Stalled kept until it runs",
        body(running_status(1, phase="Restarting", restarts=1, conditions=[
            cond("Stalled", "True", "HeartbeatTimeout")])),
        Observed(rayjobs=(rayjob(1, "", "Initializing", restarts=1),)),
        phase="Provisioning", conditions={"Stalled": ("True", "HeartbeatTimeout")},
        actions=[]),
    Row("restart without a checkpoint says it starts over, not 'from the last checkpoint'",
        body(running_status(progress={"lastHeartbeatTime": ago(400)})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Restarting", actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)],
        events=["Restarting"],
        extra={"_message": "restarting from the start (no checkpoint reported yet)"}),
    Row("restarted attempt runs: Running, Stalled cleared",
        body(running_status(1, phase="Restarting", restarts=1, conditions=[
            cond("Stalled", "True", "HeartbeatTimeout")])),
        Observed(rayjobs=(rayjob(1, "RUNNING", "Running", restarts=1, started=ago(1)),)),
        phase="Running", conditions={"Stalled": ("False", "Progressing")}, events=["Running"]),
    Row("crash between creating attempt 1 and deleting 0: delete 0, keep the restart count",
        body(running_status(progress={"lastHeartbeatTime": ago(400)})),
        Observed(rayjobs=(RUNNING_RJ0, rayjob(1, "", "", restarts=1))),
        phase="Provisioning", actions=[DeleteRayJob(RJ0)],
        extra={"restarts": 1, "rayJobName": RJ1}),
    Row("current RayJob deleted behind our back: counts as a restart",
        body(running_status()), Observed(),
        phase="Restarting", conditions={"Stalled": ("True", "RayJobLost")},
        actions=[CreateAttempt(1, 1)]),
    Row("suspend: delete the RayJob",
        body(running_status(), spec=spec(suspend=True)),
        Observed(rayjobs=(RUNNING_RJ0,)),
        phase="Suspended", conditions={"Suspended": ("True", "Suspended"),
                                       "Training": ("False", "Suspended"),
                                       "ClusterReady": ("False", "Suspended")},
        actions=[DeleteRayJob(RJ0)], events=["Suspended"], extra={"rayJobName": RJ0}),
    Row("suspended, RayJob still terminating: nothing more to do",
        body(running_status(phase="Suspended"), spec=spec(suspend=True)),
        Observed(rayjobs=(rayjob(0, "RUNNING", deleting=True),)),
        phase="Suspended", actions=[], events=[]),
    Row("created suspended: nothing created",
        body(spec=spec(suspend=True)), Observed(),
        phase="Suspended", actions=[], events=["Suspended"]),
    Row("resume: a new attempt that does not count as a restart; the deadline clock restarts",
        body(running_status(phase="Suspended", restarts=1, startTime=ago(99999)),
             spec=spec(activeDeadlineSeconds=100)),
        Observed(),
        phase="Provisioning", conditions={"Suspended": ("False", "Resumed")},
        actions=[CreateAttempt(1, 1)], events=["Resumed"],
        extra={"restarts": 1, "rayJobName": RJ1, "startTime": fmt_time(NOW)}),
    Row("resume while the old RayJob is still terminating: next attempt anyway",
        body(running_status(phase="Suspended")),
        Observed(rayjobs=(rayjob(0, "RUNNING", deleting=True),)),
        phase="Provisioning", actions=[CreateAttempt(1, 0)]),
    Row("deadline exceeded: Failed DeadlineExceeded, RayJob deleted",
        body(running_status(progress={"lastHeartbeatTime": ago(1)}, startTime=ago(3601)),
             spec=spec(activeDeadlineSeconds=3600)),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Failed", conditions={"Failed": ("True", "DeadlineExceeded")},
        actions=[DeleteRayJob(RJ0)], events=["DeadlineExceeded"]),
    Row("deadline not yet: running",
        body(running_status(progress={"lastHeartbeatTime": ago(1)}, startTime=ago(3500)),
             spec=spec(activeDeadlineSeconds=3600)),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Running", actions=[]),
    Row("TTL not expired: wait",
        body(running_status(phase="Succeeded", completionTime=ago(30)),
             spec=spec(ttlSecondsAfterFinished=60)),
        Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete"),)),
        phase="Succeeded", actions=[], events=[]),
    Row("TTL counts from the end of completionTime's second: never early",
        body(running_status(phase="Succeeded", completionTime=ago(60)),
             spec=spec(ttlSecondsAfterFinished=60)),
        Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete"),)),
        phase="Succeeded", actions=[], events=[]),
    Row("TTL expired: delete the RLJob",
        body(running_status(phase="Succeeded", completionTime=ago(61)),
             spec=spec(ttlSecondsAfterFinished=60)),
        Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete"),)),
        phase="Succeeded", actions=[DeleteRLJob()], events=["TTLExpired"]),
    Row("Failed is final: a still-running RayJob is deleted, no restart",
        body(running_status(phase="Failed", completionTime=ago(5))),
        Observed(rayjobs=(RUNNING_RJ0,)),
        phase="Failed", actions=[DeleteRayJob(RJ0)], events=[]),
    Row("Succeeded is final even if suspend is set afterwards",
        body(running_status(phase="Succeeded", completionTime=ago(5)), spec=spec(suspend=True)),
        Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete"),)),
        phase="Succeeded", actions=[]),
    Row("immutable change refused: Accepted=False naming the section, job untouched",
        body(running_status(progress={"lastHeartbeatTime": ago(1)}),
             spec=spec(algorithm={"lr": 0.5}), generation=2),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Running", conditions={"Accepted": ("False", "ImmutableFieldChanged"),
                                     "Training": ("True", "Running")},
        actions=[], events=["ImmutableFieldChanged"],
        extra={"observedGeneration": 2, "specDigests": digests()}),
    Row("refused change blocks a restart (never run a refused spec)",
        body(running_status(progress={"lastHeartbeatTime": ago(400)}),
             spec=spec(algorithm={"lr": 0.5})),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Running", conditions={"Stalled": ("True", "RestartBlocked")}, actions=[],
        events=["ImmutableFieldChanged", "RestartBlocked"]),
    Row("mutable fields may change any time",
        body(running_status(progress={"lastHeartbeatTime": ago(1)}),
             spec=spec(backoffLimit=5, activeDeadlineSeconds=99999)),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Running", conditions={"Accepted": ("True", "Accepted")}, actions=[]),
    Row("editable while Pending: the digests follow the spec",
        body({"phase": "Pending", "specDigests": digests()}, spec=spec(algorithm={"lr": 0.5})),
        Observed(), phase="Provisioning", conditions={"Accepted": ("True", "Accepted")},
        actions=[CreateAttempt(0, 0)], extra={"specDigests": digests(algorithm={"lr": 0.5})}),
    Row("RayJob of another attempt left over: deleted",
        body(running_status(1, restarts=1, progress={"lastHeartbeatTime": ago(1)})),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),
                          rayjob(1, "RUNNING", "Running", cluster="c0", started=ago(9))),
                 raycluster=raycluster()),
        phase="Running", actions=[DeleteRayJob(RJ0)]),
]

# ---- Kueue: spec.scheduling.queueName (the RayJob is created suspended; Kueue owns suspend)

QUEUED = {"queueName": "team-a"}


def workload(*conds: tuple[str, str, str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "rayjob-math-r0-1a2b3", "creationTimestamp": ago(60)},
            "status": {"conditions": [
                {"type": t, "status": st, "reason": r, "message": m,
                 "lastTransitionTime": ago(30)} for t, st, r, m in conds]}}


PENDING_WL = workload(("QuotaReserved", "False", "Pending",
                       "couldn't assign flavors to pod set head: insufficient unused quota for "
                       "nvidia.com/gpu in flavor gpu, 8 more needed"))
EVICTED_WL = workload(("QuotaReserved", "False", "Pending", "evicted"),
                      ("Evicted", "True", "Preempted",
                       "Preempted to accommodate a workload (UID: u-9) due to prioritization "
                       "in the ClusterQueue"),
                      ("Preempted", "True", "InClusterQueue", "Preempted to accommodate a "
                       "workload (UID: u-9) due to prioritization in the ClusterQueue"))


def queued_status(phase: str = "Pending", attempt: int = 0, queued: str = "True",
                  reason: str = "Submitted", **extra: Any) -> dict[str, Any]:
    st = running_status(attempt, phase=phase,
                        **{"specDigests": digests(scheduling=QUEUED), **extra})
    st["conditions"].append(cond("Queued", queued, reason))
    if phase == "Pending":
        st.pop("startTime")
    return st


QUEUE_ROWS = [
    Row("queued job: the RayJob is created suspended, phase Pending, no deadline clock yet",
        body(spec=spec(scheduling=QUEUED)), Observed(),
        phase="Pending", conditions={"Queued": ("True", "Submitted"),
                                     "Preempted": ("False", "NotPreempted")},
        actions=[CreateAttempt(0, 0)], events=["Created"],
        extra={"rayJobName": RJ0, "startTime": None}),
    Row("waiting for quota: Queued carries Kueue's reason and message",
        body(queued_status(), spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),), workload=PENDING_WL),
        phase="Pending", conditions={"Queued": ("True", "Pending"),
                                     "ClusterReady": ("False", "Queued"),
                                     "Training": ("False", "Queued")},
        actions=[], events=[], extra={"startTime": None}),
    Row("no Workload yet (Kueue absent or slow): said so, nothing else done",
        body(queued_status(), spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),)),
        phase="Pending", conditions={"Queued": ("True", "WaitingForWorkload")}, actions=[]),
    Row("admitted: Queued=False Admitted, the deadline clock starts, provisioning as usual",
        body(queued_status(), spec=spec(scheduling=QUEUED, activeDeadlineSeconds=60)),
        Observed(rayjobs=(rayjob(0, "", "Initializing", suspend=False),)),
        phase="Provisioning", conditions={"Queued": ("False", "Admitted")},
        actions=[], events=["Admitted"], extra={"startTime": fmt_time(NOW)}),
    Row("preempted while running: Preempted phase and condition, no restart counted",
        body(queued_status("Running", queued="False", reason="Admitted",
                           progress={"lastCheckpoint": {"step": 40, "path": "/c/40"}}),
             spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "FAILED", "Suspending", suspend=True),), workload=EVICTED_WL),
        phase="Preempted", conditions={"Preempted": ("True", "InClusterQueue"),
                                       "Queued": ("True", "Pending"),
                                       "Stalled": ("False", "Queued")},
        actions=[], events=["Preempted"], extra={"restarts": 0, "rayJobName": RJ0}),
    Row("preempted, seen only through the Workload (admission and eviction between passes)",
        body(queued_status(), spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),), workload=EVICTED_WL),
        phase="Preempted", conditions={"Preempted": ("True", "InClusterQueue")},
        actions=[], events=["Preempted"]),
    Row("still preempted: no second event",
        body(queued_status("Preempted", queued="True", reason="Pending"),
             spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),), workload=EVICTED_WL),
        phase="Preempted", actions=[], events=[]),
    Row("readmitted after preemption: same RayJob resumes, Preempted=False, no restart",
        body(queued_status("Preempted", queued="True", reason="Pending"),
             spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(0, "", "Initializing", suspend=False),)),
        phase="Provisioning", conditions={"Preempted": ("False", "Readmitted"),
                                          "Queued": ("False", "Admitted")},
        actions=[], events=["Readmitted"], extra={"restarts": 0, "startTime": fmt_time(NOW)}),
    Row("spec edited while queued: the queued RayJob is replaced, no restart counted",
        body(queued_status(specDigests=digests(scheduling=QUEUED, backoffLimit=2)),
             spec=spec(scheduling=QUEUED, training={"nodes": 2})),
        Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),), workload=PENDING_WL),
        phase="Pending", conditions={"Queued": ("True", "Submitted")},
        actions=[CreateAttempt(1, 0), DeleteRayJob(RJ0)], events=["Requeued"],
        extra={"rayJobName": RJ1, "restarts": 0}),
    Row("queued RayJob deleted before admission: submitted again, no restart counted",
        body(queued_status(), spec=spec(scheduling=QUEUED)), Observed(),
        phase="Pending", actions=[CreateAttempt(1, 0)], extra={"restarts": 0}),
    Row("a restart goes through the queue again",
        body(queued_status("Running", queued="False", reason="Admitted",
                           progress={"lastHeartbeatTime": ago(400)}),
             spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Restarting", conditions={"Queued": ("True", "Submitted")},
        actions=[CreateAttempt(1, 1), DeleteRayJob(RJ0)], events=["Restarting"]),
    Row("the restarted attempt waits in the queue: phase stays Restarting",
        body(queued_status("Restarting", attempt=1, restarts=1), spec=spec(scheduling=QUEUED)),
        Observed(rayjobs=(rayjob(1, "", "Suspended", suspend=True, restarts=1),),
                 workload=PENDING_WL),
        phase="Restarting", conditions={"Queued": ("True", "Pending")}, actions=[]),
    Row("unknown PriorityClass: Accepted=False with the API server's message, nothing created",
        body(spec=spec(scheduling={"priorityClassName": "gold"})),
        Observed(priority_class_problem='priorityclasses.scheduling.k8s.io "gold" not found'),
        phase="Pending", conditions={"Accepted": ("False", "PriorityClassNotFound")},
        actions=[], events=["PriorityClassNotFound"], extra={"rayJobName": None}),
    Row("missing code ConfigMap: Accepted=False CodeNotFound naming it, nothing created",
        body(spec=spec(rollout={"function": "agent:run"}, code={"configMap": "agent"})),
        Observed(code_problem='configmaps "agent" not found'),
        phase="Pending", conditions={"Accepted": ("False", "CodeNotFound")},
        actions=[], events=["CodeNotFound"], extra={"rayJobName": None}),
    Row("still missing: no second event",
        body({"phase": "Pending", "conditions": [
            {"type": "Accepted", "status": "False", "reason": "CodeNotFound",
             "message": 'spec.code.configMap: configmaps "agent" not found; nothing is '
                        "created until it exists"}]},
             spec=spec(rollout={"function": "agent:run"}, code={"configMap": "agent"})),
        Observed(code_problem='configmaps "agent" not found'),
        phase="Pending", conditions={"Accepted": ("False", "CodeNotFound")},
        actions=[], events=[]),
    Row("the ConfigMap appears: Accepted, attempt 0 created",
        body({"phase": "Pending", "conditions": [
            cond("Accepted", "False", "CodeNotFound")]},
             spec=spec(rollout={"function": "agent:run"}, code={"configMap": "agent"})),
        Observed(), phase="Provisioning", conditions={"Accepted": ("True", "Accepted")},
        actions=[CreateAttempt(0, 0)], events=["Created"]),
    # Issue 36: without a checkpoint PVC the head and the train pods would each hold a part.
    Row("saveInterval without checkpoint.pvc: Accepted=False CheckpointNotHeld, nothing created",
        body(spec=spec(schedule={"saveInterval": 10})), Observed(),
        phase="Pending", conditions={"Accepted": ("False", "CheckpointNotHeld")},
        actions=[], events=["CheckpointNotHeld"], extra={"rayJobName": None}),
    Row("checkpoint.pvc added: Accepted, attempt 0 created",
        body({"phase": "Pending", "conditions": [
            cond("Accepted", "False", "CheckpointNotHeld")]},
             spec=spec(schedule={"saveInterval": 10}, checkpoint={"pvc": "ckpt"})),
        Observed(), phase="Provisioning", conditions={"Accepted": ("True", "Accepted")},
        actions=[CreateAttempt(0, 0)], events=["Created"]),
    Row("no queue: Queued=False NoQueue once running",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0", started=ago(5)),),
                 raycluster=raycluster()),
        phase="Running", conditions={"Queued": ("False", "NoQueue"),
                                     "Preempted": ("False", "NotPreempted")},
        events=["Running"]),
]
ROWS += QUEUE_ROWS


def pod(name: str, unschedulable: str | None = None, waiting: str | None = None,
        message: str = "") -> dict[str, Any]:
    st: dict[str, Any] = {"phase": "Pending", "conditions": []}
    if unschedulable:
        st["conditions"].append({"type": "PodScheduled", "status": "False",
                                 "reason": "Unschedulable", "message": unschedulable})
    if waiting:
        st["containerStatuses"] = [{"name": "ray-head", "image": "ghcr.io/x:1",
                                    "state": {"waiting": {"reason": waiting,
                                                          "message": message}}}]
    return {"metadata": {"name": name}, "status": st}


NO_PVC = ('0/7 nodes are available: persistentvolumeclaim "models" not found. preemption: '
          '0/7 nodes are available: 7 Preemption is not helpful for scheduling.')
POD_ROWS = [
    Row("a pod that cannot be scheduled: its reason is ClusterReady's, with an Event",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "", "Initializing", cluster="c0"),),
                 raycluster=raycluster(head=False, ready=0),
                 pods=(pod("math-r0-head-x", unschedulable=NO_PVC), pod("math-r0-train-y"))),
        phase="Provisioning", conditions={"ClusterReady": ("False", "PodUnschedulable")},
        events=["PodUnschedulable"]),
    Row("the same cause already reported: no second Event",
        body(running_status(phase="Provisioning", conditions=[
            {**cond("ClusterReady", "False", "PodUnschedulable"),
             "message": f"pod math-r0-head-x: unschedulable: {NO_PVC}"}])),
        Observed(rayjobs=(rayjob(0, "", "Initializing", cluster="c0"),),
                 raycluster=raycluster(head=False, ready=0),
                 pods=(pod("math-r0-head-x", unschedulable=NO_PVC),)),
        phase="Provisioning", conditions={"ClusterReady": ("False", "PodUnschedulable")},
        events=[]),
    Row("an image that cannot be pulled",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "", "Initializing", cluster="c0"),),
                 raycluster=raycluster(head=False, ready=0),
                 pods=(pod("math-r0-head-x", waiting="ImagePullBackOff",
                           message='Back-off pulling image "ghcr.io/x:1"'),)),
        phase="Provisioning", conditions={"ClusterReady": ("False", "ImagePullFailed")},
        events=["ImagePullFailed"],
        extra={"_message": "pod math-r0-head-x: ImagePullBackOff: Back-off pulling image"}),
    Row("pods still starting (no cause): the cluster's own reason stays",
        body(running_status(phase="Provisioning")),
        Observed(rayjobs=(rayjob(0, "", "Initializing", cluster="c0"),),
                 raycluster=raycluster(ready=0), pods=(pod("math-r0-head-x"),)),
        phase="Provisioning", conditions={"ClusterReady": ("False", "WorkersNotReady")},
        events=[]),
]
ROWS += POD_ROWS

# ---- the trainer refused to start an attempt (status.trainerRefusal; status/refusal.py)

TYPO = "spec.reward: cannot import module 'rewardz' (No module named 'rewardz')"


def refusal(attempt: int = 0, message: str = TYPO) -> dict[str, Any]:
    return {"attempt": attempt, "message": message, "time": ago(5)}


REFUSAL_ROWS = [
    Row("a refusal reported, then the Ray job failed: Failed at once, no restart, the RayJob kept",
        body(running_status(phase="Provisioning", trainerRefusal=refusal())),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed", reason="AppFailed"),)),
        phase="Failed", conditions={"Failed": ("True", "InvalidAtStart"),
                                    "Accepted": ("False", "InvalidAtStart"),
                                    "Training": ("False", "InvalidAtStart")},
        actions=[], events=["InvalidAtStart"],
        extra={"restarts": 0, "completionTime": fmt_time(NOW), "rayJobName": RJ0,
               "_message": "refused to start RayJob math-r0: spec.reward: cannot import"}),
    Row("a refusal read before KubeRay saw the Ray job fail: Failed as well, nothing deleted",
        body(running_status(trainerRefusal=refusal())),
        Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()),
        phase="Failed", conditions={"Failed": ("True", "InvalidAtStart")},
        actions=[], events=["InvalidAtStart"]),
    Row("a refusal with restarts left and backoffLimit 0 alike: InvalidAtStart, not the limit",
        body(running_status(trainerRefusal=refusal()), spec=spec(backoffLimit=0)),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),)),
        phase="Failed", conditions={"Failed": ("True", "InvalidAtStart")},
        actions=[], events=["InvalidAtStart"]),
    Row("an earlier attempt's refusal says nothing about the current one: it runs on",
        body(running_status(1, restarts=1, progress={"lastHeartbeatTime": ago(1)},
                            trainerRefusal=refusal(0))),
        Observed(rayjobs=(rayjob(1, "RUNNING", "Running", cluster="c0", started=ago(9)),),
                 raycluster=raycluster()),
        phase="Running", conditions={"Accepted": ("True", "Accepted"),
                                     "Failed": ("False", "Running")}, actions=[], events=[]),
    Row("an earlier attempt's refusal: the current one's crash restarts as any crash",
        body(running_status(1, restarts=1, trainerRefusal=refusal(0))),
        Observed(rayjobs=(rayjob(1, "FAILED", "Failed", reason="AppFailed"),)),
        phase="Restarting", conditions={"Accepted": ("True", "Accepted")},
        actions=[CreateAttempt(2, 2), DeleteRayJob(RJ1)], events=["Restarting"]),
    Row("failed on a refusal: Accepted stays False, the RayJob stays, nothing more happens",
        body(running_status(phase="Failed", completionTime=ago(60), trainerRefusal=refusal(),
                            conditions=[cond("Failed", "True", "InvalidAtStart")])),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),)),
        phase="Failed", conditions={"Accepted": ("False", "InvalidAtStart"),
                                    "Failed": ("True", "InvalidAtStart")},
        actions=[], events=[]),
    Row("failed on a refusal, the spec edited since: the edit's refusal is Accepted's",
        body(running_status(phase="Failed", completionTime=ago(60), trainerRefusal=refusal()),
             spec=spec(algorithm={"lr": 0.5}), generation=2),
        Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),)),
        phase="Failed", conditions={"Accepted": ("False", "ImmutableFieldChanged")},
        actions=[], events=["ImmutableFieldChanged"]),
]
ROWS += REFUSAL_ROWS



@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_decide(row: Row) -> None:
    before = copy.deepcopy(row.body)
    d = decide(row.body, row.observed, NOW, TUN)
    assert row.body == before, "decide must not mutate its input"
    assert d.phase == row.phase
    for type_, (status, reason) in row.conditions.items():
        c = d.condition(type_)
        assert (c["status"], c["reason"]) == (status, reason), (type_, c)
    assert list(d.actions) == row.actions
    if row.events or not row.actions:
        assert [e.reason for e in d.events] == row.events
    for key, value in row.extra.items():
        if key == "_message":  # words the events must say
            assert any(value in e.message for e in d.events), d.events
            continue
        assert d.status.get(key) == value, key
    assert [c["type"] for c in d.status["conditions"]] == [
        "Accepted", "SpecWarning", "Queued", "ClusterReady", "Training", "Stalled", "Preempted",
        "Suspended", "Succeeded", "Failed"]
    assert "progress" not in d.status, "the operator never writes progress"
    assert "trainerRefusal" not in d.status, "nor the trainer's refusal"


def _apply(b: dict[str, Any], d: Decision) -> dict[str, Any]:
    out = copy.deepcopy(b)
    status = dict(out.get("status") or {})
    for k, v in (d.status_patch(status) or {}).items():
        if v is None:
            status.pop(k, None)
        else:
            status[k] = v
    out["status"] = status
    return out


def test_steady_state_is_a_fixed_point() -> None:
    """Feeding the decision back in yields no patch, no action and no event (no hot loop)."""
    b = body(running_status(progress={"lastHeartbeatTime": ago(10)}))
    obs = Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster())
    first = decide(b, obs, NOW, TUN)
    b2 = _apply(b, first)
    second = decide(b2, obs, NOW + timedelta(seconds=5), TUN)
    assert second.status_patch(b2["status"]) is None
    assert second.actions == () and second.events == ()


def test_transition_time_carried_over_while_status_unchanged() -> None:
    b = body(running_status(progress={"lastHeartbeatTime": ago(10)}))
    obs = Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster())
    d = decide(b, obs, NOW, TUN)
    assert d.condition("Training")["lastTransitionTime"] == ago(3600)
    assert d.condition("Accepted")["lastTransitionTime"] == ago(3600)
    assert d.condition("Stalled")["lastTransitionTime"] == fmt_time(NOW)


def test_fresh_job_walkthrough() -> None:
    """Create -> provisioning -> running -> succeeded -> TTL, feeding each status back."""
    b = body(spec=spec(ttlSecondsAfterFinished=10))
    t = NOW
    d = decide(b, Observed(), t, TUN)
    assert d.actions == (CreateAttempt(0, 0),)
    b = _apply(b, d)
    steps = [
        (rayjob(0, "", "Initializing"), None, "Provisioning"),
        (rayjob(0, "RUNNING", "Running", cluster="c0", started=fmt_time(t)), raycluster(),
         "Running"),
        (rayjob(0, "SUCCEEDED", "Complete", cluster="c0"), None, "Succeeded"),
    ]
    for rj, rc, phase in steps:
        t += timedelta(seconds=5)
        d = decide(b, Observed(rayjobs=(rj,), raycluster=rc), t, TUN)
        assert d.phase == phase
        assert not [a for a in d.actions if isinstance(a, CreateAttempt)]
        b = _apply(b, d)
    done = Observed(rayjobs=(steps[-1][0],))
    # ttl 10 s, counted from the end of completionTime's (whole) second
    assert decide(b, done, t + timedelta(seconds=10), TUN).actions == ()
    assert decide(b, done, t + timedelta(seconds=11), TUN).actions == (DeleteRLJob(),)


def test_a_refusal_read_after_the_restart_fails_only_the_attempt_it_names() -> None:
    """The trainer's refusal and its Ray job's failure may be read in either order. Read
    second, the refusal of attempt 0 comes after the restart as attempt 1 and is ignored;
    attempt 1 refuses for itself and the job fails then, with one restart spent, not
    backoffLimit's."""
    b = body(running_status())
    d = decide(b, Observed(rayjobs=(rayjob(0, "FAILED", "Failed"),)), NOW, TUN)
    assert d.phase == "Restarting" and CreateAttempt(1, 1) in d.actions
    b = _apply(b, d)
    b["status"]["trainerRefusal"] = refusal(0)  # the trainer's patch, read late
    provisioning = Observed(rayjobs=(rayjob(1, "", "Initializing", restarts=1),))
    d = decide(b, provisioning, NOW + timedelta(seconds=5), TUN)
    assert d.phase == "Provisioning" and d.condition("Accepted")["status"] == "True"
    assert not [a for a in d.actions if isinstance(a, CreateAttempt)] and not d.events
    b = _apply(b, d)
    b["status"]["trainerRefusal"] = refusal(1)  # attempt 1 refuses too
    d = decide(b, Observed(rayjobs=(rayjob(1, "RUNNING", "Running", restarts=1),)),
               NOW + timedelta(seconds=10), TUN)
    assert d.phase == "Failed" and d.condition("Failed")["reason"] == "InvalidAtStart"
    assert d.actions == () and d.status["restarts"] == 1
    assert "refused to start RayJob math-r1: spec.reward:" in d.condition("Failed")["message"]
    b = _apply(b, d)
    again = decide(b, Observed(rayjobs=(rayjob(1, "FAILED", "Failed", restarts=1),)),
                   NOW + timedelta(seconds=15), TUN)
    assert again.status_patch(b["status"]) is None
    assert again.actions == () and again.events == ()


def test_the_finishing_decision_schedules_the_ttl() -> None:
    """The pass that finishes a job wakes the operator at the TTL's expiry itself: nothing
    else is due to (its own status patch's watch event may never come, the resync is long)."""
    b = body(running_status(), spec=spec(ttlSecondsAfterFinished=60))
    d = decide(b, Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete"),)), NOW, TUN)
    assert d.phase == "Succeeded" and d.requeue_at == NOW + timedelta(seconds=61)


def test_requeue_at_points_at_the_next_time_based_change() -> None:
    b = body(running_status(progress={"lastHeartbeatTime": ago(10)}, startTime=ago(100)),
             spec=spec(activeDeadlineSeconds=1000))
    d = decide(b, Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster()), NOW, TUN)
    assert d.requeue_at == NOW + timedelta(seconds=290)  # heartbeat (300 s) before the deadline


def test_status_patch_only_touches_owned_keys() -> None:
    b = body(running_status(progress={"step": 3, "lastHeartbeatTime": ago(10)}))
    d = decide(b, Observed(), NOW, TUN)
    patch = d.status_patch(b["status"])
    assert patch is not None and "progress" not in patch
    assert set(patch) <= {"phase", "conditions", "observedGeneration", "restarts", "rayJobName",
                          "startTime", "completionTime", "specDigests"}


def test_attempt_of() -> None:
    assert attempt_of(JOB, RJ1) == 1
    assert attempt_of(JOB, rayjob(7)) == 7
    assert attempt_of(JOB, "other-r1") is None
    assert attempt_of(JOB, f"{JOB}-rx") is None
    assert attempt_of(JOB, None) is None


def test_digests_ignore_defaults_and_name_sections() -> None:
    assert digests() == digests(algorithm={})
    changed = {k for k, v in digests(algorithm={"lr": 0.5}).items() if digests()[k] != v}
    assert changed == {"algorithm"}


def test_unheld_checkpoints_names_the_field_and_spares_the_examples() -> None:
    from pathlib import Path

    import yaml

    from kuberl_api import parse
    from kuberl_operator.status.phases import unheld_checkpoints

    def job(**extra: Any) -> Any:
        return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "j", "namespace": "n"}, "spec": spec(**extra)})

    message = unheld_checkpoints(job(schedule={"saveInterval": 5}))
    assert message is not None and message.startswith("spec.checkpoint.pvc: ")
    assert unheld_checkpoints(job()) is None  # no saves asked for: a restart starts over
    assert unheld_checkpoints(job(schedule={"saveInterval": 5}, checkpoint={"pvc": "c"})) is None
    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        assert unheld_checkpoints(parse(yaml.safe_load(path.read_text()))) is None, path


@pytest.mark.parametrize(("phase", "beat", "started", "words"), [
    ("EnginesStarting", 20, 2000, "trainer starting on RayJob rlj-r0: waiting for the engines"),
    ("Loading", 20, 2000, "loading the models (Loading)"),
    ("Training", 20, 2000, "training on RayJob rlj-r0 at step 7"),
    # a phase an earlier attempt reported (before this Ray job started) is not this one's
    ("Loading", 200, 100, "training on RayJob rlj-r0 at step 7"),
])
def test_training_message_says_the_trainers_start_up_phase(phase: str, beat: int, started: int,
                                                           words: str) -> None:
    from kuberl_api.status import STARTUP_PHASES
    from kuberl_operator.status.running import STARTUP_WORDS

    assert set(STARTUP_WORDS) == set(STARTUP_PHASES)
    b = body(running_status(progress={"step": 7, "lastHeartbeatTime": ago(beat),
                                      "trainerPhase": phase}))
    d = decide(b, Observed(rayjobs=(rayjob(0, "RUNNING", "Running", cluster="c0",
                                           started=ago(started)),),
                           raycluster=raycluster()), NOW, TUN)
    training = d.condition("Training")
    assert training["status"] == "True"
    assert words.replace("rlj-r0", RJ0) in training["message"], training["message"]
