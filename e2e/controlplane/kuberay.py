"""The KubeRay operator: webhooks off (its default), leader election off, as the ServiceAccount
kuberay-system/kuberay-operator bound to KubeRay's own ClusterRole."""

from __future__ import annotations

from . import serviceaccount
from .base import Component, http_ok
from .boot import Boot

NAMESPACE = "kuberay-system"
SA = "kuberay-operator"
COMPONENT = Component("kuberay-operator", ("kuberay-metrics", "kuberay-probe"),
                      lambda p: f"http://127.0.0.1:{p['kuberay-probe']}/readyz")


def prepare(boot: Boot) -> None:
    """Its ClusterRole and ServiceAccount (the token is filled once the controller-manager
    runs)."""
    boot.apply(boot.bins.kuberay_role)
    serviceaccount.bind(boot, NAMESPACE, SA, "kuberay-operator")


def start(boot: Boot) -> None:
    p = boot.cluster.ports
    cfg = serviceaccount.kubeconfig(boot, NAMESPACE, SA)
    boot.spawn("kuberay-operator", [
        boot.bin("kuberay-operator"), f"--metrics-addr=127.0.0.1:{p['kuberay-metrics']}",
        f"--health-probe-bind-address=127.0.0.1:{p['kuberay-probe']}",
        "--enable-leader-election=false", "--log-stdout-encoder=console"],
        env={"KUBECONFIG": str(cfg)})
    boot.wait_for("kuberay-operator", "/readyz",
                  lambda: http_ok(f"http://127.0.0.1:{p['kuberay-probe']}/readyz"))
