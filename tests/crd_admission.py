"""What the API server does with an RLJob at `kubectl apply`, in Python, for unit tests.

Given the RLJob's validated schema (`crd.validated_schema()`: the CRD's openAPIV3Schema with
every rule's CEL at the node it validates), this does what kube-apiserver does with the CRD made
from it and the ValidatingAdmissionPolicy made from its rules (kuberl_operator/policy.py):
applies defaults, rejects unknown fields (kubectl's strict field validation), checks
types/enums/bounds (jsonschema, OpenAPI 3.0 = draft 4 semantics) and, only when the schema
holds (the API server validates an object against its CRD before admission runs the policy),
evaluates the policy's checks with cel-python, binding `object`, `oldObject`, `request` and the
policy's variables as the server does. It is a stand-in for speed, not a replacement: the e2e
tier applies the same manifests to a real kube-apiserver with the policy installed.

Two differences from the server, both checked there: whole numbers in `number` fields become
doubles here (the policy reads them as ints, which CEL compares with doubles as numbers;
cel-python does not), and the policy's assembly of its checks' problems into one message (a
list, `join`, `indexOf`) is not evaluated here, only each check.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.evaluation import CELEvalError

from kuberl_operator.crd import without_rules
from kuberl_operator.policy import (
    SPEC_WRITTEN,
    UNCHANGED,
    Check,
    checks,
    unchanged_variable,
)

Schema = dict[str, Any]
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def _to_cel(value: Any) -> Any:
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
    return celpy.json_to_cel(value)


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting: absent properties with a default get it, recursively; integers
    in `number` fields become doubles (cel-python compares no int with a double)."""
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "object" and isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    if kind == "array" and isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _unknown_fields(schema: Schema, value: Any, path: str) -> list[str]:
    out: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            prop = schema["properties"].get(key)
            if prop is None:
                out.append(f"{path}.{key}: field not declared in schema")
            else:
                out += _unknown_fields(prop, sub, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            out += _unknown_fields(schema["items"], sub, f"{path}[{i}]")
    return out


def _schema_errors(schema: Schema, value: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    out = []
    for err in validator.iter_errors(value):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        out.append(f"{path.lstrip('.')}: {err.message}")
    return out


def _evaluate(expr: str, ctx: dict[str, Any], what: str) -> Any:
    try:
        return _program(expr).evaluate(ctx)
    except CELEvalError as exc:  # the policy fails closed: the server refuses the object
        raise AssertionError(f"the policy's CEL errored for {what}: {expr}: {exc}") from exc


_POLICIES: dict[int, tuple[Schema, list[Check], str]] = {}


def _policy(schema: Schema) -> tuple[list[Check], str]:
    """The policy's checks and its `unchanged` variable, made once per schema."""
    if id(schema) not in _POLICIES:
        _POLICIES[id(schema)] = (schema, checks(schema), unchanged_variable(schema))
    _, policy_checks, unchanged = _POLICIES[id(schema)]
    return policy_checks, unchanged


def policy_problems(schema: Schema, new: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    """What the policy made from `schema`'s rules refuses in `new` (an update of `old`, both
    defaulted), one "path: message" line per problem."""
    ctx: dict[str, Any] = {
        "object": _to_cel(new), "oldObject": _to_cel(old),
        "request": _to_cel({"operation": "CREATE" if old is None else "UPDATE"})}
    if not _evaluate(SPEC_WRITTEN, ctx, "matchConditions"):
        return []  # an update that leaves the spec as it was: the policy does not apply
    policy_checks, unchanged = _policy(schema)
    ctx["variables"] = celtypes.MapType(
        {celtypes.StringType(UNCHANGED): _evaluate(unchanged, ctx, UNCHANGED)})
    out = []
    for check in policy_checks:
        if check.items is None:
            result = _evaluate(check.test, ctx, check.where)
            assert isinstance(result, celtypes.BoolType), check.test
            if not result:
                out.append(f"{check.where}: {check.message}")
            continue
        listed = list(_evaluate(check.listed, ctx, check.where))
        for item in _evaluate(check.items, ctx, check.where):
            if not _evaluate(check.test, {**ctx, "item": item}, check.where):
                where = f"{check.where}[{listed.index(item)}]{check.item_field}"
                out.append(f"{where}: {check.message}")
    return out


def admit(schema: Schema, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Problems the API server would report for `obj` (an update of `old` when given), with
    the CRD and the policy made from `schema`; empty when it would be accepted. Each line
    starts with the field path (empty for a rule about the object as a whole)."""
    crd_schema = without_rules(schema)
    new = apply_defaults(crd_schema, copy.deepcopy(obj))
    prev = apply_defaults(crd_schema, copy.deepcopy(old)) if old is not None else None
    unknown = [p.lstrip(".") for p in _unknown_fields(crd_schema, new, "")]
    if unknown:  # strict field validation refuses the request before validating it
        return unknown
    problems = _schema_errors(crd_schema, new)
    if problems:  # refused by the CRD's schema: admission (the policy) never runs
        return problems
    return policy_problems(schema, new, prev)
