"""NCCL and network wiring of the pods: shared memory, interfaces, host network, RDMA, ports.

Only GPU pods get the NCCL pieces (the network section is documented as "for GPU pods"); every
Ray pod gets /dev/shm, which the Ray object store uses as well.
"""

from __future__ import annotations

from typing import Any

from kuberl_api.spec import NetworkSpec
from kuberl_operator.render import names

# KubeRay (common/pod.go, BuildPod -> addEmptyDir) adds a memory-backed emptyDir named
# "shared-mem" at /dev/shm to the Ray container unless the container already mounts something
# at /dev/shm. We render it ourselves, with KubeRay's volume name, so that (a) the golden files
# show what the pods really get and tests can assert it, (b) KubeRay's check finds the mount and
# adds nothing (no duplicate volume or mountPath, which the API server would refuse), and
# (c) pods keep it should a KubeRay version stop injecting it. Without it a container has
# Docker's 64 MiB /dev/shm, and NCCL's shared-memory transport crashes (ncclShmOpen) on it.
SHM_VOLUME = "shared-mem"
SHM_PATH = "/dev/shm"

IPC_LOCK = "IPC_LOCK"


def shm_volume(memory: str | None) -> dict[str, Any]:
    """tmpfs pages are charged to the pod's memory, so the container's memory limit is the
    natural cap (KubeRay sizes it the same way); without a memory limit, no sizeLimit."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if memory:
        empty_dir["sizeLimit"] = memory
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def shm_mount() -> dict[str, Any]:
    return {"name": SHM_VOLUME, "mountPath": SHM_PATH}


def nccl_env(network: NetworkSpec) -> list[dict[str, Any]]:
    """The GPU containers' env entries: NetworkSpec.variables(), sorted by name."""
    return [{"name": k, "value": v} for k, v in sorted(network.variables().items())]


def device_resources(network: NetworkSpec) -> dict[str, str]:
    """Extended resources besides GPUs (an RDMA device plugin's HCA share), per GPU pod."""
    if network.rdma is None:
        return {}
    return {network.rdma.resource: str(network.rdma.count)}


def security_context(network: NetworkSpec) -> dict[str, Any] | None:
    """RDMA registers (pins) memory with the NIC, which needs an unlimited memlock; IPC_LOCK is
    the narrow capability for that, rather than a privileged container."""
    if network.rdma is None:
        return None
    return {"capabilities": {"add": [IPC_LOCK]}}


def host_network_fields(network: NetworkSpec) -> dict[str, Any]:
    """hostNetwork gives NCCL the node's NICs directly (no CNI overlay in the data path). On the
    host network the default dnsPolicy would resolve with the node's resolv.conf, and the pods
    could no longer find the Ray head's Service: ClusterFirstWithHostNet keeps cluster DNS."""
    if not network.host_network:
        return {}
    return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


def weight_sync_port(network: NetworkSpec) -> dict[str, Any]:
    """The rendezvous port of the trainer-to-engines group (the TCP store of trainer rank 0).
    Named, so Services or NetworkPolicies can refer to it; on the host network the API server
    turns it into a hostPort, which also stops two such pods from sharing a node."""
    return {"name": names.PORT_WEIGHT_SYNC, "containerPort": network.weight_sync_port,
            "protocol": "TCP"}
