"""Shared pieces of the RLJob model: the base class, rules (CEL and Python), and field errors.

Every rule of the API is a `Rule`, written once with both its forms side by side: a CEL
expression that the API server checks (the RLJob's ValidatingAdmissionPolicy, made from the
schema's CEL by kuberl_operator/policy.py, so `kubectl apply` refuses a violation) and a Python
predicate that the model checks (so `kuberl` and the operator refuse it too, with the same
message). A model lists its rules in `RULES` (its fields' in `FIELD_RULES`); its
`json_schema_extra` carries their CEL (`rules_schema`), and `ApiModel` checks their Python.
Tests evaluate the CEL rules against the same manifests, and check that every CEL rule in the
schema is a `Rule`'s (tests/unit/test_api_rules.py).

A `Waiver` in the validation context records the rules that do not hold instead of refusing
them: how an upgraded operator keeps running a job that an older kuberl accepted and newer
rules refuse (`kuberl_api.parse_waiving`, kuberl_operator/status/ratchet.py).
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
        super().__init__(f"{field}: {self.text}")

    @property
    def text(self) -> str:
        """The problem and the offending value, without the field."""
        return f"{self.problem} (got {self.value!r})"


@dataclass(frozen=True)
class RuleFailure:
    """A rule (or a Python-only check) that does not hold, as a `Waiver` found it.

    `node`: the object the rule sits on, as a path from the manifest's root ("spec.model" for
    a section's rule, "spec" for a rule across sections, "spec.network.env" for a field's own
    rule). `field`: the field the error names. `problem`: what is wrong and the value, worded
    as `kuberl_api.format_errors` words it."""

    node: str
    field: str
    problem: str

    def line(self) -> str:
        return f"{self.field}: {self.problem}"


# The key of a Waiver in pydantic's validation context.
WAIVER_CONTEXT = "kuberl_api.waiver"


class Waiver:
    """Validate with `context={WAIVER_CONTEXT: waiver}` and every rule that does not hold is
    recorded here instead of refused; nothing else is: a field's type, bounds, pattern or enum,
    an unknown field, fail as they always do. `failures(model)` then says where each lies.

    A model's rules then also run on values a nested model's rule turned down; a rule that
    cannot even be evaluated there counts as not holding. Where a failure lies is found after
    the validation, from the model it was found on: validators do not know where they are, and
    tracking it during validation would cost every parse (a wrap validator on every field)."""

    def __init__(self) -> None:
        self._found: list[tuple[BaseModel, str, FieldError]] = []

    def record(self, owner: BaseModel, at: str, error: FieldError) -> None:
        self._found.append((owner, at, error))

    def failures(self, root: BaseModel) -> tuple[RuleFailure, ...]:
        """The failures recorded on models inside `root` (a union's losing member was validated
        too, and is not), each once, in the order found."""
        paths = _model_paths(root)
        out: dict[RuleFailure, None] = {}
        for owner, at, error in self._found:
            where = paths.get(id(owner))  # (the waiver holds `owner`: its id is not reused)
            if where is not None:
                out[RuleFailure(_join(where, at), _join(where, error.field), error.text)] = None
        return tuple(out)


def waiver_of(info: ValidationInfo) -> Waiver | None:
    context = info.context
    found = context.get(WAIVER_CONTEXT) if isinstance(context, Mapping) else None
    return found if isinstance(found, Waiver) else None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _model_paths(root: BaseModel) -> dict[int, str]:
    """id -> path (camelCase, lists indexed) of every model inside `root`, `root` itself ''."""
    out: dict[int, str] = {}

    def visit(obj: Any, path: str) -> None:
        if isinstance(obj, BaseModel):
            out[id(obj)] = path
            for name, field in type(obj).model_fields.items():
                visit(getattr(obj, name), _join(path, field.alias or name))
        elif isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for key, item in obj.items():
                visit(item, _join(path, str(key)))

    visit(root, "")
    return out


class _Unevaluated:
    def __repr__(self) -> str:
        return "values the rule could not evaluate"


_UNEVALUATED = _Unevaluated()


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
        error = self.failure(node, at)
        if error is not None:
            raise error

    def failure(self, node: Any, at: str = "", lenient: bool = False) -> FieldError | None:
        """The FieldError of the rule not holding for `node`, or None. `lenient`: a rule that
        cannot be evaluated (it raised) does not hold, rather than raise (see Waiver)."""
        try:
            if self.holds(node):
                return None
        except Exception:
            if not lenient:
                raise
            return FieldError(_join(at, self.field or ""), _UNEVALUATED, self.message)
        field = _join(at, self.field or "")
        try:
            if self.value is not None:
                value = self.value(node)
            else:
                value = shown(_at(node, self.field) if self.field else node)
            problem = f"{self.message}: {self.detail(node)}" if self.detail else self.message
        except Exception:
            if not lenient:
                raise
            value, problem = _UNEVALUATED, self.message
        return FieldError(field, value, problem)


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
        rules = cls.FIELD_RULES.get(name)
        if rules and waiver_of(info) is None:  # (with a Waiver: in _rules_hold, on the model)
            for rule in rules:
                rule.check(value, at=cls.model_fields[name].alias or name)
        return value

    @model_validator(mode="after")
    def _rules_hold(self, info: ValidationInfo) -> Self:
        waiver = waiver_of(info)
        if waiver is None:
            for rule in self.RULES:
                rule.check(self)
            return self
        fields = type(self).model_fields
        for name, rules in self.FIELD_RULES.items():
            at = fields[name].alias or name
            for rule in rules:
                error = rule.failure(getattr(self, name), at, lenient=True)
                if error is not None:
                    waiver.record(self, at, error)
        for rule in self.RULES:
            error = rule.failure(self, lenient=True)
            if error is not None:
                waiver.record(self, "", error)
        return self

    def refuse(self, error: FieldError, info: ValidationInfo) -> None:
        """A Python-only check's failure (a check with no CEL form; rules fail in
        `_rules_hold`): raised, or recorded by the Waiver in `info`'s context."""
        waiver = waiver_of(info)
        if waiver is None:
            raise error
        waiver.record(self, "", error)
