"""Validate what changed: a job that an earlier kuberl accepted keeps running after an upgrade
whose rules refuse some of its values, as Kubernetes ratchets a CRD's validation (an unchanged
value is not refused again).

A release may add or tighten a rule (kuberl_api's Rules and Python-only checks: e.g. paths that
must lie under their PVC's mount). A stored RLJob that breaks it would otherwise be refused on
the operator's next pass (Accepted=False InvalidSpec, nothing tracked any more: no status from
its RayJob, no restart, no TTL) while its Ray job runs on. So when the strict parse fails and

- the job was accepted and ran: it has an attempt (`status.rayJobName`) and the digests of its
  sections as accepted (`status.specDigests`, builder.section_digests), and
- every rule that fails sits on a section whose digest is still the recorded one (a rule
  across sections: every recorded section unchanged, and the field it names in one of them),

the job goes on as it was accepted: parsed with exactly those rules waived
(`kuberl_api.parse_waiving`), then decided like any job. Restarts and resumes render that spec;
its ConfigMap names the waived fields (render/config.py), which `kuberl run --in-cluster`
waives too, so a newer trainer image loads it. Condition SpecWarning says which fields a new
RLJob would be refused for, and why, with one Warning Event per change of that message.

Refused as always (InvalidSpec): a job that never ran (nothing runs, and a Pending spec can be
fixed), a section changed since it was accepted that breaks a rule (a Pending job's edit; a
running job's edit is refused by the CRD's immutability rules, or else by `_check_immutable`
once valid), and any problem that is not a rule's (a type, bound, enum value or unknown field:
the model cannot hold the value, so nothing could render it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kuberl_api import InvalidRLJob, RLJob, RuleFailure, parse_waiving
from kuberl_operator.status.builder import UNSET_DIGEST, Builder, section_digests
from kuberl_operator.status.model import Event

REASON = "AcceptedByEarlierRelease"


def accepted_before(b: Builder, manifest: Mapping[str, Any]
                    ) -> tuple[RLJob, tuple[RuleFailure, ...]] | None:
    """The job as it was accepted and the rules waived for it, or None: refuse it as invalid."""
    if not b.digests or b.ray_job_name is None:
        return None
    try:
        job, failures = parse_waiving(dict(manifest), lambda f: f.node.startswith("spec"))
    except InvalidRLJob:  # a problem no rule raised, or a rule on metadata
        return None
    now = section_digests(job.spec)
    unchanged = {s for s, digest in now.items() if b.digests.get(s, UNSET_DIGEST) == digest}
    if all(_reads_unchanged(f, unchanged, set(now)) for f in failures):
        return job, failures
    return None


def _reads_unchanged(failure: RuleFailure, unchanged: set[str], sections: set[str]) -> bool:
    """The values `failure`'s rule reads are those the job was accepted with."""
    if failure.node.startswith("spec."):  # a section's rule (or a rule below it)
        return _section(failure.node) in unchanged
    # A rule across sections may read any of them; one that reads a section without a digest
    # (`async`) names a field in it (tests/unit/test_ratchet.py), and is not waived.
    return unchanged == sections and _section(failure.field) in sections


def _section(path: str) -> str:
    """"spec.model.storage" -> "model"; "spec.training.nodePool.tolerations[0]" -> "training"."""
    return path.split(".")[1].split("[")[0] if path.startswith("spec.") else ""


def warn(b: Builder, waived: tuple[RuleFailure, ...]) -> None:
    """SpecWarning: True, naming each waived field, while the job runs on rules it was accepted
    under (one Warning Event per new message); False otherwise."""
    if not waived:
        b.set("SpecWarning", False, "SpecValid")
        return
    message = ("accepted by an earlier kuberl release and running as accepted; this release "
               "refuses these values in a new RLJob or in a change to them: "
               + "; ".join(f.line() for f in waived))
    old = b.old_condition("SpecWarning")
    if old is None or old.get("status") != "True" or old.get("message") != message:
        b.events.append(Event("Warning", REASON, message))
    b.set("SpecWarning", True, REASON, message)
