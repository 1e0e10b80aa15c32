"""kube-scheduler, as its built-in RBAC user."""

from __future__ import annotations

from .base import Component, http_ok
from .boot import Boot

COMPONENT = Component("kube-scheduler", ("scheduler",),
                      lambda p: f"https://127.0.0.1:{p['scheduler']}/healthz")


def spawn(boot: Boot) -> None:
    c = boot.cluster
    cfg = c.state_dir / "scheduler.kubeconfig"
    boot.spawn("kube-scheduler", [
        boot.bin("kube-scheduler"), f"--kubeconfig={cfg}",
        f"--authentication-kubeconfig={cfg}", f"--authorization-kubeconfig={cfg}",
        "--bind-address=127.0.0.1", f"--secure-port={c.ports['scheduler']}",
        f"--cert-dir={c.state_dir / 'pki' / 'scheduler-serving'}",
        "--leader-elect=false", "--profiling=false", "--v=1"])


def wait(boot: Boot) -> None:
    url = COMPONENT.health
    assert url is not None
    boot.wait_for("kube-scheduler", "/healthz", lambda: http_ok(url(boot.cluster.ports)))
