"""Reports progress to the job's RLJob status when running in a cluster.

The head pod's ServiceAccount may patch only its own RLJob's `status` (the operator renders that
Role). The reporter merge-patches `status.progress` — step, reward, heartbeat time, last
checkpoint, engines replaced — which the operator reads (and never writes) to derive
Training/Stalled. What happens to the run on the way (an engine replaced) it posts as Events on
the RLJob (`kubectl describe rljob`): the Role lets it create Events, nothing more.
Locally (`kuberl run` without --in-cluster) the reporter is off.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kuberl_api.rljob import GROUP, KIND, PLURAL, VERSION
from kuberl_api.runtime import ENV_JOB_NAME, ENV_JOB_NAMESPACE

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EVENT_SOURCE = "kuberl-trainer"


class StatusReporter:
    def __init__(self, server: str, token: str, namespace: str, name: str,
                 ca_file: str | None = None, timeout: float = 10.0) -> None:
        self.job_url = f"{server}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        self.url = f"{self.job_url}/status"
        self.events_url = f"{server}/api/v1/namespaces/{namespace}/events"
        self.namespace, self.name = namespace, name
        self.token, self.timeout = token, timeout
        self._uid: str | None = None  # the RLJob's, which an Event names (see event)
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None

    @classmethod
    def in_cluster(cls) -> StatusReporter:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(f"https://{host}:{port}", (SA_DIR / "token").read_text().strip(),
                   os.environ[ENV_JOB_NAMESPACE], os.environ[ENV_JOB_NAME],
                   ca_file=str(SA_DIR / "ca.crt"))

    def report(self, *, step: int, total_steps: int, reward_mean: float | None,
               checkpoint: tuple[int, str] | None = None, engine_restarts: int = 0) -> None:
        progress: dict[str, Any] = {
            "step": step, "totalSteps": total_steps,
            "lastHeartbeatTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "engineRestarts": engine_restarts,
        }
        if reward_mean is not None:
            progress["rewardMean"] = round(float(reward_mean), 6)
        if checkpoint is not None:
            progress["lastCheckpoint"] = {"step": checkpoint[0], "path": checkpoint[1]}
        self._patch({"status": {"progress": progress}})

    def event(self, reason: str, message: str, type_: str = "Warning") -> None:
        """A core/v1 Event on the RLJob. It names the RLJob's uid, as `kubectl describe`
        selects its events by uid."""
        if self._uid is None:
            self._uid = str(self._call(self.job_url, "GET")["metadata"]["uid"])
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._call(self.events_url, "POST", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                               "name": self.name, "namespace": self.namespace,
                               "uid": self._uid},
            "reason": reason, "message": message, "type": type_,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": EVENT_SOURCE},
        })

    def _patch(self, body: dict[str, Any]) -> None:
        self._call(self.url, "PATCH", body, "application/merge-patch+json")

    def _call(self, url: str, method: str, body: dict[str, Any] | None = None,
              content_type: str = "application/json") -> Any:
        req = urllib.request.Request(
            url, data=json.dumps(body).encode() if body is not None else None, method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
            text = resp.read()
        return json.loads(text) if text else None
