"""kube-apiserver: Node+RBAC authorization, client certificates, service-account tokens, the
aggregation layer's front proxy; then the kubeconfigs of the admin and the control plane."""

from __future__ import annotations

from .base import SA_ISSUER, SERVICE_CIDR, Component
from .boot import Boot
from .pki import write_kubeconfig

COMPONENT = Component("kube-apiserver", ("apiserver",),
                      lambda p: f"https://127.0.0.1:{p['apiserver']}/livez")


def start(boot: Boot) -> None:
    c = boot.cluster
    pki = c.state_dir / "pki"
    boot.spawn("kube-apiserver", [
        boot.bin("kube-apiserver"), "--advertise-address=127.0.0.1", "--bind-address=127.0.0.1",
        f"--secure-port={c.ports['apiserver']}",
        f"--etcd-servers=http://127.0.0.1:{c.ports['etcd']}",
        f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--enable-admission-plugins=NodeRestriction",  # on top of the default set
        f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        # 1.37's endpoint reconciler refuses a loopback advertise address: no endpoints
        # for the `kubernetes` Service (nothing in this cluster runs code that would use it).
        "--endpoint-reconciler-type=none",
        # /debug/pprof (admin only; the default): bench/operator_scale.py --profile-seconds.
        "--allow-privileged=true", "--profiling=true", "--v=1"])
    boot.wait_for("kube-apiserver", "/readyz", c.api().readyz)
    write_kubeconfig(c.kubeconfig, c.server, pki / "ca.crt", "kuberl-e2e-admin",
                     cert=pki / "admin.crt", key=pki / "admin.key")
    for who in ("controller-manager", "scheduler"):
        write_kubeconfig(c.state_dir / f"{who}.kubeconfig", c.server, pki / "ca.crt",
                         f"system:kube-{who}", cert=pki / f"{who}.crt", key=pki / f"{who}.key")
