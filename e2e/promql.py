"""The PromQL the chart ships, taken apart for the observability tests (test_observability.py).

- `dashboard_queries` / `rule_queries`: every expression of the Grafana dashboard (panel
  targets and the template variables' label_values queries) and of the alert rule file, each
  named by where it is, so that a failing check points at the panel or alert.
- `substitute`: Grafana's template variables replaced by values (`$namespace` -> a regex the
  test's series match, `$__rate_interval` -> a duration), as Grafana does before it sends a
  query.
- `selectors`: the vector selectors of an expression (`metric{matchers}`, `{__name__=~...}`):
  each must select series, so a metric name nobody exports fails even inside `or`, `unless` or
  an alert whose condition is false.
- `as_bool`: an alert's expression with its comparisons made `bool` (0/1 instead of a filter),
  which returns a sample for every series the condition looks at, firing or not: non-empty
  proves the joins between the operator's and the trainer's labels line up.

A small tokenizer, not a PromQL parser: enough for the expressions the chart ships (the tests
fail loudly on anything it does not understand, never silently skip it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KEYWORDS = frozenset({"and", "or", "unless", "bool", "by", "without", "on", "ignoring",
                      "group_left", "group_right", "offset", "inf", "nan", "atan2"})
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                          "count_values", "bottomk", "topk", "quantile"})
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Query:
    where: str  # e.g. "dashboard panel 'Step' A", "alert KuberlRLJobFailed"
    expr: str


def dashboard_queries(path: Path) -> list[Query]:
    dash: dict[str, Any] = json.loads(path.read_text())
    out: list[Query] = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))  # (panels of a collapsed row)

    for panel in panels(dash["panels"]):
        for target in panel.get("targets", []):
            out.append(Query(f"dashboard panel {panel['title']!r} {target['refId']}",
                             target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        out.append(Query(f"dashboard variable ${var['name']}", label_values_expr(query)))
    return out


def label_values_expr(query: str) -> str:
    """Grafana's `label_values(selector, label)` as the PromQL whose result lists the values:
    `count by (label) (selector)`."""
    m = LABEL_VALUES.match(query.strip())
    if not m or not m["selector"]:
        raise ValueError(f"not a label_values(selector, label) query: {query!r}")
    return f"count by ({m['label']}) ({m['selector']})"


def rule_queries(path: Path) -> list[Query]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return [Query(f"alert {r['alert']}" if "alert" in r else f"record {r['record']}",
                  r["expr"]) for g in doc["groups"] for r in g["rules"]]


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace `$name` and `${name}` (longest names first: $__rate_interval before $__rate)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name,
                                                                      variables[name])
    left = re.findall(r"\$\{?[A-Za-z_]\w*", expr)
    if left:
        raise ValueError(f"template variables without a value: {left} in {expr!r}")
    return expr


# ------------------------------------------------------------------------- tokenizer

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<braces>\{(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[^{}"'])*\})
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)(?:[smhdwy]\w*)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>(),=])
""", re.VERBOSE)


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    start: int


def tokens(expr: str) -> list[Token]:
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m or m.lastgroup is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup != "space":
            out.append(Token(m.lastgroup, m.group(), pos))
        pos = m.end()
    return out


def selectors(expr: str) -> list[str]:
    """The vector selectors of `expr`, each as PromQL text (`name{...}`, `{...}`)."""
    toks = tokens(expr)
    found: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.kind == "ident" and t.text.lower() in LABEL_LISTS and nxt and nxt.text == "(":
            i = _after_parens(toks, i + 1)  # label names, not metrics
            continue
        if t.kind == "ident" and t.text.lower() == "offset":
            i += 2  # its duration
            continue
        if t.kind == "ident" and t.text.lower() not in KEYWORDS:
            if nxt and (nxt.text == "(" or t.text in AGGREGATIONS):  # a function, or
                i += 1  # an aggregation (`sum(...)`, `sum by (...) (...)`)
                continue
            if nxt and nxt.kind == "braces":
                found.append(t.text + nxt.text)
                i += 2
                continue
            found.append(t.text)
        elif t.kind == "braces":
            found.append(t.text)
        i += 1
    return found


def _after_parens(toks: list[Token], open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(toks)):
        depth += {"(": 1, ")": -1}.get(toks[j].text, 0)
        if depth == 0:
            return j + 1
    raise ValueError("unbalanced parentheses")


def as_bool(expr: str) -> str:
    """`expr` with every comparison (outside selectors and strings) given the `bool`
    modifier: `x > 3` -> `x > bool 3`."""
    toks = tokens(expr)
    out: list[str] = []
    last = 0
    for k, t in enumerate(toks):
        if t.kind == "op" and t.text in COMPARISONS:
            nxt = toks[k + 1] if k + 1 < len(toks) else None
            if nxt is not None and nxt.text.lower() == "bool":
                continue
            end = t.start + len(t.text)
            out.append(expr[last:end] + " bool")
            last = end
    out.append(expr[last:])
    return "".join(out)
