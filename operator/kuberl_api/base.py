"""Shared pieces of the RLJob model: the base class, CEL rule annotations and field errors.

Every cross-field rule exists twice: once as Python (a model validator, so `kuberl` and the
operator give the same message) and once as a CEL rule in the CRD (so `kubectl apply` refuses
it). The two are kept equal by tests that evaluate the CEL rules against the same manifests.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
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


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )


def check(condition: bool, field: str, value: object, problem: str) -> None:
    if not condition:
        raise FieldError(field, value, problem)
