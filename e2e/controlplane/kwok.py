"""kwok, the fake kubelet, and the fake node pools it runs.

kwok manages every node annotated ``kwok.x-k8s.io/node=fake`` with its stock stages: Ready nodes
with leases, pods that become Running and Ready, Job pods that complete, deleted pods finalized.
The pools' labels and taints follow the examples/ RLJobs: the training pool is picked by the
GPU-feature-discovery label nvidia.com/gpu.product, the rollout pool by pool=rollout, and both
GPU pools carry the usual nvidia.com/gpu taint; the rollout pool is also kept for inference by
dedicated=rollout. Ray heads (no GPU) go to the untainted cpu pool."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .api import Api
from .base import POD_CIDR, Component, wait
from .boot import Boot

KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

GPU_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": "81559",
    "node.kubernetes.io/instance-type": "p5.48xlarge",
}
GPU_CAPACITY = {
    "cpu": "192",
    "memory": "2000Gi",
    "pods": "110",
    "ephemeral-storage": "7Ti",
    "nvidia.com/gpu": "8",
    "rdma/rdma_shared_device_a": "1k",
}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Pool:
    name: str
    labels: Mapping[str, str]
    taints: Sequence[Mapping[str, str]]
    capacity: Mapping[str, str]


POOLS: dict[str, Pool] = {
    "train": Pool("train", {"pool": "train", **GPU_LABELS}, [GPU_TAINT], GPU_CAPACITY),
    "rollout": Pool(
        "rollout",
        {"pool": "rollout", **GPU_LABELS},
        [{"key": "dedicated", "value": "rollout", "effect": "NoSchedule"}, GPU_TAINT],
        GPU_CAPACITY,
    ),
    "cpu": Pool(
        "cpu",
        {"pool": "cpu", "node.kubernetes.io/instance-type": "m7i.16xlarge"},
        [],
        {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"},
    ),
}
DEFAULT_NODES = {"train": 2, "rollout": 2, "cpu": 1}

COMPONENT = Component("kwok", ("kwok",), lambda p: f"http://127.0.0.1:{p['kwok']}/healthz")


def node_manifest(pool: Pool, index: int) -> dict[str, Any]:
    name = f"kwok-{pool.name}-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
            "labels": {
                "type": "kwok",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/os": "linux",
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": "local-a",
                **pool.labels,
            },
        },
        "spec": {"taints": [dict(t) for t in pool.taints]},
        "status": {
            "capacity": dict(pool.capacity),
            "allocatable": dict(pool.capacity),
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
        },
    }


def node_ready(node: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in node.get("status", {}).get("conditions", []))


def spawn(boot: Boot) -> None:
    """kwok with the stock stages, managing the nodes annotated as fake."""
    stages = boot.bins.kwok_stages
    stage_files = [stages / "node/fast/node-initialize.yaml",
                   stages / "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                   stages / "pod/fast/pod-ready.yaml", stages / "pod/fast/pod-complete.yaml",
                   stages / "pod/fast/pod-delete.yaml"]
    boot.spawn("kwok", [
        boot.bin("kwok"), f"--kubeconfig={boot.cluster.kubeconfig}",
        *[f"--config={f}" for f in stage_files],
        "--manage-nodes-with-annotation-selector="
        f"{KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
        "--node-lease-duration-seconds=40", f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1",
        f"--server-address=127.0.0.1:{boot.cluster.ports['kwok']}"])


def create_nodes(api: Api, pool: str, indices: range) -> list[str]:
    """Create the nodes `kwok-<pool>-<i>` (kwok makes them Ready); their names."""
    names = []
    for i in indices:
        manifest = node_manifest(POOLS[pool], i)
        api.create("/api/v1/nodes", manifest)
        names.append(manifest["metadata"]["name"])
    return names


def all_ready(api: Api, names: Sequence[str]) -> bool:
    return all(node_ready(api.get(f"/api/v1/nodes/{n}") or {}) for n in names)


def wait_ready(boot: Boot, names: Sequence[str]) -> None:
    api = boot.cluster.api()
    boot.wait_for("kwok", f"{len(names)} nodes Ready", lambda: all_ready(api, names))


def add_nodes(api: Api, pool: str, count: int, start_index: int | None, timeout: float,
              ) -> list[str]:
    """`count` more nodes in `pool` on a running cluster, Ready."""
    if start_index is None:
        existing = api.get(f"/api/v1/nodes?labelSelector=pool%3D{pool}") or {"items": []}
        start_index = len(existing["items"])
    names = create_nodes(api, pool, range(start_index, start_index + count))
    wait(f"nodes {names} Ready", timeout, lambda: all_ready(api, names))
    return names

