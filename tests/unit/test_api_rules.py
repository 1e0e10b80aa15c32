"""Every rule of the RLJob spec is a `Rule` with both its forms: the CEL the schema carries
(`crd.validated_schema()`, from which the policy is made) is exactly the rules' CEL (none
written by hand without a Python twin), the models validate with the rules' Python (and nothing
else, bar the listed Python-only checks), and a manifest that breaks a rule gets the same
message, at the same field, from the model and from the policy's CEL."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest

from kuberl_api import InvalidRLJob, parse
from kuberl_api.base import CEL_KEY, ApiModel, Rule
from kuberl_api.engine_flags import (
    ENGINE_FLAGS_REFUSED,
    KUBERL_ENGINE_FLAGS,
    REWARD_ENGINE_FLAGS,
    REWARD_ENGINE_FLAGS_REFUSED,
)
from kuberl_api.spec import RLJobSpec
from kuberl_operator.crd import validated_schema
from tests.crd_admission import admit
from tests.unit.test_api_validation import BAD_SPECS, base, both, ppo, set_

SCHEMA = validated_schema()
SPEC_SCHEMA = SCHEMA["properties"]["spec"]

# CEL rules on a single field that have no Python twin, by (model, field): none. A schema rule
# that Python already enforces some other way (a pattern, a bound) belongs in the field's own
# schema keywords, not here; one that Python cannot check would go here, with the reason.
CEL_WITHOUT_TWIN: dict[tuple[str, str], str] = {}

# Validators that are not Rules, by model: checks with no CEL form.
PYTHON_ONLY = {
    # The CRD cannot carry SGLang's flag table (kuberl_api/engine_flags.py): the API server
    # admits what this refuses, and test_api_validation's SGLANG_REFUSES says so.
    "RolloutSpec": {"_sglang_engine_flags"},
    "RewardModelSpec": {"_sglang_engine_flags"},
    # Nor a format string's parser or a regular expression's compiler (reward.model.judge).
    "JudgeSpec": {"_fillable"},
}
# ApiModel's own validators, which check RULES and FIELD_RULES.
RULE_VALIDATORS = {"_rules_hold", "_field_rules_hold"}


def _sub_models(annotation: Any) -> Iterator[type[ApiModel]]:
    """The ApiModels inside a field's annotation (X, X | None, list[X], Annotated[X, ...])."""
    if isinstance(annotation, type) and issubclass(annotation, ApiModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _sub_models(arg)


def _models(model: type[ApiModel] = RLJobSpec) -> Iterator[type[ApiModel]]:
    yield model
    for info in model.model_fields.values():
        for sub in _sub_models(info.annotation):
            yield from _models(sub)


MODELS = sorted(set(_models()), key=lambda m: m.__name__)


def _rules() -> Iterator[tuple[str, Rule, str]]:
    """Every rule, with where it sits (`Model` or `Model.field`) and the field its errors name
    (the end of their path)."""
    for model in MODELS:
        for rule in model.RULES:
            yield model.__name__, rule, str(rule.field)
        for name, rules in model.FIELD_RULES.items():
            for rule in rules:
                yield f"{model.__name__}.{name}", rule, model.model_fields[name].alias or name


RULES = list(_rules())


def test_the_spec_has_rules_on_many_models() -> None:
    # A walk that found nothing would make every test below pass.
    assert len(MODELS) >= 20 and len(RULES) >= 80
    assert {where for where, _, _ in RULES} >= {"RLJobSpec", "AlgorithmSpec", "TrainingSpec",
                                             "RolloutSpec.engine_args", "NetworkSpec.env"}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_rule_has_both_forms(model: type[ApiModel]) -> None:
    for rule in model.RULES:
        assert rule.cel.strip() and callable(rule.holds) and rule.message.strip(), rule
        assert rule.field, f"{model.__name__}: a section's rule names the field it reports on"
    assert set(model.FIELD_RULES) <= set(model.model_fields), model.FIELD_RULES
    for rules in model.FIELD_RULES.values():
        for rule in rules:
            assert rule.cel.strip() and callable(rule.holds) and rule.message.strip(), rule
            assert rule.field is None, "a field's rule reports on the field it sits on"


def _cel(node: dict[str, Any]) -> list[dict[str, str]]:
    return list(node.get(CEL_KEY, []))


def _walk(model: type[ApiModel], node: dict[str, Any], path: str) -> Iterator[tuple[str, int]]:
    """Check that the CRD's node of `model` (and its sections', recursively) carries exactly the
    rules' CEL; yield each node checked, with how many CEL rules it carries."""
    assert _cel(node) == [rule.schema() for rule in model.RULES], path
    yield path, len(model.RULES)
    for name, info in model.model_fields.items():
        prop = node["properties"][info.alias or name]
        subs = list(_sub_models(info.annotation))
        if subs:
            (sub,) = subs
            assert name not in model.FIELD_RULES, f"{path}.{name}: rules on a section's field"
            inner = prop["items"] if prop["type"] == "array" else prop
            yield from _walk(sub, inner, f"{path}.{info.alias or name}")
            continue
        where = f"{path}.{info.alias or name}"
        paired = [rule.schema() for rule in model.FIELD_RULES.get(name, ())]
        assert _cel(prop)[:len(paired)] == paired, where
        assert len(_cel(prop)) == len(paired) or (model.__name__, name) in CEL_WITHOUT_TWIN, where
        yield where, len(_cel(prop))


def _all_cel(node: Any) -> int:
    """How many CEL rules the schema carries anywhere below `node`."""
    if isinstance(node, dict):
        return len(_cel(node)) + sum(_all_cel(v) for k, v in node.items() if k != CEL_KEY)
    if isinstance(node, list):
        return sum(_all_cel(v) for v in node)
    return 0


def test_the_crd_carries_exactly_the_rules_cel() -> None:
    """Each model's CEL list in the CRD is its rules' CEL, in order; each field's is its field
    rules'; and there is no CEL anywhere in spec's schema besides (nothing written by hand)."""
    checked = dict(_walk(RLJobSpec, SPEC_SCHEMA, "spec"))
    assert checked["spec.rollout.engineArgs"] > 10
    assert checked["spec.training.nodePool.tolerations"] == 3  # Toleration's, on each item
    assert _all_cel(SPEC_SCHEMA) == sum(checked.values())


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_models_validate_only_with_their_rules(model: type[ApiModel]) -> None:
    """No hand-written Python check beside the rules, so none lacks its CEL twin (bar
    PYTHON_ONLY's)."""
    decorators = model.__pydantic_decorators__
    validators = set(decorators.model_validators) | set(decorators.field_validators)
    assert validators - RULE_VALIDATORS == PYTHON_ONLY.get(model.__name__, set())


# Manifests that break the rules BAD_SPECS leaves unbroken (every rule is broken by one case).
EXTRA_BAD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("checkpoint-reserved", set_("checkpoint.path", "/dev/shm")),
    ("checkpoint-on-data-mount",
     both(set_("data", {"prompts": "/mnt/d/p.jsonl",
                        "storage": {"pvc": "d", "mountPath": "/mnt/d"}}),
          set_("checkpoint.path", "/mnt/d"))),
    ("critic-node-pool-when-shared", ppo(set_("critic.nodePool", {"nodeSelector": {"a": "b"}}))),
    *((f"engineArgs-sets-{flags[0]}", set_("rollout.engineArgs", {flags[0]: "1"}))
      for flags in (*KUBERL_ENGINE_FLAGS.values(), *ENGINE_FLAGS_REFUSED.values())),
    *((f"engineListArgs-sets-{flags[0]}", set_("rollout.engineListArgs", {flags[0]: ["1"]}))
      for flags in (*KUBERL_ENGINE_FLAGS.values(), *ENGINE_FLAGS_REFUSED.values())),
    ("reward-engineArgs-not-a-flag-name",
     set_("reward", {"type": "model", "model": {"path": "/m", "engineArgs": {"--tp": "1"}}})),
    *((f"reward-engineArgs-sets-{flags[0]}",
       set_("reward", {"type": "model", "model": {"path": "/m", "engineArgs": {flags[0]: "1"}}}))
      for flags in (*REWARD_ENGINE_FLAGS.values(), *REWARD_ENGINE_FLAGS_REFUSED.values())),
    ("reward-model-without-model", set_("reward", {"type": "model"})),
    ("reward-auth-not-remote", set_("reward", {"type": "exact", "auth": {"secret": "g"}})),
    ("reward-model-sglang-on-cpu",
     set_("reward", {"type": "model", "model": {"path": "/m", "gpusPerReplica": 0}})),
    ("reward-model-judge-without-judge",
     set_("reward", {"type": "model", "model": {"path": "/m", "form": "judge"}})),
    ("reward-model-reference-engine-arg",
     set_("reward", {"type": "model", "model": {"path": "/m", "engine": "reference",
                                                "engineArgs": {"chunked-prefill-size": "8"}}})),
    ("reward-model-path-off-storage",
     set_("reward", {"type": "model", "model": {
         "path": "/m", "storage": {"pvc": "rm", "mountPath": "/rm"}}})),
    ("reward-model-tokenizer-off-storage",
     set_("reward", {"type": "model", "model": {
         "path": "/rm/m", "tokenizer": "/t", "storage": {"pvc": "rm", "mountPath": "/rm"}}})),
    # Another claim, or another directory of the same one, where the policy's PVC is mounted.
    ("reward-model-pvc-on-the-model-mount",
     both(set_("model", {"path": "/mnt/x/m", "storage": {"pvc": "a", "mountPath": "/mnt/x"}}),
          set_("reward", {"type": "model", "model": {
              "path": "/mnt/x/rm", "storage": {"pvc": "b", "mountPath": "/mnt/x"}}}))),
    ("reward-model-pvc-on-the-data-mount",
     both(set_("data", {"prompts": "/mnt/x/p.jsonl",
                        "storage": {"pvc": "a", "mountPath": "/mnt/x", "subPath": "d"}}),
          set_("reward", {"type": "model", "model": {
              "path": "/mnt/x/rm", "storage": {"pvc": "a", "mountPath": "/mnt/x"}}}))),
    ("checkpoint-on-reward-model-mount",
     both(set_("reward", {"type": "model", "model": {
         "path": "/mnt/r/rm", "storage": {"pvc": "r", "mountPath": "/mnt/r"}}}),
          set_("checkpoint.path", "/mnt/r"))),
    ("lora-on-megatron", set_("training.lora", {"rank": 8})),
    ("lora-in-mode-eval",
     both(set_("mode", "eval"), set_("training.backend", "fsdp"),
          set_("training.lora", {"rank": 8}),
          set_("data", {"evalSets": [{"name": "e", "path": "/data/e.jsonl"}]}))),
    ("lora-path-off-storage",
     both(set_("model", {"path": "/mnt/m/m", "storage": {"pvc": "m", "mountPath": "/mnt/m"}}),
          set_("training.backend", "fsdp"),
          set_("training.lora", {"rank": 8, "path": "/elsewhere/adapter"}))),
    ("lora-adapter-on-lm-head",
     both(set_("training.backend", "fsdp"),
          set_("training.lora", {"rank": 8, "sync": "adapter",
                                 "targetModules": ["q_proj", "lm_head"]}))),
    ("lora-adapter-on-reference-tp",
     both(set_("training.backend", "fsdp"), set_("rollout.engine", "reference"),
          set_("rollout.gpusPerEngine", 2),
          set_("training.lora", {"rank": 8, "sync": "adapter"}))),
]
CASES = dict([(case, edit) for case, edit, *_ in BAD_SPECS] + EXTRA_BAD_SPECS)


