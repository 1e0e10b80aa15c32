"""The RLJob's CEL rules as a ValidatingAdmissionPolicy (pure; no client).

The rules live in the model (each `Rule`'s CEL, carried at the schema node it validates:
`crd.validated_schema()`). The CRD carries none of them: the API server evaluates a CRD's
`x-kubernetes-validations` over the whole object on every write, /status included (a trainer's
heartbeat paid for every spec rule; bench/RESULTS.md). A ValidatingAdmissionPolicy matching the
`rljobs` resource, and not its `status` subresource, runs them only where the spec can change:
creates and updates of the RLJob itself.

Each rule becomes a `Check`: its CEL with `self` (and `oldSelf`) rebound to the object's field
(`object.spec.training`), guarded by has() where a section on the way is optional, and ratcheted
as the API server ratchets a CRD's rules: on an update, a rule whose inputs (the spec sections
it reads) are all unchanged is not evaluated, so a job stored before a rule existed still takes
edits to the rest of its spec (transition rules, which compare with `oldSelf`, are never
ratcheted). The policy lists every check's problem in one message, as the CRD's errors did.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import yaml

from kuberl_api import rljob
from kuberl_api.base import CEL_KEY
from kuberl_operator.crd import Schema, validated_schema

POLICY_NAME = f"{rljob.PLURAL}.{rljob.GROUP}"
LABELS = {"app.kubernetes.io/name": "kuberl", "app.kubernetes.io/part-of": "kuberl"}
# Between the problems of one refusal (the messages themselves may contain "; ").
SEPARATOR = " | "
ITEM = "item"  # the variable a rule on list items binds `self` to
# Identifiers the policy's CEL defines; a rule must not use them for its own variables.
RESERVED = ("object", "oldObject", ITEM, "variables", "request", "params", "namespaceObject",
            "authorizer")
# Shown when the list of problems is too long for a message (the API server's 5 KiB limit).
FALLBACK = ("the RLJob breaks several of kuberl's rules: `kuberl validate FILE` lists "
            "every problem")


@dataclass(frozen=True)
class Check:
    """One rule as the policy evaluates it.

    `test` is CEL over `object`, `oldObject`, `request` and the policy's `variables` that is
    true when the rule holds (or does not apply: an absent optional section, unchanged inputs).
    A rule on the items of a list has `items`, CEL for the list it checks (empty when the rule
    does not apply: ratcheted), and its `test` reads one item as `item`. `where` is the field
    the problem names: for an item rule, the list's path, followed by the item's index and
    `item_field`."""

    test: str
    where: str
    message: str
    items: str | None = None
    item_field: str = ""
    listed: str = ""  # an item rule's list, always (where its items' indices come from)

    def problem(self, index: int | None = None) -> str:
        """The line a violation adds to the refusal (the item's index for an item rule)."""
        where = self.where if self.items is None else f"{self.where}[{index}]{self.item_field}"
        return f"{where}: {self.message}" if where else self.message


# ------------------------------------------------------------------ reading a rule's CEL

_TOKENS = re.compile(r"""
    (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_FIELD = re.compile(r"\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")


def _spans(rule: str) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """Where the rule names `self` or `oldSelf`: (start, end, which, the fields it selects
    below it, up to a method call or an index)."""
    out = []
    for m in _TOKENS.finditer(rule):
        if m.lastgroup != "ident" or m.group() not in ("self", "oldSelf"):
            continue
        before = rule[:m.start()].rstrip()
        if before.endswith("."):
            continue  # a field named self, not the variable
        path: list[str] = []
        pos = m.end()
        while (f := _FIELD.match(rule, pos)) and not rule[f.end():].lstrip().startswith("("):
            path.append(f.group(1))
            pos = f.end()
        out.append((m.start(), m.end(), m.group(), tuple(path)))
    return out


def _identifiers(rule: str) -> set[str]:
    return {m.group() for m in _TOKENS.finditer(rule) if m.lastgroup == "ident"}


def bind(rule: str, self_expr: str, old_expr: str | None = None) -> str:
    """The rule with `self` (and `oldSelf`) replaced by CEL expressions."""
    out, last = [], 0
    for start, end, which, _ in _spans(rule):
        if which == "oldSelf" and old_expr is None:
            raise ValueError(f"a transition rule below the root is not supported: {rule}")
        out += [rule[last:start], self_expr if which == "self" else str(old_expr)]
        last = end
    return "".join(out) + rule[last:]


def reads(rule: str) -> set[tuple[str, ...]]:
    """The fields below `self` the rule reads (() for `self` itself), none nested in another."""
    paths = {path for _, _, which, path in _spans(rule) if which == "self"}
    return {p for p in paths if not any(p[:len(q)] == q and p != q for q in paths)}


# ------------------------------------------------------------------ the schema's paths

# Fields of every object that the API server sets (the schema leaves them optional).
SERVER_SET = ("apiVersion", "kind", "metadata")


def _steps(path: tuple[str, ...], schema: Schema) -> list[tuple[str, bool]]:
    """Each field on `path` from the object's root, with whether it may be absent (neither
    required nor defaulted). Fields the schema does not describe (metadata's: the API server's
    ObjectMeta) count as present."""
    out, node = [], schema
    for depth, name in enumerate(path):
        props = node.get("properties")
        if not props:
            out.append((name, False))
            node = {}
            continue
        child = props[name]
        optional = (name not in node.get("required", ()) and "default" not in child
                    and not (depth == 0 and name in SERVER_SET))
        out.append((name, optional))
        node = child
    return out


def _guarded(root: str, path: tuple[str, ...], schema: Schema, then: str | None,
             otherwise: str) -> str:
    """CEL: `then` (by default the value at `path` below `root`) where every optional field on
    `path` is set, else `otherwise` (selecting an absent field is an error in CEL)."""
    expr, guards = root, []
    for name, optional in _steps(path, schema):
        expr = f"{expr}.{name}"
        if optional:
            guards.append(f"has({expr})")
    out = expr if then is None else then
    for guard in reversed(guards):
        out = f"({guard} ? {out} : {otherwise})"
    return out


def value(root: str, path: tuple[str, ...], schema: Schema, absent: str = "null") -> str:
    """CEL: the value at `path` below `root` (`object` or `oldObject`), or `absent` where an
    optional field on the way is not set."""
    return _guarded(root, path, schema, None, absent)


# (Not `oldObject == null`: the same meaning, but tests/crd_admission.py's CEL evaluator cannot
# compare a map with null.)
CREATE = 'request.operation == "CREATE"'
UPDATE = 'request.operation == "UPDATE"'

# The policy's matchCondition: an update that leaves the spec as it was (labels, annotations,
# finalizers) has nothing to check: every rule's inputs are unchanged, or it compares the spec.
SPEC_WRITTEN = f"{CREATE} || object.spec != oldObject.spec"

# Ratcheting compares a rule's inputs by spec section (spec.training, spec.placement): a
# variable computes, once per update, which sections it left as they were.
UNCHANGED = "unchanged"


def _section(path: tuple[str, ...]) -> tuple[str, ...]:
    return path[:2]


def _unchanged(paths: set[tuple[str, ...]], schema: Schema) -> str:
    """CEL: an update that leaves every field in `paths` (their spec sections) as it was."""
    same = []
    for p in sorted({_section(p) for p in paths}):
        if p[0] == "spec" and len(p) == 2:
            same.append(f"variables.{UNCHANGED}.{p[1]}")
        else:
            same.append(f"{value('object', p, schema)} == {value('oldObject', p, schema)}")
    return " && ".join([UPDATE, *same])


def unchanged_variable(schema: Schema) -> str:
    """CEL: a map from each spec section to whether the update left it as it was (empty on a
    create, where nothing is ratcheted)."""
    sections = schema["properties"]["spec"]["properties"]
    same = [f"{cel_string(name)}: {value('object', ('spec', name), schema)} == "
            f"{value('oldObject', ('spec', name), schema)}" for name in sections]
    return f"{CREATE} ? {{}} : {{\n  " + ",\n  ".join(same) + "\n}"


# ------------------------------------------------------------------ rules -> checks


def _rules(node: Schema, path: tuple[str, ...] = (),
           item_of: tuple[str, ...] | None = None) -> list[tuple[tuple[str, ...],
                                                                 tuple[str, ...] | None,
                                                                 dict[str, str]]]:
    """Every rule in the schema: (its node's path, the list's path when the node is a list's
    item, the rule), parents before children. Below a list's items `path` restarts at the
    item."""
    out = [(path, item_of, rule) for rule in node.get(CEL_KEY, [])]
    for name, prop in node.get("properties", {}).items():
        out += _rules(prop, (*path, name), item_of)
    if isinstance(node.get("items"), dict):
        if item_of is None:
            out += _rules(node["items"], (), path)
        elif _rules(node["items"]):  # (a nested list without rules, evalSets[].passK, is fine)
            raise ValueError(f"rules on items of nested lists are not supported: {path}")
    if isinstance(node.get("additionalProperties"), dict) and _rules(node["additionalProperties"]):
        raise ValueError(f"rules on map values are not supported: {path}")
    return out


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _check(schema: Schema, path: tuple[str, ...], item_of: tuple[str, ...] | None,
           rule: dict[str, str]) -> Check:
    text = rule["rule"]
    clash = _identifiers(text) & set(RESERVED)
    if clash:
        raise ValueError(f"a rule uses {sorted(clash)}, which the policy defines: {text}")
    field = rule.get("fieldPath", "")
    if item_of is not None:
        if path:
            raise ValueError(f"rules inside a list's items are supported on the item only: {text}")
        # The list is the rule's input: while its section is unchanged, no item is checked.
        listed = value("object", item_of, schema, "[]")
        items = f"({_unchanged({item_of}, schema)}) ? [] : {listed}"
        return Check(bind(text, ITEM), _dotted(item_of), rule["message"], items=items,
                     item_field=field, listed=listed)
    where = (_dotted(path) + field).lstrip(".")
    node_expr = ".".join(("object", *path))
    if "oldSelf" in {w for _, _, w, _ in _spans(text)}:
        if any(optional for _, optional in _steps(path, schema)):
            raise ValueError(f"a transition rule on an optional section: {text}")
        old_expr = ".".join(("oldObject", *path))
        test = f"{CREATE} || ({bind(text, node_expr, old_expr)})"
    else:
        inputs = {(*path, *p) for p in reads(text)}
        # an absent optional section: the rule does not apply
        applies = _guarded("object", path, schema, f"({bind(text, node_expr)})", "true")
        test = f"({_unchanged(inputs, schema)}) || {applies}"
    return Check(test, where, rule["message"])


def checks(schema: Schema | None = None) -> list[Check]:
    """Every rule of the RLJob as the policy checks it, in the schema's order."""
    schema = validated_schema() if schema is None else schema
    return [_check(schema, path, item_of, rule) for path, item_of, rule in _rules(schema)]


# ------------------------------------------------------------------ the policy


def cel_string(text: str) -> str:
    """A CEL string literal of `text`."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def problems_expression(group: list[Check]) -> str:
    """CEL: the list of the problems `group`'s checks find (empty when every rule holds)."""
    plain = [f"  {c.test}\n    ? \"\" : {cel_string(c.problem())}"
             for c in group if c.items is None]
    parts = ["[\n" + ",\n".join(plain) + "\n].filter(p, p != \"\")"] if plain else []
    for c in group:
        if c.items is None:
            continue
        head, _, tail = c.problem(0).partition("[0]")
        # The first equal item's index: an item equal to a failing one fails the same way.
        index = f"string({c.listed}.indexOf({ITEM}))"
        parts.append(f"({c.items}).filter({ITEM}, !({c.test})).map({ITEM}, "
                     f"{cel_string(head + '[')} + {index} + {cel_string(']' + tail)})")
    return "\n+ ".join(parts)


def groups(all_checks: list[Check]) -> dict[str, list[Check]]:
    """The checks by the section whose fields they name (`spec_training`), one policy variable
    each: CEL parses at most 100,000 characters an expression, and a section's problems read
    better on their own in `kubectl get validatingadmissionpolicy -o yaml`."""
    out: dict[str, list[Check]] = {}
    for c in all_checks:
        parts = c.where.split(".")[:2] if c.where.startswith("spec") else ["object"]
        out.setdefault("_".join(parts), []).append(c)
    return out


def variables(schema: Schema | None = None) -> list[dict[str, str]]:
    """The policy's variables, in order: which sections an update changed, each section's
    problems, then all problems (`problems`)."""
    schema = validated_schema() if schema is None else schema
    by_section = groups(checks(schema))
    out = [{"name": UNCHANGED, "expression": unchanged_variable(schema)}]
    out += [{"name": name, "expression": problems_expression(group)}
            for name, group in by_section.items()]
    out.append({"name": "problems",
                "expression": " + ".join(f"variables.{name}" for name in by_section)})
    return out


def rljob_policy(group: str = rljob.GROUP, name: str = POLICY_NAME) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy that checks RLJobs' rules at create and update."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [group],
                "apiVersions": [rljob.VERSION],
                "operations": ["CREATE", "UPDATE"],
                # The resource, not its subresources: status writes never meet the rules.
                "resources": [rljob.PLURAL],
            }]},
            "matchConditions": [{"name": "spec-written", "expression": SPEC_WRITTEN}],
            "variables": variables(),
            "validations": [{
                "expression": "size(variables.problems) == 0",
                "messageExpression": f"variables.problems.join({cel_string(SEPARATOR)})",
                "message": FALLBACK,
                "reason": "Invalid",
            }],
        },
    }


def rljob_policy_binding(name: str = POLICY_NAME) -> dict[str, Any]:
    """Binds the policy cluster-wide: refuse (Deny) what it does not admit."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }


HEADER = ("# Generated by `kuberl crd --policy` from the rules in operator/kuberl_api. "
          "Do not edit.\n")


class _Literal(str):
    """A multi-line string that YAML writes as a block (readable in `kubectl get -o yaml`)."""


def _literal(dumper: yaml.SafeDumper, data: _Literal) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Literal, _literal)


def rljob_policy_yaml() -> str:
    policy = copy.deepcopy(rljob_policy())
    for var in policy["spec"]["variables"]:
        if "\n" in var["expression"]:
            var["expression"] = _Literal(var["expression"])
    docs = [policy, rljob_policy_binding()]
    return HEADER + "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100)
                                 for d in docs)
