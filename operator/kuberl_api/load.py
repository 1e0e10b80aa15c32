"""Read RLJob manifests from YAML text or files, with errors that name the file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kuberl_api.errors import InvalidRLJob, format_errors
from kuberl_api.rljob import API_VERSION, KIND, RLJob


def parse(obj: Any, source: str = "RLJob") -> RLJob:
    """Validate one decoded manifest (a dict) into an RLJob."""
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
        return RLJob.model_validate(obj)
    except ValidationError as exc:
        raise InvalidRLJob(format_errors(exc), source) from None


def loads(text: str, source: str = "RLJob") -> RLJob:
    """Parse YAML text holding exactly one RLJob."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidRLJob([f"not valid YAML: {exc}"], source) from None
    if len(docs) != 1:
        raise InvalidRLJob([f"expected exactly one YAML document, found {len(docs)}"], source)
    return parse(docs[0], source)


def load(path: str | Path) -> RLJob:
    """Read one RLJob manifest from a file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidRLJob([f"cannot read the manifest: {exc.strerror}"], str(p)) from None
    return loads(text, str(p))
