"""Prometheus metrics of the operator, named after controller-runtime and kube-state-metrics.

- kuberl_operator_reconcile_total{result}: reconciles by outcome (success | error)
- kuberl_operator_reconcile_duration_seconds: histogram of reconcile wall time
- kuberl_rljob_status_phase{namespace,name,phase}: 1 for the current phase, 0 for the others
- kuberl_rljob_condition{namespace,name,type,status}: 1 for the condition's status, 0 for the
  other two (True/False/Unknown), like kube_job_complete{condition=...}
Series of a deleted RLJob are removed (`forget`), so dashboards don't show ghosts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import REGISTRY

from kuberl_api.status import CONDITION_TYPES, PHASES

CONDITION_STATUSES = ("True", "False", "Unknown")


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.reconcile_total = Counter(
            "kuberl_operator_reconcile", "RLJob reconciles by result.", ["result"],
            registry=registry)
        self.reconcile_duration = Histogram(
            "kuberl_operator_reconcile_duration_seconds", "Time to reconcile one RLJob.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry)
        self.phase = Gauge(
            "kuberl_rljob_status_phase", "The RLJob's current phase (1) and the others (0).",
            ["namespace", "name", "phase"], registry=registry)
        self.condition = Gauge(
            "kuberl_rljob_condition", "The RLJob's conditions: 1 for the current status.",
            ["namespace", "name", "type", "status"], registry=registry)
        for result in ("success", "error"):
            self.reconcile_total.labels(result)
        self._lock = threading.Lock()

    def observe_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        phase = status.get("phase")
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        with self._lock:
            for p in PHASES:
                self.phase.labels(namespace, name, p).set(1 if p == phase else 0)
            for t in CONDITION_TYPES:
                if t not in conditions:
                    continue
                for s in CONDITION_STATUSES:
                    self.condition.labels(namespace, name, t, s).set(
                        1 if conditions[t] == s else 0)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            for p in PHASES:
                with contextlib.suppress(KeyError):
                    self.phase.remove(namespace, name, p)
            for t in CONDITION_TYPES:
                for s in CONDITION_STATUSES:
                    with contextlib.suppress(KeyError):
                        self.condition.remove(namespace, name, t, s)


_default: Metrics | None = None
_default_lock = threading.Lock()


def default() -> Metrics:
    """The process-wide metrics on prometheus_client's default registry (created once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics()
        return _default


def serve(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Serve /metrics from a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=registry)
