"""Generate the RLJob CustomResourceDefinition from the pydantic model (pure; no client).

Pydantic writes JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3.0 schema:
every node typed, no $ref, no anyOf-with-null, boolean exclusiveMinimum, defaults that the API
server can apply. `structural()` does that translation; `rljob_crd()` wraps it in the CRD.

The model's cross-field rules arrive as CEL (`x-kubernetes-validations`) at the nodes they
validate: `validated_schema()`. The CRD carries the schema without them (`openapi_schema()`):
policy.py turns them into the ValidatingAdmissionPolicy that checks them, where status writes
never meet them.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from kuberl_api import rljob
from kuberl_api.base import CEL_KEY
from kuberl_api.rljob import RLJob
from kuberl_api.spec import RLJobSpec
from kuberl_api.status import RLJobStatus

Schema = dict[str, Any]

# Keys pydantic emits that a structural schema has no use for (or forbids).
_DROP = {"title", "$defs", "additionalProperties"}


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    return node


def _unwrap_optional(node: Schema) -> Schema:
    """`X | None` arrives as anyOf[X, null]; in Kubernetes "absent" already means None."""
    variants = node.get("anyOf")
    if not variants:
        return node
    real = [v for v in variants if v.get("type") != "null"]
    if len(real) != 1:
        raise ValueError(f"only Optional unions are supported in the RLJob model: {node}")
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    if rest.get("default", ...) is None:
        del rest["default"]
        rest[UNSET_BY_DEFAULT] = True  # (see _default_nested_objects)
    return {**real[0], **rest}


# Marks a field whose default is None (unset) for its parent section, which must not give it a
# default of its own; the parent removes the mark.
UNSET_BY_DEFAULT = "x-kuberl-unset-by-default"


def structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Translate one pydantic JSON-schema node (and its children) into structural OpenAPI."""
    node = _resolve(_unwrap_optional(_resolve(node, defs)), defs)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out["properties"] = {k: structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs)
            out["items"].pop(UNSET_BY_DEFAULT, None)
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs)
    if out.get("type") == "object" and "properties" in out:
        _default_nested_objects(out)
    return out


def _default_nested_objects(obj: Schema) -> None:
    """Sections, maps and lists that have defaults in pydantic (default_factory, which JSON
    Schema omits) get a default, so the API server materialises them; CEL rules can then read
    `self.training.gpusPerNode` without has() guards.

    A section's default is written out in full (every field that has a default, nested
    sections included), not as `{}`: the API server checks a default against the section's
    own CEL rules *as written*, without defaulting inside it first, so `{}` fails any rule
    that reads a defaulted field. Children are translated before their parent, so their
    defaults are already in place here. A section whose pydantic default is None (an optional
    one: `X | None = None`) gets none."""
    required = set(obj.get("required", []))
    for name, prop in obj["properties"].items():
        unset = prop.pop(UNSET_BY_DEFAULT, False)  # an optional section stays absent
        if name in required or "default" in prop or unset:
            continue
        if prop.get("type") == "array":
            prop["default"] = []
        elif prop.get("type") == "object" and not prop.get("required"):
            prop["default"] = {k: copy.deepcopy(child["default"])
                               for k, child in prop.get("properties", {}).items()
                               if "default" in child}


def _model_schema(model: type[Any]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def validated_schema() -> Schema:
    """The RLJob's structural schema with every rule's CEL at the node it validates (the
    source of the policy's checks; tests evaluate both against the same manifests)."""
    spec = _model_schema(RLJobSpec)
    spec["description"] = "What to train, on which GPUs, and how. See the kuberl README."
    status = _model_schema(RLJobStatus)
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return {
        "type": "object",
        "description": RLJob.__doc__ or "An LLM reinforcement-learning job.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        CEL_KEY: rljob.root_rules(),
    }


def without_rules(node: Any) -> Any:
    """`node` with no `x-kubernetes-validations` anywhere below it."""
    if isinstance(node, dict):
        return {k: without_rules(v) for k, v in node.items() if k != CEL_KEY}
    if isinstance(node, list):
        return [without_rules(v) for v in node]
    return node


def openapi_schema() -> Schema:
    """The CRD's schema: types, bounds, enums, patterns and defaults; no CEL (policy.py)."""
    schema: Schema = without_rules(validated_schema())
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
    {"name": "Trainer", "type": "string", "jsonPath": ".status.progress.trainerPhase",
     "priority": 1},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {"name": "RayJob", "type": "string", "jsonPath": ".status.rayJobName", "priority": 1},
    {"name": "Engine-Restarts", "type": "integer", "jsonPath": ".status.progress.engineRestarts",
     "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def rljob_crd() -> dict[str, Any]:
    """The CustomResourceDefinition for RLJob, as a plain dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{rljob.PLURAL}.{rljob.GROUP}",
            "labels": {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/part-of": "kuberl"},
        },
        "spec": {
            "group": rljob.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": rljob.KIND,
                "listKind": f"{rljob.KIND}List",
                "plural": rljob.PLURAL,
                "singular": rljob.SINGULAR,
                "shortNames": list(rljob.SHORT_NAMES),
                "categories": ["all", "kuberl"],
            },
            "versions": [{
                "name": rljob.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


HEADER = "# Generated by `kuberl crd` from the model in operator/kuberl_api. Do not edit.\n"


def rljob_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(rljob_crd(), sort_keys=False, width=100)
