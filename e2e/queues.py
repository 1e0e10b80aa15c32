"""Kueue's queueing objects for the e2e tests: a ResourceFlavor, a ClusterQueue with GPU, CPU
and memory quota, a LocalQueue in a namespace, WorkloadPriorityClasses; and reading a RayJob's
Workload. Needs Kueue running (`Cluster.start_kueue()`, the `kueue` fixture).

    flavor = create(cluster, resource_flavor("gpu"))
    make_queues(cluster, ns, "team-a", gpu=16, cpu=128, memory="1Ti",
                preemption="LowerPriority")        # ClusterQueue team-a, LocalQueue team-a in ns
    rayjob["metadata"]["labels"] = queue_labels("team-a", priority="high")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster import Cluster, ClusterError

GROUP_VERSION = "kueue.x-k8s.io/v1beta2"
API = f"/apis/{GROUP_VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GPU = "nvidia.com/gpu"


def resource_flavor(name: str, node_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A ResourceFlavor; `node_labels` pins the pods it admits to those nodes (e.g. a pool)."""
    spec = {"nodeLabels": dict(node_labels)} if node_labels else {}
    return {"apiVersion": GROUP_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": spec}


def cluster_queue(name: str, flavor: str, *, gpu: int | str, cpu: int | str,
                  memory: int | str, preemption: str | None = None) -> dict[str, Any]:
    """A ClusterQueue for every namespace with one flavor's nominal quota of nvidia.com/gpu, cpu
    and memory; `preemption` is spec.preemption.withinClusterQueue (Never, LowerPriority,
    LowerOrNewerEqualPriority)."""
    quota = [{"name": r, "nominalQuota": str(q)}
             for r, q in (("cpu", cpu), ("memory", memory), (GPU, gpu))]
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": ["cpu", "memory", GPU],
                            "flavors": [{"name": flavor, "resources": quota}]}],
    }
    if preemption:
        spec["preemption"] = {"withinClusterQueue": preemption}
    return {"apiVersion": GROUP_VERSION, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": spec}


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {"apiVersion": GROUP_VERSION, "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue_name}}


def priority_class(name: str, value: int, description: str = "") -> dict[str, Any]:
    return {"apiVersion": GROUP_VERSION, "kind": "WorkloadPriorityClass",
            "metadata": {"name": name}, "value": value, "description": description}


PLURALS = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues",
           "LocalQueue": "localqueues", "WorkloadPriorityClass": "workloadpriorityclasses",
           "Workload": "workloads"}


def _path(obj: Mapping[str, Any]) -> str:
    plural = PLURALS[obj["kind"]]
    ns = obj["metadata"].get("namespace")
    return f"{API}/namespaces/{ns}/{plural}" if ns else f"{API}/{plural}"


def create(cluster: Cluster, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create a Kueue object (left as it is if it exists); the object as the server has it."""
    api = cluster.api()
    api.create(_path(obj), obj)
    got: dict[str, Any] = api.get(f"{_path(obj)}/{obj['metadata']['name']}")
    return got


def delete(cluster: Cluster, obj: Mapping[str, Any]) -> None:
    cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"],
                    *(["-n", obj["metadata"]["namespace"]] if obj["metadata"].get("namespace")
                      else []), "--ignore-not-found", "--wait=false")


@dataclass(frozen=True)
class Queues:
    flavor: str
    cluster_queue: str
    local_queue: str
    namespace: str


def make_queues(cluster: Cluster, namespace: str, name: str, *, gpu: int | str,
                cpu: int | str, memory: int | str, flavor: str = "default-flavor",
                preemption: str | None = None) -> Queues:
    """ResourceFlavor `flavor` (no node labels: any node), ClusterQueue `name` with that quota,
    LocalQueue `name` in `namespace` pointing at it; waits until the ClusterQueue is Active."""
    create(cluster, resource_flavor(flavor))
    create(cluster, cluster_queue(name, flavor, gpu=gpu, cpu=cpu, memory=memory,
                                  preemption=preemption))
    create(cluster, local_queue(namespace, name, name))
    cluster.kubectl("wait", "--for=condition=Active", f"clusterqueue/{name}", "--timeout=60s",
                    timeout=70)
    return Queues(flavor, name, name, namespace)


def queue_labels(local_queue_name: str, priority: str | None = None) -> dict[str, str]:
    """The labels that put a job into a LocalQueue (and give it a WorkloadPriorityClass)."""
    labels = {QUEUE_LABEL: local_queue_name}
    if priority:
        labels[PRIORITY_LABEL] = priority
    return labels


def workload_of(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    """The Workload Kueue made for a job (found by its owner reference), or None yet."""
    items = (cluster.api().get(f"{API}/namespaces/{namespace}/workloads") or {}).get("items", [])
    mine = [w for w in items if any(o.get("kind") == kind and o.get("name") == name
                                    for o in w["metadata"].get("ownerReferences", []))]
    if len(mine) > 1:
        raise ClusterError(f"{len(mine)} Workloads own {kind} {namespace}/{name}")
    return mine[0] if mine else None
