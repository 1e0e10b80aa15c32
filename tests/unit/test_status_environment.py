"""The environment service (environment.image) stops with the job: the decision that
finishes, fails or suspends a job deletes its Deployment and Service once (nothing calls them
any more, and their pods hold resources until the RLJob goes); a restart keeps them, a resumed
job's attempt applies them again, and a job without an image has nothing to delete."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl_operator.status import (
    CreateAttempt,
    DeleteEnvironment,
    DeleteRayJob,
    Observed,
    decide,
)
from tests.unit.test_status import (
    JOB,
    NOW,
    RJ0,
    RUNNING_RJ0,
    TUN,
    ago,
    body,
    digests,
    rayjob,
    running_status,
    spec,
)

ENV = {"class": "envs:Calculator", "image": "calc:1"}
GONE = DeleteEnvironment(f"{JOB}-env")


def env_body(status: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return body(status, spec=spec(environment=ENV, **extra))


def env_status(**kwargs: Any) -> dict[str, Any]:
    return running_status(specDigests=digests(environment=ENV), **kwargs)


@pytest.mark.parametrize("case, job, observed, phase, actions", [
    ("succeeded", env_body(env_status()),
     Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete", cluster="c0"),)),
     "Succeeded", [GONE]),
    ("failed at the backoff limit", env_body(env_status(restarts=2)),
     Observed(rayjobs=(rayjob(0, "FAILED", "Failed", reason="AppFailed"),)),
     "Failed", [GONE]),
    ("suspended", env_body(env_status(), suspend=True), Observed(rayjobs=(RUNNING_RJ0,)),
     "Suspended", [DeleteRayJob(RJ0), GONE]),
    ("restarting: the same service serves the next attempt", env_body(env_status()),
     Observed(rayjobs=(rayjob(0, "FAILED", "Failed", reason="AppFailed"),)),
     "Restarting", [CreateAttempt(1, 1), DeleteRayJob(RJ0)]),
    ("finished before: deleted once", env_body(env_status(phase="Succeeded",
                                                          completionTime=ago(30))),
     Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete", cluster="c0"),)),
     "Succeeded", []),
    ("no image: nothing to delete", body(running_status()),
     Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete", cluster="c0"),)),
     "Succeeded", []),
])
def test_the_environment_service_stops_with_the_job(
        case: str, job: dict[str, Any], observed: Observed, phase: str,
        actions: list[Any]) -> None:
    decision = decide(job, observed, NOW, TUN)
    assert decision.phase == phase, case
    assert list(decision.actions) == actions, case


def test_a_resumed_job_gets_its_service_back_with_its_attempt() -> None:
    suspended = env_body(env_status(phase="Suspended"))
    decision = decide(suspended, Observed(), NOW, TUN)
    assert [type(a) for a in decision.actions] == [CreateAttempt]  # render_children applies
    # the Service and Deployment with the attempt's other children
