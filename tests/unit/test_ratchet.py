"""Validate what changed (kuberl_operator/status/ratchet.py): a job that an earlier kuberl
accepted, and that this one's rules refuse, keeps being tracked while the sections those rules
sit on are unchanged since it was accepted; SpecWarning names each field, once; restarts render
the accepted spec, which the trainer loads. Anything else is refused as before.

The example is a real one: kuberl before be39d6d accepted a `model.tokenizer` outside
`model.storage.mountPath` (and `/models-x/...` as lying under `/models`: a bare prefix);
be39d6d refuses both (e2e/test_upgrade.py runs that release's operator and CRD)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl_api import (
    InvalidRLJob,
    load_rendered,
    parse,
    parse_waiving,
    spec_from_driver,
)
from kuberl_api.base import Rule
from kuberl_api.rljob import IMMUTABLE_SECTIONS
from kuberl_api.spec import RLJobSpec
from kuberl_api.spec.job_rules import JOB_RULES
from kuberl_operator.render import names, render_children
from kuberl_operator.status import (
    CreateAttempt,
    Decision,
    DeleteRayJob,
    DeleteRLJob,
    Observed,
    decide,
    section_digests,
)
from tests.unit.test_status import (
    NOW,
    PENDING_WL,
    QUEUED,
    RJ0,
    RUNNING_RJ0,
    TUN,
    _apply,
    ago,
    body,
    queued_status,
    raycluster,
    rayjob,
    running_status,
    spec,
)

STORAGE = {"pvc": "models", "mountPath": "/models"}
# Accepted before be39d6d, refused since: a tokenizer outside the model's PVC mount.
OLD_MODEL = {"path": "/models/qwen", "tokenizer": "/mnt/tokenizers/qwen", "storage": STORAGE}
TOKENIZER_RULE = "tokenizer must lie under storage.mountPath when a PVC holds the model"
WARNING = "AcceptedByEarlierRelease"


def old_spec(**extra: Any) -> dict[str, Any]:
    return spec(model=copy.deepcopy(OLD_MODEL), **extra)


def manifest(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body(spec=s).items() if k != "status"}


def accepted_digests(s: dict[str, Any]) -> dict[str, str]:
    """status.specDigests as the earlier release recorded them when it accepted `s`: the same
    function over the same values (e2e/test_upgrade.py checks it against that release's own
    operator), computed here from the spec with every rule waived."""
    job, _ = parse_waiving(manifest(s), lambda f: True)
    return section_digests(job.spec)


def old_running(s: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A running job as the earlier release left it: attempt 0, the digests it recorded."""
    s = s if s is not None else old_spec()
    extra.setdefault("progress", {"lastHeartbeatTime": ago(10)})
    return body(running_status(specDigests=accepted_digests(s), **extra), spec=s)


RUNNING = Observed(rayjobs=(RUNNING_RJ0,), raycluster=raycluster())


def conditions(d: Decision) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in d.status["conditions"]}


# ------------------------------------------------------------------ kuberl_api: the waiver


def test_parse_waiving_names_each_rule_where_it_sits() -> None:
    """Every rule that does not hold is found (not only a section's first, as `parse` reports),
    with the object it sits on and the field it names, down to a list item; a Python-only check
    (SGLang's flag table) too. Each is worded as `parse` words it."""
    s = old_spec(data={"prompts": "/data/t.jsonl", "storage": {"pvc": "d", "mountPath": "/data"},
                       "evalSets": [{"name": "e", "path": "/other/e.jsonl"}]},
                 schedule={"evalInterval": 5},
                 training={"nodePool": {"tolerations": [
                     {"key": "a"}, {"key": "b", "operator": "Exists", "value": "x"}]}},
                 network={"env": {"NCCL=DEBUG": "1"}},
                 rollout={"engineArgs": {"no-such-flag": "1"}})
    job, failures = parse_waiving(manifest(s), lambda f: True)
    assert job.spec.model.tokenizer == "/mnt/tokenizers/qwen"
    where = {(f.node, f.field) for f in failures}
    assert where == {
        ("spec.model", "spec.model.tokenizer"),
        ("spec.data", "spec.data.evalSets"),
        ("spec.training.nodePool.tolerations[1]", "spec.training.nodePool.tolerations[1].value"),
        ("spec.network.env", "spec.network.env"),
        ("spec.rollout", "spec.rollout.engineArgs"),
    }, failures
    with pytest.raises(InvalidRLJob) as strict:
        parse(manifest(s))
    assert {f.line() for f in failures} == set(strict.value.problems)


