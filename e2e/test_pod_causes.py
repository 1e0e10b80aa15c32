"""Why a job's pods do not come up, in the RLJob's own status: a new user's first job often
names PVCs that do not exist, and KubeRay says only "head pod not ready" while the cause is on
the pods (the real kube-scheduler's message)."""

from __future__ import annotations

import pytest
from cluster import Cluster
from polling import wait_for
from rljobs import JobWatch, Operator, condition, cpu_job, events_for, kubectl_apply

pytestmark = [pytest.mark.e2e, pytest.mark.kuberay]


def test_a_missing_pvc_is_named_in_cluster_ready(k8s_cluster: Cluster, operator: Operator,
                                                 operator_ns: str) -> None:
    c, ns, job = k8s_cluster, operator_ns, "no-pvc"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, model={"path": "/models/tiny", "storage": {
        "pvc": "models-nobody-made", "mountPath": "/models"}}), check=True)
    try:
        ready = wait_for("ClusterReady naming the missing PVC", lambda: (
            r := condition(w.get(), "ClusterReady")).get("reason") == "PodUnschedulable" and r,
            timeout=90, detail=w.detail)
        assert ready["status"] == "False", ready
        assert 'persistentvolumeclaim "models-nobody-made" not found' in ready["message"], ready
        warned = wait_for("a PodUnschedulable Event", lambda: [
            e for e in events_for(c.api(), ns, job) if e["reason"] == "PodUnschedulable"])
        assert warned[0]["type"] == "Warning" and "models-nobody-made" in warned[0]["message"]
        described = c.kubectl("describe", "rljob", job, "-n", ns).stdout
        assert "models-nobody-made" in described
    finally:
        w.delete_and_wait_gc()
