"""Read RLJob manifests from YAML text or files, with errors that name the file and field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kuberl_api.base import WAIVER_CONTEXT, RuleFailure, Waiver
from kuberl_api.errors import InvalidRLJob, format_errors
from kuberl_api.rljob import API_VERSION, KIND, RLJob
from kuberl_api.spec import RLJobSpec

# On the job config the operator renders (its ConfigMap, which `kuberl run --in-cluster`
# reads): a JSON list of the fields whose rules the operator waived for this job, because an
# earlier kuberl accepted them (kuberl_operator/status/ratchet.py). Only the operator writes it.
WAIVED_ANNOTATION = "kuberl.dev/waived-rules"


def parse(obj: Any, source: str = "RLJob") -> RLJob:
    """Validate one decoded manifest (a dict) into an RLJob."""
    return _validate(obj, source, None)


def parse_waiving(obj: Any, waivable: Callable[[RuleFailure], bool],
                  source: str = "RLJob") -> tuple[RLJob, tuple[RuleFailure, ...]]:
    """`parse`, except that the rules that do not hold and that `waivable` accepts are
    returned instead of refused (see base.Waiver: nothing but rules is ever waived). Refused,
    the problems are those the waiver found, all of them (`parse` reports a section's first)."""
    waiver = Waiver()
    job = _validate(obj, source, {WAIVER_CONTEXT: waiver})
    failures = waiver.failures(job)
    refused = [f.line() for f in failures if not waivable(f)]
    if refused:
        raise InvalidRLJob(refused, source)
    return job, failures


def spec_from_driver(text: str) -> RLJobSpec:
    """The spec a run's driver validated (`kuberl run`), sent to a Ray actor as JSON: its shape
    is checked again, its rules are not. The driver checked them, waiving only what the
    operator waived for the job (load_rendered); an actor checking them again would refuse a
    job the operator keeps running because an earlier release accepted it."""
    return RLJobSpec.model_validate_json(text, context={WAIVER_CONTEXT: Waiver()})


def _validate(obj: Any, source: str, context: dict[str, Any] | None) -> RLJob:
    if not isinstance(obj, dict):
        raise InvalidRLJob([f"expected a mapping (an RLJob object), got {type(obj).__name__}"],
                           source)
    problems = []
    if obj.get("apiVersion") != API_VERSION:
        problems.append(f"apiVersion: must be {API_VERSION} (got {obj.get('apiVersion')!r})")
    if obj.get("kind") != KIND:
        problems.append(f"kind: must be {KIND} (got {obj.get('kind')!r})")
    if problems:
        raise InvalidRLJob(problems, source)
    try:
        return RLJob.model_validate(obj, context=context)
    except ValidationError as exc:
        raise InvalidRLJob(format_errors(exc), source) from None


def loads(text: str, source: str = "RLJob") -> RLJob:
    """Parse YAML text holding exactly one RLJob."""
    return parse(_one_document(text, source), source)


def _one_document(text: str, source: str) -> Any:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidRLJob([f"not valid YAML: {exc}"], source) from None
    if len(docs) != 1:
        raise InvalidRLJob([f"expected exactly one YAML document, found {len(docs)}"], source)
    return docs[0]


def load(path: str | Path) -> RLJob:
    """Read one RLJob manifest from a file."""
    return loads(_read(path), str(path))


def load_rendered(path: str | Path) -> tuple[RLJob, tuple[RuleFailure, ...]]:
    """Read the job config the operator rendered (`kuberl run --in-cluster`): the rules it
    waived for this job, named in its WAIVED_ANNOTATION, are waived here too, and returned; any
    other problem is refused as `load` refuses it."""
    obj = _one_document(_read(path), str(path))
    annotations = ((obj.get("metadata") or {}).get("annotations") or {}) if isinstance(
        obj, dict) else {}
    try:
        fields = frozenset(json.loads(annotations.get(WAIVED_ANNOTATION) or "[]"))
    except (TypeError, ValueError):
        raise InvalidRLJob([f"metadata.annotations.{WAIVED_ANNOTATION}: not a JSON list of "
                            "field paths"], str(path)) from None
    if not fields:
        return parse(obj, str(path)), ()
    return parse_waiving(obj, lambda failure: failure.field in fields, str(path))


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InvalidRLJob([f"cannot read the manifest: {exc.strerror}"], str(path)) from None