def test_parse_waiving_waives_rules_only() -> None:
    """A problem no rule raises (a bound, an unknown field) is refused whatever the policy;
    rules the policy turns down are refused, all of them named."""
    bound = manifest(old_spec(training={"nodes": 0}))
    with pytest.raises(InvalidRLJob, match=r"spec\.training\.nodes"):
        parse_waiving(bound, lambda f: True)
    unknown = manifest(spec(model={**OLD_MODEL, "tokeniser": "/models/t"}))
    with pytest.raises(InvalidRLJob, match=r"spec\.model\.tokeniser: is not a known field"):
        parse_waiving(unknown, lambda f: True)
    s = old_spec(algorithm={"advantageEstimator": "on_policy_distillation",
                            "teacherPath": "/teachers/t"})
    with pytest.raises(InvalidRLJob) as refused:
        parse_waiving(manifest(s), lambda f: f.node == "spec.model")
    assert refused.value.problems == [
        "spec.algorithm.teacherPath: algorithm.teacherPath must lie under "
        "model.storage.mountPath when a PVC holds the model: model.storage.mountPath = "
        "/models (got '/teachers/t')"]
    valid = manifest(spec())
    assert parse_waiving(valid, lambda f: False) == (parse(valid), ())


# ------------------------------------------------------------------- the operator's decision


def test_running_job_accepted_by_an_earlier_release_keeps_being_tracked() -> None:
    """The stored spec breaks a rule this release added, on a section unchanged since it was
    accepted: Accepted stays True, SpecWarning says which field and why, one Warning Event;
    the RayJob's progress is the job's, to the end. (Without ratcheting: InvalidSpec and
    nothing tracked.)"""
    b = old_running()
    d = decide(b, RUNNING, NOW, TUN)
    assert d.phase == "Running" and d.actions == ()
    got = conditions(d)
    assert got["Accepted"] == ("True", "Accepted"), got
    assert got["SpecWarning"] == ("True", WARNING), got
    assert got["Training"] == ("True", "Running"), got
    message = d.condition("SpecWarning")["message"]
    assert f"spec.model.tokenizer: {TOKENIZER_RULE}" in message, message
    assert "/mnt/tokenizers/qwen" in message, message
    assert [(e.type, e.reason, e.message) for e in d.events] == [("Warning", WARNING, message)]
    assert [f.field for f in d.waived] == ["spec.model.tokenizer"]
    assert d.status["specDigests"] == b["status"]["specDigests"]

    # The next pass: nothing to patch, the Event is not posted again.
    b2 = _apply(b, d)
    again = decide(b2, RUNNING, NOW, TUN)
    assert again.status_patch(b2["status"]) is None
    assert again.events == () and again.actions == ()

    done = Observed(rayjobs=(rayjob(0, "SUCCEEDED", "Complete", cluster="c0",
                                    started=ago(500)),), raycluster=raycluster())
    finished = decide(b2, done, NOW, TUN)
    assert finished.phase == "Succeeded", conditions(finished)
    assert [e.reason for e in finished.events] == ["Succeeded"]