def _manifest(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = base()
    edit(obj["spec"])
    return obj


def _rule_of(problem: str) -> Rule | None:
    """The rule a model's problem line ("path: message[: detail] (got ...)") comes from: of the
    rules that report on the field at its path, the one with the longest message it starts
    with."""
    path, _, text = problem.partition(": ")
    found = [rule for _, rule, field in RULES
             if f".{path}".endswith(f".{field}") and text.startswith(rule.message)]
    return max(found, key=lambda rule: len(rule.message), default=None)


@cache
def _problems(case: str) -> tuple[list[str], list[str]]:
    """What the model and what the CRD refuse in the case's manifest."""
    try:
        parse(_manifest(CASES[case]))
        model: list[str] = []
    except InvalidRLJob as exc:
        model = exc.problems
    return model, admit(SCHEMA, _manifest(CASES[case]))


def test_cases_are_distinct() -> None:
    assert len(CASES) == len(BAD_SPECS) + len(EXTRA_BAD_SPECS)


@pytest.mark.parametrize("case", CASES)
def test_a_broken_rule_gets_the_same_message_from_both(case: str) -> None:
    model, crd = _problems(case)
    for problem in model:
        rule = _rule_of(problem)
        if rule is None:
            continue  # a field's own bound or pattern, or an SGLang flag (PYTHON_ONLY)
        path = problem.partition(": ")[0]
        assert f"{path}: {rule.message}" in crd, (problem, crd)
    # The model reports only a section's first broken rule, the CRD every one; but what the
    # CRD refuses with a rule's message the model refuses too.
    messages = {rule.message for _, rule, _ in RULES}
    assert model or not [p for p in crd if p.partition(": ")[2] in messages], crd


def test_every_rule_is_broken_by_a_case() -> None:
    broken = {id(rule) for case in CASES for p in _problems(case)[0]
              if (rule := _rule_of(p)) is not None}
    missed = [f"{where}: {rule.message}" for where, rule, _ in RULES if id(rule) not in broken]
    assert not missed, "\n".join(missed)


def test_python_adds_the_values_a_rule_compared_to_its_cel_message() -> None:
    assert _problems("clip-high-below-clip")[0] == [
        "spec.algorithm.epsClipHigh: epsClipHigh must be at least epsClip: epsClip = 0.2 "
        "(got 0.1)"]
    assert _problems("engine-arg-kuberl-sets")[0] == [
        "spec.rollout.engineArgs: engineArgs may not set tp-size or tensor-parallel-size or tp "
        "(kuberl sets it from rollout.gpusPerEngine) (got 'tp-size')"]
