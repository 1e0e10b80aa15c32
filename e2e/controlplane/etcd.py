"""etcd on a loopback port, without fsync (a throwaway store)."""

from __future__ import annotations

from .base import CLUSTER_NAME, Component, http_ok
from .boot import Boot

COMPONENT = Component("etcd", ("etcd", "etcd-peer"),
                      lambda p: f"http://127.0.0.1:{p['etcd']}/health")


def start(boot: Boot) -> None:
    s, p = boot.cluster.state_dir, boot.cluster.ports
    url = f"http://127.0.0.1:{p['etcd']}"
    peer_url = f"http://127.0.0.1:{p['etcd-peer']}"
    boot.spawn("etcd", [
        boot.bin("etcd"), f"--name={CLUSTER_NAME}", f"--data-dir={s / 'etcd'}",
        f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={CLUSTER_NAME}={peer_url}", "--initial-cluster-state=new",
        "--unsafe-no-fsync=true", "--log-level=warn"])
    boot.wait_for("etcd", "/health", lambda: http_ok(f"{url}/health"))
