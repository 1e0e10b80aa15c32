#!/usr/bin/env python3
"""End-to-end check of the local control plane: a RayCluster through KubeRay onto the kwok pools.

    python e2e/smoke.py                 # against the cluster `e2e/cluster.py up` left running
    python e2e/smoke.py --state-dir D   # against another one
    pytest e2e -m e2e                   # the same, as a test, on a cluster of its own

It applies a RayCluster (ray.io/v1) with a head group on the cpu pool and GPU worker groups on
the train and rollout pools, then checks that KubeRay makes the pods, the scheduler binds each to
a node of the right pool (the 8-GPU workers one a node), kwok makes them Running and Ready,
KubeRay reports `status.state: ready`, and that deleting the RayCluster garbage-collects its pods
and Service.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Cluster, ClusterError

RAY_IMAGE = "rayproject/ray:2.49.0"  # never pulled: kwok runs no containers


def raycluster(name: str, namespace: str = "default") -> dict[str, Any]:
    def container(kind: str, resources: dict[str, str]) -> dict[str, Any]:
        return {"name": f"ray-{kind}", "image": RAY_IMAGE,
                "resources": {"requests": resources, "limits": resources}}

    gpu_tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "rayVersion": "2.49.0",
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0"},
                "template": {"spec": {
                    "nodeSelector": {"pool": "cpu"},
                    "containers": [container("head", {"cpu": "4", "memory": "16Gi"})]}},
            },
            "workerGroupSpecs": [
                {"groupName": "train", "replicas": 2, "minReplicas": 2, "maxReplicas": 2,
                 "rayStartParams": {},
                 "template": {"spec": {
                     "nodeSelector": {"pool": "train"},
                     "tolerations": [gpu_tol],
                     "containers": [container("worker", {"cpu": "64", "memory": "800Gi",
                                                         "nvidia.com/gpu": "8"})]}}},
                {"groupName": "rollout", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                 "rayStartParams": {},
                 "template": {"spec": {
                     "nodeSelector": {"pool": "rollout"},
                     "tolerations": [{"key": "dedicated", "operator": "Equal",
                                      "value": "rollout", "effect": "NoSchedule"}, gpu_tol],
                     "containers": [container("worker", {"cpu": "32", "memory": "400Gi",
                                                         "nvidia.com/gpu": "8"})]}}},
            ],
        },
    }


def _wait(what: str, timeout: float, fn: Callable[[], Any], interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def _pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status", {})
    return st.get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))


def check_raycluster(cluster: Cluster, name: str = "smoke", namespace: str = "default",
                     timeout: float = 120, say: Callable[[str], None] = print) -> dict[str, float]:
    """Run the checks; raise AssertionError on the first that fails. Returns timings (s)."""
    api = cluster.api()
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # The controller-manager runs each controller as its own ServiceAccount.
    sas = {sa["metadata"]["name"] for sa in
           api.get("/api/v1/namespaces/kube-system/serviceaccounts")["items"]}
    assert {"generic-garbage-collector", "replicaset-controller"} <= sas, sorted(sas)

    cluster.kubectl("apply", "-f", "-", input=json.dumps(raycluster(name, namespace)))
    selector = f"ray.io/cluster={name}"
    pods_path = f"/api/v1/namespaces/{namespace}/pods?labelSelector=ray.io%2Fcluster%3D{name}"

    def pods() -> list[dict[str, Any]]:
        return list(api.get(pods_path)["items"])

    _wait("4 pods of the RayCluster", timeout, lambda: len(pods()) == 4)
    timings["pods created"] = time.monotonic() - t0
    _wait("all pods Running and Ready", timeout, lambda: all(_pod_ready(p) for p in pods()))
    timings["pods ready"] = time.monotonic() - t0

    nodes = {n["metadata"]["name"]: n["metadata"]["labels"].get("pool")
             for n in api.get("/api/v1/nodes")["items"]}
    by_group: dict[str, list[str]] = {}
    for p in pods():
        labels = p["metadata"]["labels"]
        group = "head" if labels.get("ray.io/node-type") == "head" else labels["ray.io/group"]
        by_group.setdefault(group, []).append(p["spec"]["nodeName"])
        owners = [o["kind"] for o in p["metadata"].get("ownerReferences", [])]
        assert owners == ["RayCluster"], (p["metadata"]["name"], owners)
    say(f"pods by group -> nodes: {by_group}")
    expect_pool = {"head": "cpu", "train": "train", "rollout": "rollout"}
    for group, placed in by_group.items():
        pools = {nodes[n] for n in placed}
        assert pools == {expect_pool[group]}, (group, placed, pools)
    assert len(by_group["train"]) == 2 and len(set(by_group["train"])) == 2, by_group

    rc_path = f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters/{name}"
    _wait("RayCluster status.state == ready", timeout,
          lambda: api.get(rc_path).get("status", {}).get("state") == "ready")
    timings["raycluster ready"] = time.monotonic() - t0
    status = api.get(rc_path)["status"]
    say("RayCluster status: " + json.dumps(
        {k: status.get(k) for k in ("state", "readyWorkerReplicas", "desiredWorkerReplicas",
                                    "desiredGPU", "head")}))
    assert status["readyWorkerReplicas"] == 3, status
    svc_path = f"/api/v1/namespaces/{namespace}/services?labelSelector=ray.io%2Fcluster%3D{name}"
    assert api.get(svc_path)["items"], "KubeRay made no head Service"

    # Deleting the RayCluster: the garbage collector removes its pods and Service (owner
    # references), and kwok finalizes the pods (no kubelet does it).
    t1 = time.monotonic()
    cluster.kubectl("delete", "raycluster", name, "-n", namespace, "--wait=false")
    _wait("the RayCluster's pods to be garbage-collected", timeout, lambda: not pods())
    _wait("the RayCluster's Services to be garbage-collected", timeout,
          lambda: not api.get(svc_path)["items"])
    _wait("the RayCluster to be gone", timeout, lambda: api.get(rc_path) is None)
    timings["gc"] = time.monotonic() - t1
    say(f"kubectl get pods -l {selector}: none left")
    return {k: round(v, 2) for k, v in timings.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    try:
        cluster = Cluster.attach(args.state_dir)
    except ClusterError as e:
        print(f"smoke.py: {e}; start one with `python e2e/cluster.py up`", file=sys.stderr)
        return 2
    timings = check_raycluster(cluster, timeout=args.timeout)
    print(f"smoke: OK {timings}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