def test_restart_renders_the_accepted_spec_and_the_trainer_loads_it(tmp_path: Path) -> None:
    """A failed attempt of such a job is restarted like any other; the new attempt renders the
    spec as accepted, and its config names the waived field, so `kuberl run --in-cluster` (a
    trainer image with this release's rules) loads it, waiving that field's rule only; Ray
    actors take the spec their driver validated."""
    b = old_running()
    failed = Observed(rayjobs=(rayjob(0, "FAILED", "Failed", cluster="c0"),),
                      raycluster=raycluster())
    d = decide(b, failed, NOW, TUN)
    assert list(d.actions) == [CreateAttempt(1, 1), DeleteRayJob(RJ0)]
    assert d.job is not None and d.job.spec.model.tokenizer == "/mnt/tokenizers/qwen"
    children = render_children(d.job, 1, waived=d.waived)
    (config,) = [c for c in children if c["kind"] == "ConfigMap"]
    text = config["data"][names.CONFIG_KEY]
    rendered = yaml.safe_load(text)
    assert rendered["spec"]["model"]["tokenizer"] == "/mnt/tokenizers/qwen"
    assert rendered["metadata"]["annotations"] == {
        "kuberl.dev/waived-rules": '["spec.model.tokenizer"]'}
    path = tmp_path / "rljob.yaml"
    path.write_text(text)
    job, waived = load_rendered(path)
    assert job.spec == d.job.spec and [f.field for f in waived] == ["spec.model.tokenizer"]
    with pytest.raises(InvalidRLJob, match=TOKENIZER_RULE):  # the annotation is what lets it in
        parse(rendered)
    spec_json = job.spec.model_dump_json(by_alias=True)
    assert spec_from_driver(spec_json) == job.spec
    with pytest.raises(ValueError, match=TOKENIZER_RULE):
        RLJobSpec.model_validate_json(spec_json)

    # Only the fields the operator named are waived.
    broken = copy.deepcopy(rendered)
    broken["spec"]["data"]["storage"] = {"pvc": "d", "mountPath": "/mnt/d"}
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(InvalidRLJob, match=r"spec\.data\.prompts: prompts must lie under"):
        load_rendered(path)


def test_finished_job_keeps_its_ttl() -> None:
    """Reconciled to the end: a finished job's ttlSecondsAfterFinished still deletes it."""
    s = old_spec(ttlSecondsAfterFinished=60)
    b = body({"phase": "Succeeded", "rayJobName": RJ0, "completionTime": ago(120),
              "specDigests": accepted_digests(s)}, spec=s)
    d = decide(b, Observed(), NOW, TUN)
    assert DeleteRLJob() in d.actions and conditions(d)["SpecWarning"][0] == "True"


def test_a_cross_section_rule_is_waived_only_with_every_section_unchanged() -> None:
    """algorithm.teacherPath outside the model's mount (refused since be39d6d) is a rule across
    sections: waived while every recorded section is the accepted one, refused once one
    changed (the change may be what breaks it)."""
    distill = {"advantageEstimator": "on_policy_distillation", "teacherPath": "/teachers/t"}
    s = spec(model={"path": "/models/qwen", "storage": STORAGE}, algorithm=distill)
    d = decide(old_running(s), RUNNING, NOW, TUN)
    assert conditions(d)["SpecWarning"] == ("True", WARNING)
    assert "spec.algorithm.teacherPath" in d.condition("SpecWarning")["message"]

    edited = copy.deepcopy(s)
    edited["data"] = {"prompts": "/data/other.jsonl"}
    b = body(running_status(specDigests=accepted_digests(s)), spec=edited)
    refused = decide(b, RUNNING, NOW, TUN)
    assert conditions(refused)["Accepted"] == ("False", "InvalidSpec")
    assert refused.job is None and refused.actions == ()


@pytest.mark.parametrize(("case", "job"), [
    # nothing ran, and a Pending spec can be fixed
    ("never accepted", body(spec=old_spec())),
    ("accepted, no attempt yet", body({"phase": "Pending",
                                       "specDigests": accepted_digests(old_spec())},
                                      spec=old_spec())),
    # the section the rule sits on changed since it was accepted
    ("the section changed", body(running_status(specDigests=accepted_digests(spec(
        model={**OLD_MODEL, "tokenizer": "/mnt/tokenizers/old"}))), spec=old_spec())),
    # the model cannot hold the value: nothing could render it
    ("not a rule's problem", body(running_status(specDigests=accepted_digests(old_spec())),
                                  spec=old_spec(backoffLimit=100))),
    # a rule across sections that reads `async`, which has no digest
    ("a rule on a section without a digest", body(running_status(
        specDigests=accepted_digests(spec())), spec=spec(**{"async": {"maxStaleness": 2}}))),
])
def test_refused_as_before(case: str, job: dict[str, Any]) -> None:
    d = decide(job, RUNNING, NOW, TUN)
    assert conditions(d)["Accepted"] == ("False", "InvalidSpec"), case
    assert conditions(d)["SpecWarning"] == ("False", "InvalidSpec"), case
    assert d.job is None and d.actions == () and d.waived == (), case
    assert [e.reason for e in d.events] == ["InvalidSpec"], case


