"""The ValidatingAdmissionPolicy that checks the RLJob's rules (kuberl_operator/policy.py): what
it matches (never the status subresource), that it carries every rule once, and that it
ratchets as the API server ratcheted the CRD's rules. Its refusals are checked case by case
against the model in test_api_validation.py and test_api_rules.py (tests/crd_admission.py
evaluates its checks), and against a real API server in e2e/test_rljob.py."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl_api.base import CEL_KEY
from kuberl_cli.main import main
from kuberl_operator.crd import validated_schema
from kuberl_operator.policy import (
    bind,
    checks,
    reads,
    rljob_policy,
    rljob_policy_binding,
    rljob_policy_yaml,
    variables,
)
from tests.crd_admission import admit
from tests.unit.test_api_validation import base, both, set_

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = ROOT / "crds" / "rljob-policy.yaml"
CHART_COPY = ROOT / "helm" / "kuberl" / "policy" / "rljob-policy.yaml"
SCHEMA = validated_schema()


def test_crds_folder_has_the_policy_the_model_makes(capsys: Any) -> None:
    assert POLICY_FILE.read_text() == rljob_policy_yaml(), (
        "crds/rljob-policy.yaml drifted from the rules in operator/kuberl_api: run `make crd`")
    assert main(["crd", "--policy"]) == 0
    assert capsys.readouterr().out == POLICY_FILE.read_text()
    # the chart renders its copy (templates/validation-policy.yaml); `make crd` refreshes it
    assert CHART_COPY.read_text() == POLICY_FILE.read_text(), "run make crd"


def test_policy_checks_creates_and_updates_of_rljobs_and_nothing_else() -> None:
    policy, binding = yaml.safe_load_all(POLICY_FILE.read_text())
    assert policy == rljob_policy() and binding == rljob_policy_binding()
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    # "rljobs" is the resource alone: a subresource is matched only by its own name
    # ("rljobs/status") or a wildcard ("rljobs/*", "*/*"), so status writes never meet it.
    assert rule == {"apiGroups": ["kuberl.dev"], "apiVersions": ["v1alpha1"],
                    "operations": ["CREATE", "UPDATE"], "resources": ["rljobs"]}
    assert policy["spec"]["failurePolicy"] == "Fail"  # no verdict, no RLJob
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Deny"]}
    assert binding["metadata"]["name"] == policy["metadata"]["name"] == "rljobs.kuberl.dev"


def _schema_rules(node: dict[str, Any]) -> Iterator[dict[str, str]]:
    yield from node.get(CEL_KEY, [])
    for prop in node.get("properties", {}).values():
        yield from _schema_rules(prop)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _schema_rules(node[key])


def test_every_rule_is_one_check_with_its_message() -> None:
    rules = list(_schema_rules(SCHEMA))
    assert len(rules) > 100
    assert [c.message for c in checks()] == [r["message"] for r in rules]
    text = POLICY_FILE.read_text()
    assert all(c.message in text for c in checks())


def test_each_expression_fits_cel_s_parser() -> None:
    # cel-go parses at most 100,000 code points an expression: the checks are split by section
    for var in variables():
        assert len(var["expression"]) < 50_000, (var["name"], len(var["expression"]))


def test_number_fields_are_only_compared() -> None:
    """The policy reads the object without its schema: a whole number written in a `number`
    field (`gamma: 1`) is an int there. CEL compares ints with doubles as numbers, but has no
    arithmetic across them, so no rule may compute with a number field."""
    names: set[str] = set()

    def walk(node: dict[str, Any], name: str = "") -> None:
        if node.get("type") == "number":
            names.add(name)
        for key, prop in node.get("properties", {}).items():
            walk(prop, key)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], name)

    walk(SCHEMA)
    assert {"lr", "gamma", "memoryFraction"} <= names
    for rule in _schema_rules(SCHEMA):
        for name in names:
            arithmetic = (rf"\.{name}\b\s*[-+*/%]", rf"[-+*/%]\s*[\w.]*\.{name}\b")
            assert not any(re.search(a, rule["rule"]) for a in arithmetic), rule["rule"]


def test_bind_replaces_the_variable_only() -> None:
    rule = "self.path.startsWith('self') && has(self.storage) && x.self == self"
    assert bind(rule, "object.spec.model") == (
        "object.spec.model.path.startsWith('self') && has(object.spec.model.storage) && "
        "x.self == object.spec.model")
    assert bind("self.a == oldSelf.a", "object", "oldObject") == "object.a == oldObject.a"
    with pytest.raises(ValueError, match="transition rule"):
        bind("self.a == oldSelf.a", "object.spec")


def test_reads_are_the_fields_below_self_up_to_a_call() -> None:
    assert reads("self.storage.mountPath.endsWith('/') && self.path == ''") == {
        ("storage", "mountPath"), ("path",)}
    assert reads("self.evalSets.all(e, e.path == self.storage.mountPath)") == {
        ("evalSets",), ("storage", "mountPath")}
    assert reads("!self.exists(k, k in ['a']) || self.a") == {()}  # itself: all of it


# ------------------------------------------------------------------ ratcheting


def _stored(*edits: Any, phase: str | None = None) -> dict[str, Any]:
    """A job as the API server stored it, maybe before a rule it breaks existed."""
    obj = base()
    both(*edits)(obj["spec"])
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def _edited(old: dict[str, Any], *edits: Any) -> dict[str, Any]:
    new = copy.deepcopy(old)
    both(*edits)(new["spec"])
    return new


MEGATRON_ON_CPU = both(set_("training.backend", "megatron"), set_("training.gpusPerNode", 0),
                       set_("rollout.engine", "reference"))
GPUS_MESSAGE = "spec.training.gpusPerNode: backend megatron trains on GPUs"


def test_a_rule_is_not_enforced_on_an_update_that_leaves_its_inputs_alone() -> None:
    old = _stored(MEGATRON_ON_CPU)
    assert any(p.startswith(GPUS_MESSAGE) for p in admit(SCHEMA, old))  # refused as new
    # a job stored before the rule existed: editing another section is fine ...
    assert admit(SCHEMA, _edited(old, set_("suspend", True)), old) == []
    assert admit(SCHEMA, _edited(old, set_("algorithm.lr", 1e-5)), old) == []
    # ... editing what the rule reads is checked again
    problems = admit(SCHEMA, _edited(old, set_("training.nodes", 2)), old)
    assert any(p.startswith(GPUS_MESSAGE) for p in problems), problems


def test_a_cross_section_rule_ratchets_on_the_sections_it_reads() -> None:
    # rloo needs groups of 2 or more: a rule on spec.algorithm and spec.data
    old = _stored(set_("algorithm.advantageEstimator", "rloo"), set_("data.nSamplesPerPrompt", 1))
    refused = "spec.data.nSamplesPerPrompt:"
    assert any(p.startswith(refused) for p in admit(SCHEMA, old))
    assert admit(SCHEMA, _edited(old, set_("training.nodes", 2)), old) == []
    for section in (set_("algorithm.lr", 1e-5), set_("data.rolloutBatchSize", 64)):
        problems = admit(SCHEMA, _edited(old, section), old)
        assert any(p.startswith(refused) for p in problems), problems


def test_rules_on_list_items_ratchet_with_their_section() -> None:
    bad = set_("training.nodePool", {"tolerations": [{"operator": "Exists"},
                                                     {"operator": "Equal", "value": "a"}]})
    old = _stored(bad)
    assert admit(SCHEMA, old) == ["spec.training.nodePool.tolerations[1].key: operator Equal "
                                  "needs a key (only operator Exists may leave key empty, to "
                                  "tolerate every taint)"]
    assert admit(SCHEMA, _edited(old, set_("data.rolloutBatchSize", 64)), old) == []
    assert admit(SCHEMA, _edited(old, set_("training.nodes", 2)), old) == admit(SCHEMA, old)


def test_an_update_that_keeps_the_spec_is_not_checked() -> None:
    old = _stored(MEGATRON_ON_CPU, phase="Running")
    labelled = copy.deepcopy(old)
    labelled["metadata"]["labels"] = {"team": "a"}
    assert admit(SCHEMA, labelled, old) == []


def test_transition_rules_never_ratchet() -> None:
    # spec.model is immutable once the job runs, whatever else the update leaves alone
    old = _stored(MEGATRON_ON_CPU, phase="Running")
    problems = admit(SCHEMA, _edited(old, set_("model.path", "/models/other")), old)
    assert [p for p in problems if "immutable" in p] == [
        "spec.model: spec.model is immutable once the job has started; delete and recreate the "
        "RLJob"], problems
