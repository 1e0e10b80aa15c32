"""kube-controller-manager: all default controllers, each as its own ServiceAccount; the token
controller, CSR signing with the cluster CA, the garbage collector."""

from __future__ import annotations

from .base import CLUSTER_NAME, SERVICE_CIDR, Component, http_ok
from .boot import Boot

COMPONENT = Component("kube-controller-manager", ("controller-manager",),
                      lambda p: f"https://127.0.0.1:{p['controller-manager']}/healthz")


def spawn(boot: Boot) -> None:
    c = boot.cluster
    pki = c.state_dir / "pki"
    cfg = c.state_dir / "controller-manager.kubeconfig"
    boot.spawn("kube-controller-manager", [
        boot.bin("kube-controller-manager"), f"--kubeconfig={cfg}",
        f"--authentication-kubeconfig={cfg}", f"--authorization-kubeconfig={cfg}",
        "--bind-address=127.0.0.1", f"--secure-port={c.ports['controller-manager']}",
        f"--cert-dir={pki / 'controller-manager-serving'}",
        "--leader-elect=false", "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", f"--cluster-name={CLUSTER_NAME}",
        "--profiling=false", "--v=1"])


def wait(boot: Boot) -> None:
    url = COMPONENT.health
    assert url is not None
    api = boot.cluster.api()
    boot.wait_for("kube-controller-manager", "/healthz",
                  lambda: http_ok(url(boot.cluster.ports)))
    # The service-account controller made `default` (pods can't be admitted without it).
    boot.wait_for("kube-controller-manager", "ServiceAccount default/default",
                  lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"))
