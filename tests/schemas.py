"""Validate rendered objects against the real schemas they will meet at `kubectl apply`.

- Core objects (ServiceAccount, Role, RoleBinding, ConfigMap, and every pod template wrapped as
  a `v1 PodTemplate`) against Kubernetes' own OpenAPI, via kubernetes_validate, in strict mode:
  an unknown field is an error, as it is for `kubectl apply` (server-side strict field
  validation) instead of being silently dropped.
- RayJobs against the openAPIV3Schema of KubeRay's own CRD, taken from the KubeRay Go module of
  each supported version in e2e/versions.env, the oldest and the newest (found with `go mod
  download -json`). CRD schemas are OpenAPI v3.0 with Kubernetes extensions, so they are
  translated first (see `crd_to_jsonschema`) and checked with a Draft 4 validator, the JSON
  Schema draft OpenAPI 3.0 is based on.

Not checked: CRD CEL rules (`x-kubernetes-validations`; the renderers set none of the fields
that carry them in KubeRay's CRD), and `format`s such as int32 (jsonschema ignores them).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
VERSIONS_ENV = REPO / "e2e" / "versions.env"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
RAYJOB_CRD = "config/crd/bases/ray.io_rayjobs.yaml"

# The Kubernetes version the core objects must be valid for. Pinned (not "latest the package
# has") so that upgrading kubernetes-validate can't silently change what the test means.
KUBERNETES_VERSION = "1.37.0"

Obj = dict[str, Any]


class SchemaViolation(AssertionError):
    def __init__(self, what: str, errors: list[str]) -> None:
        self.errors = errors
        listed = "\n".join(f"  - {e}" for e in errors[:20])
        super().__init__(f"{what} does not match its schema:\n{listed}")


def versions() -> dict[str, str]:
    """KEY=value lines of e2e/versions.env (comments and blanks skipped)."""
    out = {}
    for line in VERSIONS_ENV.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip('"')
    return out


def kuberay_version() -> str:
    return versions()["KUBERAY_VERSION"]


def kuberay_versions() -> list[str]:
    """Every supported KubeRay release the renderers must satisfy: the oldest and the newest."""
    v = versions()
    return sorted({v["KUBERAY_VERSION"], v["KUBERAY_NEWEST_VERSION"]})


@functools.cache
def kuberay_module_dir(version: str) -> Path:
    """The KubeRay ray-operator module source of `version`, downloaded into (or found in) the
    Go module cache. Raises (never skips) when it can't: a schema check that silently doesn't
    run is worse than none."""
    go = shutil.which("go")
    if go is None:
        raise RuntimeError(
            "the `go` toolchain is required to fetch KubeRay's CRD "
            f"({KUBERAY_MODULE}@{version}) for the RayJob schema check; install Go "
            "(it is what the e2e tier builds with) and rerun")
    proc = subprocess.run(
        [go, "mod", "download", "-json", f"{KUBERAY_MODULE}@{version}"],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
    info = json.loads(proc.stdout) if proc.stdout.strip() else {}
    if proc.returncode != 0 or not info.get("Dir"):
        raise RuntimeError(
            f"`go mod download -json {KUBERAY_MODULE}@{version}` failed "
            f"(exit {proc.returncode}): {info.get('Error') or proc.stderr.strip()}")
    return Path(info["Dir"])


def crd_to_jsonschema(node: Any) -> Any:
    """Translate a structural CRD schema into plain JSON Schema (Draft 4):

    - objects with `properties` are closed (`additionalProperties: false`) unless they set
      `additionalProperties` or `x-kubernetes-preserve-unknown-fields`: the API server prunes
      unknown fields silently, and strict field validation refuses them; either way a typo
      would be lost, so here it is an error;
    - `nullable: true` admits null;
    - `x-kubernetes-int-or-string` without an explicit anyOf admits an integer or a string;
    - other `x-kubernetes-*` keys are annotations to JSON Schema and are left as they are
      (validators ignore unknown keywords).
    """
    if isinstance(node, list):
        return [crd_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: crd_to_jsonschema(v) if k not in ("enum", "default", "example") else v
           for k, v in node.items()}
    if "properties" in node:
        # `properties` maps names to schemas; don't treat a property named e.g. "nullable" as
        # a keyword of this node.
        out["properties"] = {k: crd_to_jsonschema(v) for k, v in node["properties"].items()}
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.cache
def rayjob_schema(version: str) -> Obj:
    crd = yaml.safe_load((kuberay_module_dir(version) / RAYJOB_CRD).read_text())
    served = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    if not served:
        raise RuntimeError(f"KubeRay {version}'s RayJob CRD has no v1 version")
    schema: Obj = crd_to_jsonschema(served[0]["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return schema


def _errors(validator: jsonschema.protocols.Validator, obj: Obj) -> list[str]:
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def validate_core(obj: Obj) -> None:
    """A built-in Kubernetes object, against the pinned Kubernetes version, strictly."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(map(str, exc.path)) or "<root>"
        raise SchemaViolation(f"{obj['kind']} {obj['metadata'].get('name')}",
                              [f"{path}: {exc.message}"]) from None


def pod_templates(rayjob: Obj) -> dict[str, Obj]:
    """group name -> pod template of a RayJob's cluster ("head" for the head group)."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]
    return out


def validate_rayjob(obj: Obj, version: str | None = None) -> None:
    """A RayJob against KubeRay's CRD, plus the parts the CRD leaves open (top-level metadata)
    or checks more loosely than the API server (pod templates) against core schemas."""
    schema = rayjob_schema(version or kuberay_version())
    errors = _errors(jsonschema.Draft4Validator(schema), obj)
    if errors:
        raise SchemaViolation(f"RayJob {obj['metadata'].get('name')}", errors)
    # The CRD types metadata as a bare object; check it as the ObjectMeta it is by carrying it
    # on a core object.
    validate_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]})
    for group, template in pod_templates(obj).items():
        validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{obj['metadata']['name']}-{group}"},
                       "template": template})


def validate(obj: Obj) -> None:
    if obj["apiVersion"] == "ray.io/v1" and obj["kind"] == "RayJob":
        for version in kuberay_versions():
            validate_rayjob(obj, version)
    else:
        validate_core(obj)
