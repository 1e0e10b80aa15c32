"""`decide`: the whole decision for one RLJob, as a chain of cases (see the package docstring);
each case lives in its own module (phases, queueing, running)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from kuberl_api import InvalidRLJob, RLJob, RuleFailure, parse
from kuberl_api.rljob import EDITABLE_PHASES, IMMUTABLE_SECTIONS
from kuberl_api.status import TERMINAL_PHASES
from kuberl_operator.render import names
from kuberl_operator.status import phases, queueing, ratchet, refusal, running
from kuberl_operator.status.builder import (
    Builder,
    attempt_of,
    dig,
    is_deleting,
    parse_time,
    section_digests,
)
from kuberl_operator.status.model import (
    ANNOTATION_RESTARTS,
    Decision,
    DeleteEnvironment,
    DeleteRayJob,
    Event,
    Observed,
    Tunables,
)


def decide(body: Mapping[str, Any], observed: Observed, now: datetime,
           tunables: Tunables | None = None) -> Decision:
    """The new status, actions and events for one RLJob (see the package docstring)."""
    tun = tunables or Tunables()
    b = Builder(body, now)
    manifest = {k: v for k, v in body.items() if k != "status"}
    waived: tuple[RuleFailure, ...] = ()
    try:
        job = parse(manifest)
    except InvalidRLJob as exc:
        # accepted under an earlier release's rules, unchanged since: it runs on (ratchet.py)
        kept = ratchet.accepted_before(b, manifest)
        if kept is None:
            return _invalid(b, exc)
        job, waived = kept

    accepted_digests = dict(b.digests)
    refused = _check_immutable(b, job, waived)
    ratchet.warn(b, waived)
    edited = bool(accepted_digests) and accepted_digests != b.digests
    attempts = _attempts(b.name, observed, b.ray_job_name)
    current_attempt = max(attempts) if attempts else None
    current = attempts.get(current_attempt) if current_attempt is not None else None
    live_current = current if current is not None and not is_deleting(current) else None
    if live_current is not None:
        b.ray_job_name = dig(live_current, "metadata", "name")
        stamped = dig(live_current, "metadata", "annotations", ANNOTATION_RESTARTS)
        if isinstance(stamped, str) and stamped.isdigit():
            b.restarts = max(b.restarts, int(stamped))
    # Older attempts left behind (a crash between "create N+1" and "delete N") go now.
    for attempt, rj in sorted(attempts.items()):
        if attempt != current_attempt and not is_deleting(rj):
            b.actions.append(DeleteRayJob(str(dig(rj, "metadata", "name"))))
    # The trainer refused to start the current attempt (status/refusal.py): bad input, which
    # the refused-change message outranks (reverting is what that user does first).
    refused_at_start = refusal.of_attempt(b, current_attempt)
    if refused_at_start is not None and current_attempt is not None and not refused:
        refusal.mark_invalid(b, current_attempt, refused_at_start)

    if b.old_phase in TERMINAL_PHASES:
        phases.terminal(b, job, live_current)
    elif refused_at_start is not None and current_attempt is not None:
        refusal.fail(b, current_attempt, refused_at_start, live_current)
    elif job.spec.suspend:
        phases.suspend(b, live_current)
    elif b.old_phase != "Suspended" and _deadline_exceeded(b, job):
        phases.fail(b, "DeadlineExceeded",
              f"activeDeadlineSeconds ({job.spec.active_deadline_seconds}s since "
              f"{b.start_time}) exceeded", live_current, delete=True)
    elif live_current is None:
        if _never_ran(b) or b.old_phase == "Suspended" or _queued_never_admitted(b):
            phases.start(b, job, current_attempt, refused, observed)
        else:
            phases.restart_or_fail(b, job, current_attempt or 0, None, "RayJobLost",
                             f"RayJob {b.ray_job_name} disappeared", refused, stalled=True)
    elif dig(live_current, "spec", "suspend") is True and not _finished(live_current):
        queueing.waiting(b, job, current_attempt or 0, live_current, observed.workload, edited)
    else:
        running.track(b, job, current_attempt or 0, live_current, observed, tun, refused)
    if (job.spec.environment.image is not None and b.phase != b.old_phase
            and b.phase in (*TERMINAL_PHASES, "Suspended")):
        # the environment service stops with the job (an attempt, resumed, applies it again)
        b.actions.append(DeleteEnvironment(names.environment(job.name)))
    if b.phase in TERMINAL_PHASES and b.old_phase not in TERMINAL_PHASES:
        # The pass that finishes the job schedules its TTL: nothing else is due to wake the
        # operator for it (the watch event of its own status patch may never come, and the
        # next resync can be long after the expiry).
        expiry = phases.ttl_expiry(b, job)
        if expiry is not None:
            b.wake(expiry)
    return b.finish(job, waived)


def _invalid(b: Builder, exc: InvalidRLJob) -> Decision:
    """The API server let through something kuberl_api rejects (no admission policy installed,
    or a rule only Python checks): say so, create nothing, touch nothing."""
    message = "; ".join(exc.problems)
    old = b.old_condition("Accepted")
    if old is None or old.get("status") != "False" or old.get("message") != message:
        b.events.append(Event("Warning", "InvalidSpec", message))
    b.set("Accepted", False, "InvalidSpec", message)
    b.set("SpecWarning", False, "InvalidSpec", "the spec is refused (condition Accepted)")
    if b.phase is None:
        b.phase = "Pending"
    return b.finish(None)


def _check_immutable(b: Builder, job: RLJob, waived: tuple[RuleFailure, ...]) -> list[str]:
    """Accepted, or refused for changed immutable sections (returned; the job runs on as it was
    accepted). Digests are (re)recorded while the phase is still editable."""
    digests = section_digests(job.spec)
    frozen = b.old_phase is not None and b.old_phase not in EDITABLE_PHASES
    changed = [s for s in IMMUTABLE_SECTIONS
               if frozen and s in b.digests and b.digests[s] != digests[s]]
    if not changed:
        b.digests = digests
        b.set("Accepted", True, "Accepted", "the spec is valid" if not waived else
              "the spec is valid under the rules it was accepted with (see SpecWarning)")
        return []
    fields = ", ".join(f"spec.{s}" for s in changed)
    message = (f"{fields} changed after the job started and cannot be applied to a running "
               "job; the job continues with the accepted spec. Revert the change, or delete "
               "and recreate the RLJob")
    old = b.old_condition("Accepted")
    if old is None or old.get("reason") != "ImmutableFieldChanged" or old.get("message") != message:
        b.events.append(Event("Warning", "ImmutableFieldChanged", message))
    b.set("Accepted", False, "ImmutableFieldChanged", message)
    return changed


def _attempts(job_name: str, observed: Observed, status_name: str | None) -> dict[int, Any]:
    """attempt -> RayJob body, plus the status' attempt (value None) when that RayJob is gone."""
    out: dict[int, Any] = {}
    for rj in observed.rayjobs:
        n = attempt_of(job_name, rj)
        if n is not None:
            out[n] = rj
    recorded = attempt_of(job_name, status_name)
    if recorded is not None and recorded not in out:
        out[recorded] = None
    return out


def _never_ran(b: Builder) -> bool:
    return b.old_phase in (None, "Pending") and b.ray_job_name is None


def _queued_never_admitted(b: Builder) -> bool:
    """A first attempt that waited in a Kueue queue and never ran (its RayJob is gone: deleted
    while queued, or replaced after an edit): starting again costs no restart."""
    queued = b.old_condition("Queued")
    return (b.old_phase == "Pending" and queued is not None
            and queued.get("status") == "True")


def _finished(rayjob: Mapping[str, Any]) -> bool:
    return bool(dig(rayjob, "status", "jobStatus") == "SUCCEEDED")


def _deadline_exceeded(b: Builder, job: RLJob) -> bool:
    limit = job.spec.active_deadline_seconds
    started = parse_time(b.start_time)
    if limit is None or started is None:
        return False
    expiry = started + timedelta(seconds=limit)
    b.wake(expiry)
    return b.now >= expiry
