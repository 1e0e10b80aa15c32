"""The async and scheduling sections: how far async rollouts may run ahead of training, and how
the job waits for and holds its GPUs on a shared cluster (Kueue, priorities, grace period)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel
from kuberl_api.spec.common import PVC_NAME_PATTERN

# The truncation async training applies by default (AsyncSpec.off_policy_correction): the
# cap of Yao et al.'s TIS, and the arm that kept the most of sync's gain on the addition task
# at maxStaleness 4 (bench/async_correction.py, bench/RESULTS.md).
ASYNC_DEFAULT_TIS_CAP = 2.0


RunAhead = Literal["adaptive", "bound"]


class AsyncSpec(ApiModel):
    """mode: async (trainer_image/kuberl_trainer/loops/async_loop.py): the engines generate
    continuously, at most maxStaleness policy versions ahead of the trainers."""

    max_staleness: int = Field(
        1, ge=1, le=1024, description="How many policy versions the oldest token of a training "
        "sample may lag the policy that trains on it: a rollout starts only once the engines' "
        "weights are recent enough. 1: one-step-off (the next step's rollout is generated "
        "while this one trains).")
    partial_rollout: bool = Field(
        False, description="A weight update pauses generation only for the transfer and the "
        "requests in flight finish under the new weights; false: the update waits for the "
        "rollout in flight.")
    run_ahead: RunAhead = Field(
        "adaptive", description="How far ahead of the trainers the engines generate, within "
        "maxStaleness. adaptive: only as far as keeps the trainers fed (one rollout ahead "
        "while generation is the faster side, deeper when the trainers wait for it, up to "
        "maxStaleness), so samples are no staler than throughput needs; bound: always as far "
        "as maxStaleness allows (the deepest buffer against bursty generation, every sample "
        "maxStaleness versions old when the engines are faster).")
    off_policy_correction: Literal["truncated", "none"] = Field(
        "truncated", description="How a step corrects for samples the engines drew under older "
        "weights (docs/algorithms.md). truncated: each token's policy loss is weighted by "
        "min(pi_old / pi_rollout, algorithm.tisCap), with tisCap 2 when the algorithm section "
        "sets neither tisCap nor importanceMask (those, when set, are the correction); none: "
        "the samples are treated as drawn from pi_old (no weights unless tisCap or "
        "importanceMask is set).")


# Kueue's labels on a job (sigs.k8s.io/kueue): the LocalQueue it waits in, and the
# WorkloadPriorityClass it is ordered by. kuberl sets the first from scheduling.queueName.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# How long a stopping head has by default to save a checkpoint (see SchedulingSpec): a few
# minutes covers finishing a step and writing a mid-size model's state; Kubernetes' own 30 s
# default would kill most trainers mid-write.
DEFAULT_GRACE_SECONDS = 300


class SchedulingSpec(ApiModel):
    """How the job waits for and holds its GPUs on a shared cluster (docs/scheduling.md)."""

    queue_name: str | None = Field(
        None, min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN,
        description="Kueue LocalQueue in the RLJob's namespace. The RayJob is created suspended "
        f"with Kueue's {KUEUE_QUEUE_LABEL} label; Kueue admits it as one gang when its "
        "ClusterQueue has quota for every pod, and may preempt it for a job of higher "
        "priority (the job then resumes from its checkpoint, without counting against "
        "backoffLimit). Unset: no queue, the RayJob starts at once.")
    priority_class_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=PVC_NAME_PATTERN,
        description="PriorityClass of every pod of the job: Kueue orders and preempts "
        "workloads by its value, and kube-scheduler by the pods'.")
    termination_grace_period_seconds: int = Field(
        DEFAULT_GRACE_SECONDS, ge=30, le=86400,
        description="How long a head that is told to stop (preemption, suspend, a node "
        "drain) has to save a checkpoint before it is killed: the trainer saves at the end of "
        "the step in flight, or at once when the step has not begun training.")