def test_a_valid_change_to_another_section_is_judged_as_any_change() -> None:
    """The waived section unchanged, another immutable one changed on a running job: refused as
    immutable (the job runs on as accepted), the warning still up."""
    b = old_running()
    b["spec"]["algorithm"] = {"klCoef": 0.01}
    d = decide(b, RUNNING, NOW, TUN)
    got = conditions(d)
    assert got["Accepted"] == ("False", "ImmutableFieldChanged"), got
    assert got["SpecWarning"] == ("True", WARNING), got
    assert d.phase == "Running"


def test_a_queued_job_waits_and_an_edit_of_another_section_requeues_it() -> None:
    """Queued in Kueue under the earlier release (Pending, with an attempt): it waits, warned;
    an edit of another section (Pending specs are editable) is validated and requeues the job,
    the accepted section still waived in the new attempt."""
    s = old_spec(scheduling=QUEUED)
    suspended = Observed(rayjobs=(rayjob(0, "", "Suspended", suspend=True),),
                         workload=PENDING_WL)
    b = body(queued_status(specDigests=accepted_digests(s)), spec=s)
    d = decide(b, suspended, NOW, TUN)
    assert d.phase == "Pending" and d.actions == (), conditions(d)
    assert conditions(d)["Queued"] == ("True", "Pending")
    assert conditions(d)["SpecWarning"] == ("True", WARNING)

    edited = copy.deepcopy(b)
    edited["spec"]["training"] = {"nodes": 2}
    requeued = decide(edited, suspended, NOW, TUN)
    assert list(requeued.actions) == [CreateAttempt(1, 0), DeleteRayJob(RJ0)]
    assert [f.field for f in requeued.waived] == ["spec.model.tokenizer"]
    edited["spec"]["training"] = {"nodes": 0}  # the edit itself is checked
    assert conditions(decide(edited, suspended, NOW, TUN))["Accepted"] == ("False",
                                                                          "InvalidSpec")


def test_a_valid_job_has_no_warning() -> None:
    d = decide(body(running_status()), RUNNING, NOW, TUN)
    assert conditions(d)["SpecWarning"] == ("False", "SpecValid") and d.waived == ()


def test_job_rules_read_only_sections_with_digests() -> None:
    """A rule across sections is waived only while every section with a digest is unchanged,
    so it may read only those, or else name a field in the one it reads without a digest
    (ratchet refuses to waive that). Editable fields (suspend, backoffLimit, ...) have no
    digest: a rule reading them could be broken by an edit and still be waived."""
    for rule in JOB_RULES:
        read = set(re.findall(r"self\.(\w+)", rule.cel))
        aliases = {RLJobSpec.model_fields[s].alias or s for s in IMMUTABLE_SECTIONS}
        named = (rule.field or "").split(".")[0]
        assert named and read - aliases <= {named}, (rule.message, read - aliases)


def test_a_rule_that_cannot_be_evaluated_does_not_hold_under_a_waiver() -> None:
    """Under a Waiver a model's rules run on values a nested rule turned down; one that raises
    there is a failure like any other (strict parsing never gets there: it raises)."""
    rule = Rule("self.a / self.b > 0", lambda node: 1 / 0 > 0, "a / b must be positive", "a")
    with pytest.raises(ZeroDivisionError):
        rule.failure(object())
    error = rule.failure(object(), at="x", lenient=True)
    assert error is not None and error.field == "x.a"
    assert str(error) == "x.a: a / b must be positive (got values the rule could not evaluate)"
