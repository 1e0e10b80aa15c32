"""The CRD in crds/ is generated from the model, structural, and carries what `kubectl` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kuberl_cli.main import main
from kuberl_operator.crd import rljob_crd, rljob_crd_yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "rljob.yaml"


def test_crds_folder_matches_the_model() -> None:
    assert CRD_FILE.read_text() == rljob_crd_yaml(), (
        "crds/rljob.yaml drifted from the model in operator/kuberl_api: run `make crd`")


def test_helm_chart_ships_the_same_crd() -> None:
    # Helm installs the chart's crds/ on first install; `make crd` refreshes both copies.
    chart_copy = ROOT / "helm" / "kuberl" / "crds" / "rljob.yaml"
    assert chart_copy.read_text() == (ROOT / "crds" / "rljob.yaml").read_text(), "run make crd"


def test_kuberl_crd_prints_the_file(capsys: Any) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_FILE.read_text()


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, prop in node.get("properties", {}).items():
        out += _walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    """Every node typed; no $ref, anyOf/oneOf, or nulls — the API server refuses CRDs
    otherwise. Bounded lists and strings keep CEL cost estimates finite."""
    schema = rljob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        assert not {"$ref", "anyOf", "oneOf", "allOf", "nullable", "title"} & set(node), path
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: unbounded list"
        if node["type"] == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path}: unbounded map"


def test_names_columns_and_subresources() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text().split("\n", 1)[1])
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "rljobs.kuberl.dev"
    assert spec["names"]["shortNames"] == ["rlj"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Step"] == ".status.progress.step"
    assert columns["Reward"] == ".status.progress.rewardMean"
    assert columns["Age"] == ".metadata.creationTimestamp"
    # The rules are the policy's (crds/rljob-policy.yaml): a CRD's run on status writes too.
    assert "x-kubernetes-validations" not in CRD_FILE.read_text()
