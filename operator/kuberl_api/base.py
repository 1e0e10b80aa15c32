"""Shared pieces of the RLJob model: the base class, rules (CEL and Python), and field errors.

Every rule of the API is a `Rule`, written once with both its forms side by side: a CEL
expression that the API server checks (the RLJob's ValidatingAdmissionPolicy, made from the
schema's CEL by kuberl_operator/policy.py, so `kubectl apply` refuses a violation) and a Python
predicate that the model checks (so `kuberl` and the operator refuse it too, with the same
message). A model lists its rules in `RULES` (its fields' in `FIELD_RULES`); its
`json_schema_extra` carries their CEL (`rules_schema`), and `ApiModel` checks their Python.
Tests evaluate the CEL rules against the same manifests, and check that every CEL rule in the
schema is a `Rule`'s (tests/unit/test_api_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

CEL_KEY = "x-kubernetes-validations"


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry. `field_path` (JSONPath relative to the node the rule
    sits on, e.g. ".parallelism.tp") makes the API server report the error on that field."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def cel_rules(*rules: dict[str, str]) -> dict[str, Any]:
    """`json_schema_extra` carrying CEL rules for a model or a field."""
    return {CEL_KEY: list(rules)}


class FieldError(ValueError):
    """A cross-field violation that names the offending field, relative to the model raising it.

    Pydantic keeps the original exception in the error's ctx, so `errors.format_errors` can join
    this relative path onto the model's location and print the full path the user wrote.
    """

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"{field}: {problem} (got {value!r})")


@dataclass(frozen=True)
class Rule:
    """One rule, in both its forms: `cel` for the API server, `holds` for the model, one
    `message`.

    Both forms read the node the rule sits on as `self`: a section (the model instance), or
    for a rule on a field, the field's value. `field` is the camelCase path below that node of
    the field the error names (CEL's fieldPath, without its leading '.'); a field's rule leaves
    it unset and names the field it sits on.

    CEL's message is fixed text; Python's error adds what it cannot: `detail`, the values the
    rule compared ("name = value", after the message and a colon), and the offending value
    ("(got ...)"), by default the value at `field` (a section as the fields set away from its
    defaults).

    `holds` sees only values within their fields' bounds (pydantic checks a model's rules once
    every field is valid), so unlike the CEL it needs no range guards (see common._outside).
    """

    cel: str
    holds: Callable[[Any], bool]
    message: str
    field: str | None = None
    value: Callable[[Any], object] | None = None
    detail: Callable[[Any], str] | None = None

    def schema(self) -> dict[str, str]:
        """The rule's `x-kubernetes-validations` entry."""
        return cel(self.cel, self.message, f".{self.field}" if self.field else None)

    def check(self, node: Any, at: str = "") -> None:
        """Raise FieldError when the rule does not hold for `node`; `at` is the camelCase name
        of the field a field's rule sits on."""
        if self.holds(node):
            return
        if self.value is not None:
            value = self.value(node)
        else:
            value = shown(_at(node, self.field) if self.field else node)
        problem = f"{self.message}: {self.detail(node)}" if self.detail else self.message
        raise FieldError(".".join(p for p in (at, self.field) if p), value, problem)


def key_rule(cel_test: str, key_ok: Callable[[str], bool], message: str) -> Rule:
    """A rule on a map field that each key must pass: `cel_test` is CEL over the map, `key_ok`
    the test of one key; Python's error names the first key that fails."""
    return Rule(cel_test, lambda keys: all(key_ok(k) for k in keys), message,
                value=lambda keys: next(k for k in keys if not key_ok(k)))


def rules_schema(rules: Iterable[Rule]) -> dict[str, Any]:
    """`json_schema_extra` carrying the CEL of `rules`, for a model or a field."""
    return cel_rules(*(rule.schema() for rule in rules))


def shown(value: object) -> object:
    """A field's value for an error message: a section as the fields set away from defaults."""
    return value.model_dump(by_alias=True, exclude_defaults=True) if isinstance(
        value, ApiModel) else value


def _at(node: Any, path: str) -> Any:
    """The value at camelCase `path` below the section `node`."""
    for part in path.split("."):
        fields = type(node).model_fields
        node = getattr(node, next(name for name, info in fields.items()
                                  if (info.alias or name) == part))
    return node


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields refused; checks its rules."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )

    # The model's rules and its fields' (by field name), in the order of the CEL lists their
    # json_schema_extra carry (rules_schema). Python reports the first that does not hold.
    RULES: ClassVar[tuple[Rule, ...]] = ()
    FIELD_RULES: ClassVar[Mapping[str, tuple[Rule, ...]]] = {}

    @field_validator("*")
    @classmethod
    def _field_rules_hold(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        for rule in cls.FIELD_RULES.get(name, ()):
            rule.check(value, at=cls.model_fields[name].alias or name)
        return value

    @model_validator(mode="after")
    def _rules_hold(self) -> Self:
        for rule in self.RULES:
            rule.check(self)
        return self


def check(condition: bool, field: str, value: object, problem: str) -> None:
    """A Python-only check's FieldError (a check with no CEL form; rules raise theirs in
    Rule.check)."""
    if not condition:
        raise FieldError(field, value, problem)
