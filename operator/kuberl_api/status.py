"""The RLJob status: written by the operator (phase, conditions) and the trainer (progress,
trainerRefusal)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kuberl_api.base import ApiModel

# Pending covers waiting in a Kueue queue (condition Queued); Preempted is waiting for Kueue to
# admit the job again after it evicted a running attempt.
Phase = Literal["Pending", "Provisioning", "Running", "Restarting", "Preempted", "Suspended",
                "Succeeded", "Failed"]
PHASES: tuple[Phase, ...] = ("Pending", "Provisioning", "Running", "Restarting", "Preempted",
                             "Suspended", "Succeeded", "Failed")
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})

# SpecWarning: True while the job runs on a spec an earlier kuberl accepted and this one would
# refuse (kuberl_operator/status/ratchet.py); its message names each field and why.
ConditionType = Literal["Accepted", "SpecWarning", "Queued", "ClusterReady", "Training",
                        "Stalled", "Preempted", "Suspended", "Succeeded", "Failed"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Accepted", "SpecWarning", "Queued",
                                              "ClusterReady", "Training", "Stalled",
                                              "Preempted", "Suspended", "Succeeded", "Failed")


# What progress.trainerPhase holds (kuberl_trainer/report/heartbeat.py reports it).
TrainerPhase = Literal["Starting", "Placing", "EnginesStarting", "Loading", "FirstStep",
                       "Training", "Evaluating"]
STARTUP_PHASES: tuple[str, ...] = ("Starting", "Placing", "EnginesStarting", "Loading",
                                   "FirstStep")


class Condition(ApiModel):
    """Kubernetes' metav1.Condition, field for field."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class CheckpointRef(ApiModel):
    step: int = Field(ge=0)
    path: str = Field(max_length=1024)


# Scores per eval set: its mean reward and avg@k, pass@k, maj@k for up to data.evalSets[].passK's
# 8 values of k
MAX_EVAL_SCORES = 32


class EvalScore(ApiModel):
    """An eval set's latest scores (the trainer reports them; docs/algorithms.md,
    "Evaluation")."""

    name: str = Field(max_length=63)
    step: int = Field(ge=0, description="Training steps the evaluated weights had (mode eval: "
                      "0, the model as given).")
    scores: dict[str, float] = Field(
        default_factory=dict, max_length=MAX_EVAL_SCORES,
        description="By metric: reward (the mean reward), avg@k, pass@k, maj@k.")


class Progress(ApiModel):
    """Filled by the trainer's heartbeat; the operator only reads it."""

    step: int | None = Field(None, ge=0)
    total_steps: int | None = Field(None, ge=0)
    reward_mean: float | None = None
    last_heartbeat_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    last_checkpoint: CheckpointRef | None = None
    trainer_phase: TrainerPhase | None = Field(
        None, description="Where the trainer is: Starting (Ray, the engines' actors), Placing "
        "(the training ranks), EnginesStarting, Loading (the models), FirstStep, Training (per "
        "step), Evaluating (mode eval). During start-up and Evaluating it reports every 30 s; "
        "after the first step, once a step.")
    engine_restarts: int | None = Field(
        None, ge=0, description="Engines replaced in this attempt (rollout.maxEngineRestarts "
        "bounds them).")
    evals: list[EvalScore] = Field(
        default_factory=list, max_length=16,
        description="The latest scores of each of data.evalSets, as last evaluated.")


# The longest trainerRefusal.message the trainer writes (it cuts a longer one): the condition
# that carries it holds 32 KiB, and an Event far less.
MAX_REFUSAL_MESSAGE = 4096


class TrainerRefusal(ApiModel):
    """The trainer's refusal to start an attempt: the checks `kuberl run` makes before Ray
    (kuberl_trainer/preflight.py) found input that cannot run. The trainer writes it and exits;
    the operator fails the job on it (Failed, reason InvalidAtStart) instead of restarting an
    attempt that would fail the same way."""

    attempt: int = Field(ge=0, description="The attempt the trainer refused to start (RayJob "
                         "<name>-r<attempt>): the operator acts on the current attempt's only.")
    message: str = Field(max_length=MAX_REFUSAL_MESSAGE, description="What is wrong, naming "
                         "the field (the error line `kuberl run` ends with).")
    time: str = Field(json_schema_extra={"format": "date-time"})


class RLJobStatus(ApiModel):
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    progress: Progress | None = None
    ray_job_name: str | None = Field(None, max_length=63)
    observed_generation: int | None = Field(None, ge=0)
    restarts: int = Field(0, ge=0, description="RayJobs replaced after a lost head or stall.")
    start_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    completion_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    spec_digests: dict[str, str] = Field(
        default_factory=dict, max_length=32,
        description="Digest per immutable spec section, as accepted (detects changes).")
    trainer_refusal: TrainerRefusal | None = Field(
        None, description="Written by the trainer (the operator only reads it): the attempt "
        "it refused to start, and why.")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
