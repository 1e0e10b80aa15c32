"""Rendered objects validate against the schemas the API server will use: Kubernetes' own
(for core objects and every pod template) and KubeRay's RayJob CRD of each supported version."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import schemas

from kuberl_api import RLJob, load
from kuberl_operator.render import render_children

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))

EXTRA_SPECS: dict[str, Obj] = {
    "defaults": {},
    "cpu-colocated": {"training": {"nodes": 2, "gpusPerNode": 0, "backend": "fsdp"},
                      "rollout": {"engine": "reference"}},
    "cpu-disaggregated": {"placement": "disaggregated",
                          "training": {"gpusPerNode": 0, "backend": "fsdp"},
                          "rollout": {"engine": "reference", "gpus": 0, "engines": 2}},
    "small-rollout-pod": {"placement": "disaggregated", "rollout": {"gpus": 2}},
}


@pytest.mark.parametrize("attempt", [0, 99])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_render_schema_valid(example: Path, attempt: int) -> None:
    for obj in render_children(load(example), attempt):
        schemas.validate(obj)


@pytest.mark.parametrize("name", sorted(EXTRA_SPECS))
def test_other_layouts_render_schema_valid(make_rljob: MakeJob, name: str) -> None:
    for obj in render_children(make_rljob(spec=EXTRA_SPECS[name])):
        schemas.validate(obj)


def test_versions_env_pins_kuberay() -> None:
    assert schemas.kuberay_version() == "v1.5.1"
    assert schemas.kuberay_versions() == ["v1.5.1", "v1.6.2"]


@pytest.mark.parametrize("version", schemas.kuberay_versions())
def test_each_supported_kuberay_refuses_a_typo(rendered: list[Obj], version: str) -> None:
    """validate() checks a RayJob against every supported release's CRD, each of them able to
    fail on its own."""
    rayjob = _rayjob(rendered)
    schemas.validate_rayjob(rayjob, version)
    rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(schemas.SchemaViolation, match="rayStartParam"):
        schemas.validate_rayjob(rayjob, version)


# --- the checks themselves catch mistakes ---------------------------------------------------

@pytest.fixture
def rendered() -> list[Obj]:
    return render_children(load(EXAMPLES[0]))


def _rayjob(objs: list[Obj]) -> Obj:
    return copy.deepcopy(next(o for o in objs if o["kind"] == "RayJob"))


def test_catches_a_typo_in_a_container(rendered: list[Obj]) -> None:
    rayjob = _rayjob(rendered)
    container = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0]
    container["imagePullPolcy"] = "Always"
    with pytest.raises(schemas.SchemaViolation, match="imagePullPolcy"):
        schemas.validate(rayjob)


def test_catches_a_typo_in_the_rayjob_spec(rendered: list[Obj]) -> None:
    rayjob = _rayjob(rendered)
    rayjob["spec"]["shutdownAfterJobFinish"] = True
    with pytest.raises(schemas.SchemaViolation, match="shutdownAfterJobFinish"):
        schemas.validate(rayjob)


def test_catches_a_wrong_type(rendered: list[Obj]) -> None:
    rayjob = _rayjob(rendered)
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "1"
    with pytest.raises(schemas.SchemaViolation, match="replicas"):
        schemas.validate(rayjob)


def test_catches_a_bad_quantity(rendered: list[Obj]) -> None:
    rayjob = _rayjob(rendered)
    pod = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    pod["containers"][0]["resources"]["limits"]["memory"] = "lots"
    with pytest.raises(schemas.SchemaViolation, match="memory"):
        schemas.validate(rayjob)


def test_catches_a_typo_in_rayjob_metadata(rendered: list[Obj]) -> None:
    rayjob = _rayjob(rendered)
    rayjob["metadata"]["label"] = {"a": "b"}
    with pytest.raises(schemas.SchemaViolation, match="label"):
        schemas.validate(rayjob)


def test_catches_a_typo_in_a_core_object(rendered: list[Obj]) -> None:
    role = copy.deepcopy(next(o for o in rendered if o["kind"] == "Role"))
    role["rules"][0]["verb"] = ["get"]
    with pytest.raises(schemas.SchemaViolation, match="verb"):
        schemas.validate(role)


# --- the schema translation and the toolchain requirement ----------------------------------

def test_crd_translation() -> None:
    crd = {
        "type": "object",
        "properties": {
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
            "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                     "properties": {"a": {"type": "string"}}},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
            "maybe": {"type": "string", "nullable": True},
            "port": {"x-kubernetes-int-or-string": True},
        },
    }
    out = schemas.crd_to_jsonschema(crd)
    assert out["additionalProperties"] is False
    assert out["properties"]["closed"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["open"]
    assert out["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert out["properties"]["maybe"]["type"] == ["string", "null"]
    assert out["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_missing_go_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Go the RayJob check must fail (with a message saying why), never skip."""
    monkeypatch.setattr(schemas.shutil, "which", lambda _: None)
    with pytest.raises(RuntimeError, match="`go` toolchain is required"):
        schemas.kuberay_module_dir.__wrapped__("v1.5.1")
