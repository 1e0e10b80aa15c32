"""Operators run as a ServiceAccount bound to their own ClusterRole, as in a real install, and
authenticate with a legacy token Secret (filled by the controller-manager's token controller
once it runs; unlike a TokenRequest token, it doesn't expire)."""

from __future__ import annotations

import base64
from pathlib import Path

from .boot import Boot
from .pki import write_kubeconfig


def bind(boot: Boot, ns: str, sa: str, cluster_role: str) -> None:
    """Namespace `ns`, ServiceAccount `sa` bound to `cluster_role`, and its token Secret."""
    api = boot.cluster.api()
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": ns}})
    api.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
               {"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": sa, "namespace": ns}})
    api.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})
    api.create(f"/api/v1/namespaces/{ns}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
        "metadata": {"name": f"{sa}-token", "namespace": ns,
                     "annotations": {"kubernetes.io/service-account.name": sa}}})


def kubeconfig(boot: Boot, ns: str, sa: str) -> Path:
    """`<state>/<sa>.kubeconfig` with the ServiceAccount's token, once the token controller
    filled it."""
    c = boot.cluster
    api = c.api()
    path = f"/api/v1/namespaces/{ns}/secrets/{sa}-token"
    boot.wait_for("kube-controller-manager", f"the {sa} token",
                  lambda: (api.get(path) or {}).get("data", {}).get("token"))
    token = base64.b64decode(api.get(path)["data"]["token"]).decode()
    out = c.state_dir / f"{sa}.kubeconfig"
    write_kubeconfig(out, c.server, c.state_dir / "pki" / "ca.crt",
                     f"system:serviceaccount:{ns}:{sa}", token=token)
    return out
