"""The harness itself: node pools as documented, and a RayCluster through KubeRay end to end."""

from __future__ import annotations

import pytest
from cluster import POOLS, Cluster
from smoke import check_raycluster

pytestmark = pytest.mark.e2e


def test_node_pools(k8s_cluster: Cluster) -> None:
    nodes = k8s_cluster.api().get("/api/v1/nodes")["items"]
    pools: dict[str, int] = {}
    for node in nodes:
        pool = POOLS[node["metadata"]["labels"]["pool"]]
        pools[pool.name] = pools.get(pool.name, 0) + 1
        assert node["spec"].get("taints", []) == [dict(t) for t in pool.taints]
        assert node["status"]["allocatable"].get("nvidia.com/gpu") == pool.capacity.get(
            "nvidia.com/gpu")
        assert any(c["type"] == "Ready" and c["status"] == "True"
                   for c in node["status"]["conditions"])
    assert set(pools) == {"train", "rollout", "cpu"} and pools["train"] >= 2, pools


@pytest.mark.kuberay
def test_raycluster_on_the_pools(k8s_cluster: Cluster) -> None:
    check_raycluster(k8s_cluster, name="harness-smoke", say=lambda _line: None)


def test_free_ports_stay_out_of_the_range_outgoing_connections_take() -> None:
    """A port picked for a component is listened on seconds later; meanwhile the cluster's own
    client connections take local ports from the kernel's ephemeral range, so picks from that
    range can be gone by then (KubeRay once failed to bind one in CI)."""
    from controlplane.procs import ephemeral_range, free_ports

    low, high = ephemeral_range()
    ports = free_ports(24)
    assert len(set(ports)) == 24
    assert not [p for p in ports if low <= p <= high], (ports, (low, high))
