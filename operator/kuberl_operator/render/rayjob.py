"""The KubeRay RayJob (ray.io/v1) that runs one attempt of an RLJob.

Supported KubeRay: v1.5.1 (the oldest: the first release with `authOptions`, which every job
sets; `resources` on worker groups is new in v1.5.0) through the newest in e2e/versions.env;
the unit tier validates every render against both CRDs and the e2e tier runs on both. Between
them KubeRay only added fields kuberl does not set (v1.6: `preRunningDeadlineSeconds`,
`authOptions.secretName` and `enableK8sTokenAuth`, `upgradeStrategy`, deletion rules by
deployment status; v1.7, checked once against its CRD: network policies, TLS, history server,
worker group `priority`), so nothing here differs by version. Anything that comes to differ
goes here, keyed by the version the operator is told it runs against.
"""

from __future__ import annotations

from typing import Any

from kuberl_api import runtime
from kuberl_api.rljob import RLJob
from kuberl_api.spec import KUEUE_QUEUE_LABEL
from kuberl_operator.render import names
from kuberl_operator.render.layout import WorkerGroup, worker_groups
from kuberl_operator.render.meta import object_meta
from kuberl_operator.render.pod import head_template, submitter_template, worker_template

RAYJOB_API_VERSION = "ray.io/v1"
# The Ray version in the trainer and rollout images (Dockerfile.trainer / Dockerfile.rollout
# must install exactly this). KubeRay uses it only as metadata in v1.5, but it must not lie.
RAY_VERSION = "2.52.0"

ENTRYPOINT = (f"kuberl run {names.CONFIG_PATH} --address auto --in-cluster "
              f"--metrics-port {runtime.TRAINER_METRICS_PORT}")


def head_group_spec(job: RLJob, attempt: int) -> dict[str, Any]:
    return {
        # num-gpus 0: the driver must never take a GPU, even on an image or node that has one.
        # The dashboard listens on all interfaces so the submitter pod can reach it.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": head_template(job, attempt),
    }


def worker_group_spec(job: RLJob, group: WorkerGroup, attempt: int) -> dict[str, Any]:
    """A fixed-size group: replicas = min = max, since the autoscaler is off and a training job
    needs all its ranks at once.

    The Ray custom resources go in the group's `resources` field (new in KubeRay v1.5) rather
    than in rayStartParams["resources"]: KubeRay then builds and shell-quotes the JSON for
    `ray start --resources` itself, whereas a rayStartParams value is pasted into a bash
    command line and would need its own quoting. KubeRay refuses a group that sets both, so
    rayStartParams stays empty here; num-gpus is derived by KubeRay from the nvidia.com/gpu
    limit, and num-cpus / memory from the cpu / memory limits.
    """
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,
        "rayStartParams": {},
        "resources": {k: str(v) for k, v in group.ray_resources.items()},
        "template": worker_template(job, group, attempt),
    }


# Ray's token authentication (Ray >= 2.52), on for every job: without it anyone who reaches the
# head's dashboard / Jobs API (8265) or GCS (6379) can submit a job, i.e. run code with the job's
# GPUs, volumes and service account. KubeRay (>= v1.5.1) then creates a Secret named after the
# RayCluster (key `auth_token`, 32 random bytes, owned by the RayCluster) and sets RAY_AUTH_MODE
# =token and RAY_AUTH_TOKEN (from that Secret) on the head and worker containers, the
# wait-gcs-ready init containers and the submitter; its own dashboard client sends it too.
# The trainer runs as the Ray job's driver inside the head container, so it inherits both.
# No spec field turns it off: nothing in kuberl needs an open Ray.
AUTH_OPTIONS = {"mode": "token"}


def ray_cluster_spec(job: RLJob, attempt: int) -> dict[str, Any]:
    return {
        "rayVersion": RAY_VERSION,
        "authOptions": dict(AUTH_OPTIONS),
        # Fixed-size groups: an RL job can't use half its ranks, and the autoscaler would add a
        # sidecar and RBAC to the head for nothing.
        "enableInTreeAutoscaling": False,
        "headGroupSpec": head_group_spec(job, attempt),
        "workerGroupSpecs": [worker_group_spec(job, g, attempt)
                             for g in worker_groups(job.spec)],
    }


def rayjob(job: RLJob, attempt: int = 0) -> dict[str, Any]:
    """Which RayJob fields the operator owns and which it leaves alone:

    - backoffLimit 0: restarts happen at the RLJob level (spec.backoffLimit), where the operator
      resumes from the last checkpoint with a new RayJob (attempt n+1) and counts restarts in
      RLJob status. KubeRay's own retries would create new clusters behind the operator's back
      and double-count against the user's limit.
    - activeDeadlineSeconds unset, for the same reason: the RLJob deadline spans all attempts,
      a RayJob deadline would restart its clock on every attempt.
    - shutdownAfterJobFinishes true, ttlSecondsAfterFinished 0: the GPUs go back as soon as the
      job ends; the RayJob (and its status, which the operator reads) stays, and the driver's
      log stays in the submitter Job. RLJob.spec.ttlSecondsAfterFinished deletes the rest.
    - suspend: true only with a Kueue queue (spec.scheduling.queueName), with Kueue's queue
      label: Kueue admits the suspended RayJob as one gang by unsuspending it, and suspends it
      again to preempt it. The operator sets it at creation only and never again (it never
      fights Kueue over it). Suspending an RLJob deletes its RayJob instead.
    - deletionStrategy, clusterSelector, managedBy: not used. The rules-style deletionStrategy
      can't be combined with shutdownAfterJobFinishes anyway.
    - submissionMode K8sJobMode (the default, stated so it is visible): a submitter Job runs
      `ray job submit` and tails the log; the entrypoint itself runs on the head. Its pod
      template is KubeRay's default with the job's labels (pod.submitter_template), so the
      job's NetworkPolicy lets it reach the head.
    """
    meta = object_meta(job, names.rayjob(job.name, attempt), names.COMPONENT_RAYJOB, attempt)
    spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": submitter_template(job),
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 0,
        "backoffLimit": 0,
        "rayClusterSpec": ray_cluster_spec(job, attempt),
    }
    queue = job.spec.scheduling.queue_name
    if queue:
        meta["labels"][KUEUE_QUEUE_LABEL] = queue
        spec["suspend"] = True
    return {"apiVersion": RAYJOB_API_VERSION, "kind": "RayJob", "metadata": meta, "spec": spec}
