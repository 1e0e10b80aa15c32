"""Kueue in the local control plane, at the RayJob level (no kuberl operator): Kueue's
``ray.io/rayjob`` integration admits suspended RayJobs against a ClusterQueue's quota, keeps
what does not fit suspended, and preempts a lower-priority RayJob for a higher one. KubeRay
plays its part: an unsuspended RayJob gets its RayCluster, a re-suspended one loses it.

A RayJob here fails 30 s after its submitter "completes" (see README, KubeRay on kwok), and a
finished job frees its quota: each test does what it asserts well within those 30 s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from queues import (
    create,
    delete,
    make_queues,
    priority_class,
    queue_labels,
    workload_of,
)
from rljobs import RAYCLUSTERS, RAYJOBS, condition, namespace, unique

pytestmark = [pytest.mark.e2e, pytest.mark.kuberay]

RAY_IMAGE = "rayproject/ray:2.49.0"  # never pulled: kwok runs no containers
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def rayjob(name: str, ns: str, labels: dict[str, str], gpus: int = 8) -> dict[str, Any]:
    """A small suspended RayJob: a head on the cpu pool, one GPU worker on the train pool."""
    def container(kind: str, resources: dict[str, str]) -> dict[str, Any]:
        return {"name": f"ray-{kind}", "image": RAY_IMAGE,
                "resources": {"requests": resources, "limits": resources}}

    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "suspend": True,  # Kueue unsuspends it once admitted
            "entrypoint": "python -c 'print(1)'",
            "shutdownAfterJobFinishes": True,  # Kueue refuses a RayJob that keeps its cluster
            "rayClusterSpec": {
                "rayVersion": "2.49.0",
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
                    "nodeSelector": {"pool": "cpu"},
                    "containers": [container("head", {"cpu": "2", "memory": "4Gi"})]}}},
                "workerGroupSpecs": [{
                    "groupName": "train", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                    "rayStartParams": {}, "template": {"spec": {
                        "nodeSelector": {"pool": "train"}, "tolerations": [GPU_TOLERATION],
                        "containers": [container("worker", {
                            "cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus)})]}}}],
            },
        },
    }


@pytest.fixture(scope="module")
def ns(k8s_cluster: Cluster, kueue: Cluster) -> Iterator[str]:
    with namespace(k8s_cluster, "e2e-kueue") as name:
        yield name


def submit(c: Cluster, ns: str, name: str, labels: dict[str, str]) -> str:
    c.api().create(RAYJOBS.format(ns=ns), rayjob(name, ns, labels))
    return name


def get_rayjob(c: Cluster, ns: str, name: str) -> dict[str, Any]:
    job: dict[str, Any] = c.api().get(f"{RAYJOBS.format(ns=ns)}/{name}") or {}
    return job


def workload(c: Cluster, ns: str, job: str) -> dict[str, Any]:
    return workload_of(c, ns, "RayJob", job) or {}


def rayclusters_of(c: Cluster, ns: str, job: str) -> list[dict[str, Any]]:
    items = (c.api().get(RAYCLUSTERS.format(ns=ns)) or {}).get("items", [])
    return [rc for rc in items if any(o.get("kind") == "RayJob" and o.get("name") == job
                                      for o in rc["metadata"].get("ownerReferences", []))]


def wait_admitted(c: Cluster, ns: str, job: str, timeout: float = 60) -> dict[str, Any]:
    """Workload Admitted, RayJob unsuspended, RayCluster created by KubeRay; the Workload."""
    wl: dict[str, Any] = wait_for(
        f"the Workload of RayJob {job} admitted",
        lambda: (w := workload(c, ns, job)) and condition(w, "Admitted").get("status") == "True"
        and w, timeout=timeout, detail=lambda: str(workload(c, ns, job).get("status")))
    wait_for(f"RayJob {job} unsuspended",
             lambda: not get_rayjob(c, ns, job)["spec"].get("suspend"), timeout=timeout)
    wait_for(f"KubeRay's RayCluster for {job}", lambda: rayclusters_of(c, ns, job),
             timeout=timeout)
    return wl


def running_pods(c: Cluster, ns: str, raycluster: str) -> list[dict[str, Any]]:
    pods = c.api().get(f"/api/v1/namespaces/{ns}/pods?labelSelector=ray.io/cluster%3D{raycluster}")
    return [p for p in (pods or {}).get("items", []) if p["status"].get("phase") == "Running"]


def pending_condition(c: Cluster, ns: str, job: str) -> dict[str, Any]:
    cond: dict[str, Any] = wait_for(
        f"the Workload of RayJob {job} pending on quota",
        lambda: (q := condition(workload(c, ns, job), "QuotaReserved"))
        and q["status"] == "False" and q.get("message") and q, timeout=60)
    return cond


def test_suspended_rayjob_is_admitted_and_runs(k8s_cluster: Cluster, ns: str) -> None:
    c = k8s_cluster
    q = make_queues(c, ns, unique("cq-admit"), gpu=16, cpu=64, memory="256Gi")
    job = submit(c, ns, unique("admitted"), queue_labels(q.local_queue))
    wl = wait_admitted(c, ns, job)
    admission = wl["status"]["admission"]
    assert admission["clusterQueue"] == q.cluster_queue
    flavors = {f for ps in admission["podSetAssignments"] for f in ps["flavors"].values()}
    assert flavors == {q.flavor}
    # The RayCluster's pods run on their pools (KubeRay and the scheduler, after Kueue).
    rc = rayclusters_of(c, ns, job)[0]["metadata"]["name"]
    wait_for("the RayCluster's head and worker Running", lambda: len(running_pods(c, ns, rc)) == 2,
             timeout=60)
    delete_rayjob(c, ns, job)


def delete_rayjob(c: Cluster, ns: str, job: str) -> None:
    c.kubectl("delete", "rayjob", job, "-n", ns, "--wait=false")


def test_second_rayjob_waits_for_quota_until_the_first_is_deleted(k8s_cluster: Cluster,
                                                                  ns: str) -> None:
    c = k8s_cluster
    q = make_queues(c, ns, unique("cq-one"), gpu=8, cpu=32, memory="128Gi")
    first = submit(c, ns, unique("first"), queue_labels(q.local_queue))
    wait_admitted(c, ns, first)
    second = submit(c, ns, unique("second"), queue_labels(q.local_queue))
    cond = pending_condition(c, ns, second)
    assert cond["reason"] == "Pending", cond
    # Kueue's own words: "couldn't assign flavors to pod set train: insufficient unused quota
    # for nvidia.com/gpu in flavor default-flavor, 8 more needed"
    assert "insufficient unused quota for nvidia.com/gpu" in cond["message"], cond
    assert get_rayjob(c, ns, second)["spec"]["suspend"] is True
    assert not rayclusters_of(c, ns, second)
    delete_rayjob(c, ns, first)
    # The first Workload goes with its RayJob (garbage collection) and frees the quota.
    wait_admitted(c, ns, second, timeout=90)
    delete_rayjob(c, ns, second)


def test_higher_priority_rayjob_preempts_a_lower_one(k8s_cluster: Cluster, ns: str) -> None:
    c = k8s_cluster
    low_pc, high_pc = unique("low"), unique("high")
    create(c, priority_class(low_pc, 100))
    create(c, priority_class(high_pc, 1000))
    q = make_queues(c, ns, unique("cq-preempt"), gpu=8, cpu=32, memory="128Gi",
                    preemption="LowerPriority")
    low = submit(c, ns, unique("low"), queue_labels(q.local_queue, priority=low_pc))
    wl_low = wait_admitted(c, ns, low)
    assert wl_low["spec"]["priority"] == 100
    high = submit(c, ns, unique("high"), queue_labels(q.local_queue, priority=high_pc))
    evicted = wait_for(f"the Workload of {low} evicted", lambda: (
        e := condition(workload(c, ns, low), "Evicted")) and e["status"] == "True" and e,
        timeout=60)
    assert evicted["reason"] == "Preempted", evicted
    preempted = condition(workload(c, ns, low), "Preempted")
    assert preempted.get("status") == "True" and preempted["reason"] == "InClusterQueue"
    wait_for(f"RayJob {low} suspended again",
             lambda: get_rayjob(c, ns, low)["spec"].get("suspend") is True)
    wait_for(f"KubeRay deleted {low}'s RayCluster", lambda: not rayclusters_of(c, ns, low),
             timeout=60)
    wait_admitted(c, ns, high)
    for job in (low, high):
        delete_rayjob(c, ns, job)
    for pc in (low_pc, high_pc):
        delete(c, priority_class(pc, 0))
