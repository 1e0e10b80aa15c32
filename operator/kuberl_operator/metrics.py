"""Prometheus metrics of the operator, named after controller-runtime and kube-state-metrics.

- kuberl_operator_reconcile_total{result}: reconciles by outcome (success | error)
- kuberl_operator_reconcile_duration_seconds: histogram of reconcile wall time
- kuberl_rljob_status_phase{namespace,name,phase}: 1 for the current phase, 0 for the others
- kuberl_rljob_condition{namespace,name,type,status}: 1 for the condition's status, 0 for the
  other two (True/False/Unknown), like kube_job_complete{condition=...}
- kuberl_rljob_restarts, kuberl_rljob_progress_step, kuberl_rljob_progress_reward_mean,
  kuberl_rljob_last_heartbeat_timestamp_seconds, kuberl_rljob_last_checkpoint_step
  {namespace,name}: what the status says (the trainer's progress as it last reported it), so a
  fleet view needs no scrape of every Ray head; absent until there is a value
- kuberl_rljob_eval_score{namespace,name,set,metric}: each eval set's latest scores as the
  status holds them (progress.evals: metric is reward, avg@k, pass@k or maj@k), and
  kuberl_rljob_eval_step{namespace,name,set}: the training steps the scored weights had; a
  job of mode eval ends with its numbers here, long after its trainer's own endpoint is gone
Series of a deleted RLJob are removed (`forget`), so dashboards don't show ghosts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import REGISTRY

from kuberl_api.status import CONDITION_TYPES, PHASES

# (gauge name, help, how to read it from the status)
PROGRESS_GAUGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kuberl_rljob_restarts", "Restarts of the RLJob (new attempts after a failure).",
     ("restarts",)),
    ("kuberl_rljob_progress_step", "The trainer's last reported step.", ("progress", "step")),
    ("kuberl_rljob_progress_reward_mean", "The trainer's last reported mean reward.",
     ("progress", "rewardMean")),
    ("kuberl_rljob_last_heartbeat_timestamp_seconds",
     "When the trainer last reported (Unix time).", ("progress", "lastHeartbeatTime")),
    ("kuberl_rljob_last_checkpoint_step", "The step of the newest checkpoint reported.",
     ("progress", "lastCheckpoint", "step")),
)

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
        self.progress = {name: Gauge(name, help_, ["namespace", "name"], registry=registry)
                         for name, help_, _ in PROGRESS_GAUGES}
        self.eval_score = Gauge(
            "kuberl_rljob_eval_score", "An eval set's latest score (progress.evals).",
            ["namespace", "name", "set", "metric"], registry=registry)
        self.eval_step = Gauge(
            "kuberl_rljob_eval_step", "The training steps of the weights an eval set was last "
            "scored on.", ["namespace", "name", "set"], registry=registry)
        # the eval series each job has (set, metric), to remove the ones it no longer reports
        self._evals: dict[tuple[str, str], set[tuple[str, str]]] = {}
        for result in ("success", "error"):
            self.reconcile_total.labels(result)
        self._lock = threading.Lock()

    def observe_status(self, namespace: str, name: str, status: Mapping[str, Any],
                       progress: Mapping[str, Any] | None = None) -> None:
        """`status`: the operator's part (as decided); `progress`: the trainer's part."""
        self._observe_progress(namespace, name, {**status, "progress": progress or {}})
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

    def _observe_evals(self, namespace: str, name: str, evals: Any) -> None:
        seen: set[tuple[str, str]] = set()
        for entry in evals if isinstance(evals, list) else []:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                continue
            set_ = entry["name"]
            if isinstance(step := entry.get("step"), int):
                self.eval_step.labels(namespace, name, set_).set(step)
            scores = entry.get("scores")
            for metric, value in (scores.items() if isinstance(scores, Mapping) else ()):
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.eval_score.labels(namespace, name, set_, metric).set(value)
                    seen.add((set_, metric))
        self._drop_evals(namespace, name, keep=seen)

    def _drop_evals(self, namespace: str, name: str, keep: set[tuple[str, str]]) -> None:
        old = self._evals.pop((namespace, name), set())
        for set_, metric in old - keep:
            with contextlib.suppress(KeyError):
                self.eval_score.remove(namespace, name, set_, metric)
        for set_ in {s for s, _ in old} - {s for s, _ in keep}:
            with contextlib.suppress(KeyError):
                self.eval_step.remove(namespace, name, set_)
        if keep:
            self._evals[(namespace, name)] = keep

    def _observe_progress(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        progress = status.get("progress")
        if isinstance(progress, Mapping) and "evals" in progress:
            with self._lock:
                self._observe_evals(namespace, name, progress["evals"])
        for gauge_name, _, path in PROGRESS_GAUGES:
            value: Any = status
            for key in path:
                value = value.get(key) if isinstance(value, Mapping) else None
            if gauge_name.endswith("_timestamp_seconds") and isinstance(value, str):
                value = _unix_time(value)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.progress[gauge_name].labels(namespace, name).set(value)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._drop_evals(namespace, name, keep=set())
            for gauge in self.progress.values():
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, name)
            for p in PHASES:
                with contextlib.suppress(KeyError):
                    self.phase.remove(namespace, name, p)
            for t in CONDITION_TYPES:
                for s in CONDITION_STATUSES:
                    with contextlib.suppress(KeyError):
                        self.condition.remove(namespace, name, t, s)


def _unix_time(value: str) -> float | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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
