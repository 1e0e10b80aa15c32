"""What the API server does with an RLJob at `kubectl apply`, in Python, for unit tests.

Given the generated CRD's openAPIV3Schema this applies defaults, rejects unknown fields (kubectl's
strict field validation), checks types/enums/bounds (jsonschema, OpenAPI 3.0 = draft 4
semantics), and evaluates every `x-kubernetes-validations` CEL rule with cel-python, binding
`self`/`oldSelf` as Kubernetes does. Like the server it still runs the CEL rules after schema
errors that leave the values usable (a minimum, a maximum, a pattern), so a rule that fails to
evaluate on such an object (a division by zero) is caught here too. It is a stand-in for speed,
not a replacement: the e2e tier applies the same manifests to a real kube-apiserver.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.evaluation import CELEvalError

Schema = dict[str, Any]
_ENV = celpy.Environment()
# Schema errors after which the API server skips the CEL rules (hasBlockingErr in
# apiextensions-apiserver's customresource strategy: wrong type, required, enum, too long,
# too many items or properties); after any other it runs them on the object as it is.
_BLOCKING = frozenset({"type", "required", "enum", "maxLength", "maxItems", "maxProperties"})
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
    in `number` fields become doubles (CEL sees them as double on a real server)."""
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


def _schema_errors(schema: Schema, value: Any) -> tuple[list[str], bool]:
    """The problems, and whether one of them keeps the server from running the CEL rules."""
    validator = jsonschema.Draft4Validator(schema)
    out = []
    blocking = False
    for err in validator.iter_errors(value):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        out.append(f"{path.lstrip('.')}: {err.message}")
        blocking = blocking or err.validator in _BLOCKING
    return out, blocking


def _cel_errors(schema: Schema, value: Any, old: Any, path: str) -> list[str]:
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue  # Kubernetes skips transition rules on create
        ctx = {"self": _to_cel(value)}
        if transition:
            ctx["oldSelf"] = _to_cel(old)
        try:
            result = _program(rule["rule"]).evaluate(ctx)
        except CELEvalError as exc:  # a real server rejects the object on evaluation errors
            raise AssertionError(f"CEL rule errored at {path}: {rule['rule']}: {exc}") from exc
        assert isinstance(result, celtypes.BoolType), rule["rule"]
        if not result:
            where = f"{path}{rule.get('fieldPath', '')}".lstrip(".")
            out.append(f"{where}: {rule['message']}")
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in value:
                sub_old = old.get(name) if isinstance(old, dict) else None
                out += _cel_errors(prop, value[name], sub_old, f"{path}.{name}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        # Rules on list items run on each item (as on a create: transition rules on items of
        # a list that is not a map-list have no old item to compare with).
        for i, item in enumerate(value):
            out += _cel_errors(schema["items"], item, None, f"{path}[{i}]")
    return out


def admit(schema: Schema, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Problems the API server would report for `obj` (an update of `old` when given);
    empty when it would be accepted. Each line starts with the field path."""
    new = apply_defaults(schema, copy.deepcopy(obj))
    prev = apply_defaults(schema, copy.deepcopy(old)) if old is not None else None
    unknown = [p.lstrip(".") for p in _unknown_fields(schema, new, "")]
    if unknown:  # strict field validation refuses the request before validating it
        return unknown
    problems, blocking = _schema_errors(schema, new)
    if blocking:
        return problems
    return problems + _cel_errors(schema, new, prev, "")
