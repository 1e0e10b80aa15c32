"""A local Kubernetes control plane for kuberl's end-to-end tests (envtest + kind, from parts),
one module per component; ``e2e/cluster.py`` is its command line and import path.

Adding a component: a module with a ``COMPONENT`` (name, ports, health URL) and a start
function taking a ``Boot``; its place in ``cluster.ORDER``; its binary in ``versions.BUILDS``/
``BINARIES`` and ``e2e/build.sh``; a call in ``Cluster._boot`` (or an optional
``Cluster.start_<it>``, as Kueue has)."""

from .api import Api
from .base import CLUSTER_NAME, POD_CIDR, SA_ISSUER, SERVICE_CIDR, SERVICE_IP, ClusterError
from .cluster import COMPONENTS, Cluster
from .kuberay import NAMESPACE as KUBERAY_NAMESPACE, SA as KUBERAY_SA
from .kwok import (
    DEFAULT_NODES,
    GPU_CAPACITY,
    GPU_LABELS,
    GPU_TAINT,
    KWOK_NODE_ANNOTATION,
    POOLS,
    Pool,
    node_manifest,
)
from .pki import make_pki, serving_cert, write_kubeconfig
from .procs import free_ports, terminate
from .versions import (
    BUILD_SCRIPT,
    VERSIONS_FILE,
    Binaries,
    binaries,
    binaries_for,
    build,
    cache_root,
    default_state_dir,
    read_versions,
)

__all__ = [
    "BUILD_SCRIPT", "CLUSTER_NAME", "COMPONENTS", "DEFAULT_NODES", "GPU_CAPACITY", "GPU_LABELS",
    "GPU_TAINT", "KUBERAY_NAMESPACE", "KUBERAY_SA", "KWOK_NODE_ANNOTATION", "POD_CIDR", "POOLS",
    "SA_ISSUER", "SERVICE_CIDR", "SERVICE_IP", "VERSIONS_FILE", "Api", "Binaries", "Cluster",
    "ClusterError", "Pool", "binaries", "binaries_for", "build", "cache_root",
    "default_state_dir", "free_ports", "make_pki", "node_manifest", "read_versions",
    "serving_cert", "terminate", "write_kubeconfig",
]
