"""The parts of Ray that fake (kwok) pods can't run, played by the e2e tests: the Ray dashboard's
job status, which KubeRay copies into the RayJob (written with the KubeRay operator frozen,
`Cluster.paused(KUBERAY)`, after it provisioned the cluster and started the submitter), and the
trainer's status reporter on the head, logged in with the head ServiceAccount's token."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from cluster import Cluster
from polling import wait_for

from kuberl_operator.render import names
from kuberl_trainer.report.status import StatusReporter

KUBERAY = "kuberay-operator"  # the process Cluster.paused freezes


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def dashboard_says(c: Cluster, ns: str, rayjob: str, job_status: str, **extra: Any) -> None:
    """Write the RayJob status KubeRay writes when the Ray dashboard reports `job_status` for
    its job (ray-operator/controllers/ray/rayjob_controller.go: jobStatus, jobDeploymentStatus
    Complete/Failed for terminal states, rayJobInfo times, endTime)."""
    now = datetime.now(UTC)
    status: dict[str, Any] = {"jobStatus": job_status, "jobId": f"{rayjob}-id"}
    info: dict[str, Any] = {"startTime": iso(extra.pop("started", now))}
    if job_status == "RUNNING":
        status["message"] = "Job is currently running."
    elif job_status == "SUCCEEDED":
        status.update(jobDeploymentStatus="Complete", endTime=iso(now),
                      message="Job finished successfully.")
        info["endTime"] = iso(now)
    elif job_status in ("FAILED", "STOPPED"):
        status.update(jobDeploymentStatus="Failed" if job_status == "FAILED" else "Complete",
                      endTime=iso(now), message=extra.pop(
                          "message", "Job entrypoint command failed with exit code 1"))
        if job_status == "FAILED":
            status["reason"] = "AppFailed"
        info["endTime"] = iso(now)
    status["rayJobInfo"] = info
    status.update(extra)
    c.kubectl("patch", "rayjob", rayjob, "-n", ns, "--subresource=status", "--type=merge",
              "-p", json.dumps({"status": status}))


def head_reporter(c: Cluster, ns: str, job: str) -> StatusReporter:
    """The trainer's reporter, logged in as the head pod would be (its ServiceAccount)."""
    wait_for("the head ServiceAccount", lambda: c.kubectl(
        "get", "serviceaccount", names.service_account(job), "-n", ns, check=False
    ).returncode == 0)
    token = c.kubectl("create", "token", names.service_account(job), "-n", ns).stdout.strip()
    return StatusReporter(c.server, token, ns, job, ca_file=str(c.state_dir / "pki" / "ca.crt"))
