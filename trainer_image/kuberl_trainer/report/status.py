"""Reports progress to the job's RLJob status when running in a cluster.

The head pod's ServiceAccount may patch only its own RLJob's `status` (the operator renders that
Role). The reporter merge-patches `status.progress` — step, reward, heartbeat time, the phase
the trainer is in (during start-up: `beat`, report/heartbeat.py), last checkpoint, engines
replaced — which the operator reads (and never writes) to derive
Training/Stalled; and `status.trainerRefusal` (`refuse`) when its checks refuse to start the
attempt, on which the operator fails the job. What happens to the run on the way (an engine
replaced) it posts as Events on the RLJob (`kubectl describe rljob`): the Role lets it create
Events, nothing more.
Locally (`kuberl run` without --in-cluster) the reporter is off.

Through the `kubernetes` client, not hand-written HTTP: in a pod its in-cluster configuration
re-reads the projected ServiceAccount token as the kubelet rotates it (a bound token read once
expires within the hour, and a long run would go silent, then be restarted as Stalled).
"""

from __future__ import annotations

import os
import urllib.error
from collections.abc import Callable
from datetime import UTC, datetime
from email.message import Message
from typing import Any

import urllib3
from kubernetes import client, config

from kuberl_api.rljob import GROUP, KIND, PLURAL, VERSION
from kuberl_api.runtime import ENV_JOB_NAME, ENV_JOB_NAMESPACE
from kuberl_api.status import MAX_REFUSAL_MESSAGE

EVENT_SOURCE = "kuberl-trainer"
MERGE_PATCH = "application/merge-patch+json"


class ReportError(urllib.error.HTTPError):
    """The API server refused a report. An HTTPError (so an OSError, with `.code`), as the
    reporter raised before it used the client: callers that catch OSError to keep training
    through a lost heartbeat go on doing so."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(url, status, reason, Message(), None)


class StatusReporter:
    def __init__(self, server: str, token: str, namespace: str, name: str,
                 ca_file: str | None = None, timeout: float = 10.0) -> None:
        """A reporter logged in with a fixed bearer token (`kubectl create token`, tests)."""
        cfg = client.Configuration(host=server, api_key={"BearerToken": token},
                                   api_key_prefix={"BearerToken": "Bearer"})
        cfg.ssl_ca_cert = ca_file
        self._setup(cfg, namespace, name, timeout)

    @classmethod
    def in_cluster(cls, timeout: float = 10.0) -> StatusReporter:
        """The head pod's ServiceAccount, its token refreshed as it rotates."""
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        reporter = cls.__new__(cls)
        reporter._setup(cfg, os.environ[ENV_JOB_NAMESPACE], os.environ[ENV_JOB_NAME], timeout)
        return reporter

    def _setup(self, cfg: client.Configuration, namespace: str, name: str,
               timeout: float) -> None:
        api = client.ApiClient(cfg)
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.namespace, self.name, self.timeout = namespace, name, timeout
        self._uid: str | None = None  # the RLJob's, which an Event names (see event)
        self._evals: dict[str, dict[str, Any]] = {}  # each eval set's latest (see report)

    def report(self, *, step: int, total_steps: int, reward_mean: float | None,
               checkpoint: tuple[int, str] | None = None, engine_restarts: int = 0,
               evals: dict[str, dict[str, float]] | None = None,
               phase: str = "Training") -> None:
        """`evals`: the eval sets scored at this step (set -> metric -> value): each set's
        latest scores stay in `progress.evals` (with the step they were taken at) until the
        set is scored again."""
        progress: dict[str, Any] = {
            "step": step, "totalSteps": total_steps, "lastHeartbeatTime": _now(),
            "engineRestarts": engine_restarts, "trainerPhase": phase,
        }
        if evals:
            for name, scores in evals.items():
                self._evals[name] = {"name": name, "step": step, "scores": {
                    metric: round(float(v), 6) for metric, v in scores.items()}}
            # (a merge patch replaces a list whole: every set's latest, in the order first seen)
            progress["evals"] = list(self._evals.values())
        if reward_mean is not None:
            progress["rewardMean"] = round(float(reward_mean), 6)
        if checkpoint is not None:
            progress["lastCheckpoint"] = {"step": checkpoint[0], "path": checkpoint[1]}
        self._patch(progress)

    def beat(self, phase: str, total_steps: int | None = None) -> None:
        """A start-up heartbeat (report/heartbeat.py): the time and the phase the trainer is
        in, nothing else (the step and reward of an earlier attempt stay as they were)."""
        progress: dict[str, Any] = {"lastHeartbeatTime": _now(), "trainerPhase": phase}
        if total_steps is not None:
            progress["totalSteps"] = total_steps
        self._patch(progress)

    def refuse(self, attempt: int, message: str) -> None:
        """The trainer refuses to start `attempt` (its checks before Ray failed: run.py): the
        operator fails the job on it rather than restart an attempt that would fail the same
        way (kuberl_operator/status/refusal.py). `status.trainerRefusal` is the trainer's key,
        as progress is; the operator writes the conditions that say it."""
        self._patch_status({"trainerRefusal": refusal_body(attempt, message)})

    def _patch(self, progress: dict[str, Any]) -> None:
        self._patch_status({"progress": progress})

    def _patch_status(self, keys: dict[str, Any]) -> None:
        # A merge patch of status only: the Role allows nothing else, and a merge patch leaves
        # the operator's keys (conditions, phase) alone.
        self._guard("status", lambda: self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": keys},
            _content_type=MERGE_PATCH, _request_timeout=self.timeout))

    def event(self, reason: str, message: str, type_: str = "Warning") -> None:
        """A core/v1 Event on the RLJob. It names the RLJob's uid, as `kubectl describe`
        selects its events by uid."""
        if self._uid is None:
            job = self._guard("rljob", lambda: self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name,
                _request_timeout=self.timeout))
            self._uid = str(job["metadata"]["uid"])
        now = datetime.now(UTC).replace(microsecond=0)
        body = client.CoreV1Event(
            api_version="v1", kind="Event",
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}.",
                                         namespace=self.namespace),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=self.name,
                namespace=self.namespace, uid=self._uid),
            reason=reason, message=message, type=type_, first_timestamp=now,
            last_timestamp=now, count=1, source=client.V1EventSource(component=EVENT_SOURCE))
        self._guard("events", lambda: self.core.create_namespaced_event(
            self.namespace, body, _request_timeout=self.timeout))

    def _guard(self, what: str, call: Callable[[], Any]) -> Any:
        """The client's errors as OSErrors (see ReportError); a lost connection is one too."""
        try:
            return call()
        except client.ApiException as exc:
            raise ReportError(f"{self.namespace}/{self.name} {what}", int(exc.status or 0),
                              str(exc.reason)) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise ConnectionError(f"{self.namespace}/{self.name} {what}: {exc}") from exc


def refusal_body(attempt: int, message: str) -> dict[str, Any]:
    """status.trainerRefusal (kuberl_api.status.TrainerRefusal): a message past the API's
    bound is cut, keeping its start (the field it names)."""
    if len(message) > MAX_REFUSAL_MESSAGE:
        message = message[:MAX_REFUSAL_MESSAGE - 3] + "..."
    return {"attempt": attempt, "message": message, "time": _now()}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
