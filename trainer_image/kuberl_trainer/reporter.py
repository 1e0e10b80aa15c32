"""Reports progress to the job's RLJob status when running in a cluster.

The head pod's ServiceAccount may patch only its own RLJob's `status` (the operator renders that
Role). The reporter merge-patches `status.progress` — step, reward, heartbeat time, last
checkpoint, engines replaced — which the operator reads (and never writes) to derive
Training/Stalled.
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

from kuberl_api.rljob import GROUP, PLURAL, VERSION
from kuberl_api.runtime import ENV_JOB_NAME, ENV_JOB_NAMESPACE

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class StatusReporter:
    def __init__(self, server: str, token: str, namespace: str, name: str,
                 ca_file: str | None = None, timeout: float = 10.0) -> None:
        self.url = (f"{server}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/"
                    f"{name}/status")
        self.token, self.timeout = token, timeout
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

    def _patch(self, body: dict[str, Any]) -> None:
        req = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="PATCH",
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/merge-patch+json"})
        with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
            resp.read()
