"""What every part of the local control plane shares: names, address ranges, the error type,
waiting for a condition, and a component's description."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

CLUSTER_NAME = "kuberl-e2e"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: first address of SERVICE_CIDR
POD_CIDR = "10.244.0.0/16"  # kwok hands pod IPs out of it (nothing routes them: fake pods)
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Component:
    """One process of the cluster: its name (pid key, log file, binary), the ports it needs
    (keys of Cluster.ports) and, for `status`, the URL that says it is healthy."""

    name: str
    ports: tuple[str, ...]
    health: Callable[[Mapping[str, int]], str] | None = None


def wait(what: str, timeout: float, ok: Callable[[], Any],
         check: Callable[[], None] | None = None, interval: float = 0.2) -> None:
    """ok() until truthy; ClusterError after `timeout` s. `check` runs first each round (it
    raises when the awaited process died). Connection errors count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        try:
            if ok():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str, timeout: float = 3.0) -> bool:
    """GET url is 2xx (TLS not verified: for the components' self-signed health endpoints)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
            return bool(200 <= resp.status < 300)
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return False
