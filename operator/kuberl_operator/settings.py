"""Operator configuration: CLI flags with environment-variable defaults, and kopf's settings.

Every knob has a flag and a `KUBERL_*` variable (the Helm chart sets variables; tests set flags
to make timers short). Nothing here reads the cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import kopf

from kuberl_operator.render import IngressPolicy
from kuberl_operator.render.network_policy import check_peers
from kuberl_operator.status import Tunables


@dataclass(frozen=True)
class Config:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080  # 0 disables /metrics
    health_port: int = 8081  # 0 disables the liveness endpoint
    resync_seconds: float = 30.0  # every RLJob is re-reconciled at least this often
    head_lost_grace_seconds: float = 120.0
    error_backoff_seconds: float = 5.0  # retry a failed reconcile after this long
    scanning: bool = True  # kopf's CRD/namespace scanning (off for the API emulator)
    # Every job's NetworkPolicy (render/network_policy.py): on, and who outside a job may
    # reach its pods (NetworkPolicyPeers; the chart names the operator, KubeRay, scrapers).
    network_policy: bool = True
    network_policy_peers: tuple[Mapping[str, Any], ...] = ()
    verbose: bool = False

    @property
    def tunables(self) -> Tunables:
        return Tunables(head_lost_grace=timedelta(seconds=self.head_lost_grace_seconds))

    @property
    def ingress(self) -> IngressPolicy:
        return IngressPolicy(enabled=self.network_policy, allowed_from=self.network_policy_peers)

    @property
    def liveness_endpoint(self) -> str | None:
        return f"http://0.0.0.0:{self.health_port}/healthz" if self.health_port else None


def _env_bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m kuberl_operator",
        description="The kuberl operator: RLJob (kuberl.dev/v1alpha1) -> KubeRay RayJob.")
    p.add_argument("-n", "--namespace", action="append", dest="namespaces",
                   help="watch this namespace (repeatable; env KUBERL_NAMESPACES, "
                   "comma-separated); default: all namespaces")
    p.add_argument("--metrics-host", default=env.get("KUBERL_METRICS_HOST", d.metrics_host))
    p.add_argument("--metrics-port", type=int,
                   default=int(env.get("KUBERL_METRICS_PORT", d.metrics_port)),
                   help="port of /metrics (0: off; env KUBERL_METRICS_PORT)")
    p.add_argument("--health-port", type=int,
                   default=int(env.get("KUBERL_HEALTH_PORT", d.health_port)),
                   help="port of the /healthz liveness endpoint (0: off; env KUBERL_HEALTH_PORT)")
    p.add_argument("--resync-seconds", type=float,
                   default=float(env.get("KUBERL_RESYNC_SECONDS", d.resync_seconds)),
                   help="re-reconcile every RLJob this often (env KUBERL_RESYNC_SECONDS)")
    p.add_argument("--head-lost-grace-seconds", type=float,
                   default=float(env.get("KUBERL_HEAD_LOST_GRACE_SECONDS",
                                         d.head_lost_grace_seconds)),
                   help="how long a running job's Ray head may be not ready or gone before "
                   "the job is restarted (env KUBERL_HEAD_LOST_GRACE_SECONDS)")
    p.add_argument("--error-backoff-seconds", type=float,
                   default=float(env.get("KUBERL_ERROR_BACKOFF_SECONDS",
                                         d.error_backoff_seconds)))
    p.add_argument("--no-scanning", action="store_true",
                   default=not _env_bool(env.get("KUBERL_SCANNING", "true")),
                   help="disable kopf's CRD/namespace scanning (env KUBERL_SCANNING=false)")
    p.add_argument("--no-network-policy", action="store_true",
                   default=not _env_bool(env.get("KUBERL_NETWORK_POLICY", "true")),
                   help="render no NetworkPolicy per job (env KUBERL_NETWORK_POLICY=false; for "
                   "clusters whose CNI does not enforce them)")
    p.add_argument("--network-policy-peers",
                   default=env.get("KUBERL_NETWORK_POLICY_PEERS", "[]"),
                   help="JSON list of NetworkPolicyPeers allowed into every job's pods besides "
                   "the job's own (env KUBERL_NETWORK_POLICY_PEERS)")
    p.add_argument("-v", "--verbose", action="store_true",
                   default=_env_bool(env.get("KUBERL_VERBOSE", "false")))
    a = p.parse_args(argv)
    namespaces = a.namespaces or [n for n in env.get("KUBERL_NAMESPACES", "").split(",") if n]
    for value, name in ((a.resync_seconds, "--resync-seconds"),
                        (a.head_lost_grace_seconds, "--head-lost-grace-seconds"),
                        (a.error_backoff_seconds, "--error-backoff-seconds")):
        if value <= 0:
            p.error(f"{name} must be > 0")
    try:
        peers = check_peers(_json_list(a.network_policy_peers))
    except ValueError as exc:
        p.error(f"--network-policy-peers: {exc}")
    return Config(namespaces=tuple(n.strip() for n in namespaces), metrics_host=a.metrics_host,
                  metrics_port=a.metrics_port, health_port=a.health_port,
                  resync_seconds=a.resync_seconds,
                  head_lost_grace_seconds=a.head_lost_grace_seconds,
                  error_backoff_seconds=a.error_backoff_seconds, scanning=not a.no_scanning,
                  network_policy=not a.no_network_policy, network_policy_peers=peers,
                  verbose=a.verbose)


def _json_list(text: str) -> list[Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(value, list):
        raise ValueError(f"not a JSON list: {text!r}")
    return value


def kopf_settings(config: Config) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Watches that silently go idle are a known kopf/Kubernetes trap: bound them (kopf#698).
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 5
    settings.networking.error_backoffs = [0.5, 1, 2, 5]
    settings.scanning.disabled = not config.scanning
    # Only on.event handlers are registered (no on.delete, timers or daemons), so kopf adds no
    # finalizer and writes no progress/diff-base annotations: cleanup is owner references + GC.
    settings.posting.level = logging.WARNING  # kopf's own events; ours are posted explicitly
    return settings
