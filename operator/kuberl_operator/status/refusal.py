"""The trainer's refusal at start (`status.trainerRefusal`): the checks `kuberl run` makes on
the head before Ray starts (kuberl_trainer/preflight.py: the job's modules import, a custom
loss returns the right shape, the model's files are there, a served reward model has the form
asked for) found input that cannot run, and the trainer said so before it exited.

A restart would fail the same way: the spec cannot change once the job has started, and the
next attempt checks the same input. So the job fails at once (Failed, reason InvalidAtStart),
and Accepted says the same (False, InvalidAtStart): it is bad input, like a spec the operator
refuses, found only by running the job's own code. A crash, or a refusal the trainer could not
report, restarts within backoffLimit as before.

Whose report counts: only the current attempt's. A refusal of attempt N that comes after the
operator replaced N by N+1 for another cause (its RayJob read as failed first) says nothing
about N+1, which checks and reports for itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kuberl_operator.render import names
from kuberl_operator.status import phases
from kuberl_operator.status.builder import Builder

REASON = "InvalidAtStart"


def of_attempt(b: Builder, attempt: int | None) -> str | None:
    """What the trainer reported when it refused to start `attempt`, or None (no refusal, or
    an earlier attempt's)."""
    refusal = b.old.get("trainerRefusal")
    if attempt is None or not isinstance(refusal, Mapping):
        return None
    reported = refusal.get("attempt")
    if not isinstance(reported, int) or isinstance(reported, bool) or reported != attempt:
        return None
    message = refusal.get("message")
    return message if isinstance(message, str) and message else "no reason given"


def explained(b: Builder, attempt: int, refusal: str) -> str:
    """The conditions' and the Event's words: who refused, what, and what the user does."""
    return (f"the trainer refused to start RayJob {names.rayjob(b.name, attempt)}: {refusal}. "
            "A restart would fail the same way, so none is made: fix the input, then delete "
            "and re-create the RLJob (its spec cannot change once it has started)")


def mark_invalid(b: Builder, attempt: int, refusal: str) -> None:
    """Accepted=False: on every pass (the spec check sets it True first), so the finished job
    keeps saying why."""
    b.set("Accepted", False, REASON, explained(b, attempt, refusal))


def fail(b: Builder, attempt: int, refusal: str, current: Mapping[str, Any] | None) -> None:
    """Failed now, whether KubeRay has seen the Ray job fail yet or not. The RayJob is not
    deleted here: the trainer has exited, so its Ray job ends by itself and the finished RayJob
    keeps the driver's log (its submitter Job); one still running on a later pass is deleted
    as after any failure the operator declares (phases.terminal)."""
    phases.fail(b, REASON, explained(b, attempt, refusal), current)
