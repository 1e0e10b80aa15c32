"""Read what the decision needs: the RLJob's RayJobs, the current attempt's RayCluster (and its
pods while it is not ready), with a Kueue queue its Workload, and whether the job's
PriorityClass and its code's ConfigMap exist.

Direct reads (not a watch cache): right after creating attempt N+1 a cache may not have it yet,
and "the current RayJob is missing" is a decision (a restart), so it must be authoritative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kuberl_operator.reconcile.children import owned_by
from kuberl_operator.reconcile.kube import RAYCLUSTER, RAYJOB, APIError, Kind, Kube, NotFound
from kuberl_operator.render import names
from kuberl_operator.status import Observed, attempt_of

# Kueue's Workload API (v1beta2, its storage version since v0.15), and the label by which
# Kueue ties a Workload to the job it was made for.
WORKLOAD = Kind("kueue.x-k8s.io/v1beta2", "workloads")
POD = Kind("v1", "pods")
CONFIGMAP = Kind("v1", "configmaps")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
FORBIDDEN = 403


async def observe(kube: Kube, job: Mapping[str, Any]) -> Observed:
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rayjobs = tuple(rj for rj in await kube.list(RAYJOB.collection(namespace),
                                                  names.selector(name))
                    if owned_by(rj, uid))
    current = max(rayjobs, key=lambda rj: attempt_of(name, rj) or 0, default=None)
    cluster_name = ((current or {}).get("status") or {}).get("rayClusterName")
    cluster = await kube.get(RAYCLUSTER.url(namespace, cluster_name)) if cluster_name else None
    pods: list[dict[str, Any]] = []
    if current is not None and ((cluster or {}).get("status") or {}).get("state") != "ready":
        # (only while it is not up: the reasons a pod does not come up are on the pods)
        attempt = attempt_of(name, current)
        pods = await kube.list(POD.collection(namespace),
                               {**names.selector(name), names.LABEL_ATTEMPT: str(attempt)})
    scheduling = (job.get("spec") or {}).get("scheduling") or {}
    workload = None
    if scheduling.get("queueName") and current is not None:
        workload = await _workload(kube, namespace, str(current["metadata"].get("uid")))
    # Only a pass that may create an attempt reads it (not every pass of a running job).
    creating = current is None or bool((current.get("metadata") or {}).get("deletionTimestamp"))
    missing = (await _missing_priority_class(kube, scheduling.get("priorityClassName"))
               if creating else None)
    code = (job.get("spec") or {}).get("code") or {}
    no_code = (await _missing_configmap(kube, namespace, code.get("configMap"))
               if creating else None)
    return Observed(rayjobs=rayjobs, raycluster=cluster, workload=workload,
                    priority_class_problem=missing, code_problem=no_code, pods=tuple(pods))


async def _workload(kube: Kube, namespace: str, rayjob_uid: str) -> Mapping[str, Any] | None:
    """Kueue's Workload of the RayJob, or None (not made yet, or Kueue is not installed: its
    API is then absent, which the Queued condition tells the user)."""
    try:
        found = await kube.list(WORKLOAD.collection(namespace), {KUEUE_JOB_UID_LABEL: rayjob_uid})
    except NotFound:
        return None
    return max(found, key=lambda w: str(w["metadata"].get("creationTimestamp") or ""),
               default=None)


async def _missing_configmap(kube: Kube, namespace: str, name: object) -> str | None:
    """The API server's answer when spec.code.configMap names no ConfigMap (its pods would
    wait in ContainerCreating, with the reason only in the kubelet's FailedMount Events);
    None when it exists or is unset. A missing spec.code.pvc needs no such read: the
    scheduler reports it on the pods (PodUnschedulable, status/pods.py)."""
    if not isinstance(name, str) or not name:
        return None
    try:
        found = await kube.get(CONFIGMAP.url(namespace, name))
    except APIError as exc:
        if getattr(exc, "status", None) == FORBIDDEN:
            return None
        raise
    return None if found is not None else f'configmaps "{name}" not found'


async def _missing_priority_class(kube: Kube, name: object) -> str | None:
    """The API server's answer when spec.scheduling.priorityClassName names no PriorityClass;
    None when it exists, is unset, or may not be read (namespaced installs: the pods'
    creation then reports it)."""
    if not isinstance(name, str) or not name:
        return None
    try:
        found = await kube.get(f"{PRIORITY_CLASSES}/{name}")
    except APIError as exc:
        if getattr(exc, "status", None) == FORBIDDEN:
            return None
        raise
    if found is not None:
        return None
    return f'priorityclasses.scheduling.k8s.io "{name}" not found'
