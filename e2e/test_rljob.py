"""RLJob on a real control plane: the CRD, admission, and the operator end to end.

What `kubectl apply` does with the generated CRD and the RLJob's ValidatingAdmissionPolicy on a
real kube-apiserver (v1.37: structural schema, defaults, the policy's CEL rules, strict field
validation, the status subresource), and what the
operator (`python -m kuberl_operator`, as a subprocess logged in through a kubeconfig) does with
an RLJob against real KubeRay, scheduler, garbage collector and kwok nodes. The unit tier checks
the same rules against a Python stand-in (tests/crd_admission.py); this tier is the ground truth.

One cluster per session (conftest.py: the project's crds/, the CRD and the policy, installed
before the controller-manager, 4 train nodes), shared by every test; each test works in a
namespace of its own.
"""

from __future__ import annotations

import base64
import copy
import importlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import Api, Cluster, write_kubeconfig
from polling import wait_for
from rljobs import (
    CHILDREN,
    RAYJOBS,
    RESYNC_SECONDS,
    RLJOBS,
    JobWatch,
    Operator,
    condition,
    cpu_job,
    events_for,
    kubectl_apply,
    namespace,
    policy_enforced,
    policy_unbound,
    selector_query,
    static_claims,
    table_row,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is a package at the repository root
    sys.path.insert(0, str(ROOT))

from kuberl_api import loads, parse  # noqa: E402
from kuberl_api.rljob import API_VERSION, KIND  # noqa: E402
from kuberl_operator.crd import openapi_schema, validated_schema  # noqa: E402
from kuberl_operator.policy import POLICY_NAME, rljob_policy  # noqa: E402
from kuberl_operator.render import names  # noqa: E402

# The unit tier's admission stand-in and table of bad specs, reused as they are. Imported by
# name at run time so that `mypy --strict e2e` checks this file, not the unit tier's modules.
_admission = importlib.import_module("tests.crd_admission")
_validation = importlib.import_module("tests.unit.test_api_validation")
admit: Callable[..., list[str]] = _admission.admit
base: Callable[[], dict[str, Any]] = _validation.base
BAD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = _validation.BAD_SPECS
GOOD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None]]] = _validation.GOOD_SPECS

pytestmark = pytest.mark.e2e

CRD_FILE = ROOT / "crds" / "rljob.yaml"
CRD_NAME = "rljobs.kuberl.dev"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The schema with the rules where they apply: what tests.crd_admission emulates (the CRD's
# schema, then the policy's checks).
SCHEMA = validated_schema()


def example(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text())
    return obj


def cel_messages(schema: Mapping[str, Any]) -> set[str]:
    """Every CEL rule message in the schema (to tell CEL problems from schema problems)."""
    out = {r["message"] for r in schema.get("x-kubernetes-validations", [])}
    for sub in (schema.get("properties") or {}).values():
        out |= cel_messages(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out |= cel_messages(schema[key])
    return out


CEL_MESSAGES = cel_messages(SCHEMA)


# ------------------------------------------------------------------------- 1. the CRD itself


def test_crd_applies_and_is_established(k8s_cluster: Cluster) -> None:
    """Both ways users install it: client-side apply (kubectl's last-applied annotation must
    fit) and server-side apply (README, Helm-less install); then the API serves RLJobs."""
    c = k8s_cluster
    client_side = c.kubectl("apply", "-f", str(CRD_FILE), check=False)
    assert client_side.returncode == 0, client_side.stderr
    assert CRD_NAME in client_side.stdout
    server_side = c.kubectl("apply", "--server-side", "-f", str(CRD_FILE), check=False)
    assert server_side.returncode == 0, server_side.stderr
    # What the server stored is the schema the model generates (nothing pruned or rewritten).
    stored = json.loads(c.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == openapi_schema()

    def established() -> bool:
        crd = json.loads(c.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
        conds = {x["type"]: x["status"] for x in crd.get("status", {}).get("conditions", [])}
        return conds.get("Established") == "True" and conds.get("NamesAccepted") == "True"

    wait_for(f"CRD {CRD_NAME} Established and NamesAccepted", established, timeout=30)
    shown = c.kubectl("get", "crd", CRD_NAME, "-o",
                      "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
    assert shown == "True"
    # The API serves the kind under its names and short name, with the printer columns.
    resources = c.kubectl("api-resources", "--api-group=kuberl.dev", "-o", "wide").stdout
    assert "rljobs" in resources and "rlj" in resources and "RLJob" in resources, resources
    table = c.kubectl("get", "rlj", "-A").stderr + c.kubectl("get", "rljobs", "-A").stderr
    assert "error" not in table.lower(), table
    # The schema is published (OpenAPI v3, asynchronously after Established) for `explain`.
    wait_for("kubectl explain rljob.spec.training.parallelism", lambda: "Tensor parallel size"
             in c.kubectl("explain", "rljob.spec.training.parallelism", check=False).stdout,
             timeout=30, interval=1)


# ------------------------------------------------------------------------- 2. the examples


@pytest.fixture(scope="module")
def validation_ns(k8s_cluster: Cluster) -> Iterator[str]:
    """A namespace no operator watches: objects stay exactly as the API server stored them.
    The RLJob's policy is in force there (the API server loads it asynchronously)."""
    with namespace(k8s_cluster, "e2e-validate") as ns:
        wait_for("the RLJob policy in force", lambda: policy_enforced(k8s_cluster, ns),
                 timeout=30, interval=0.5)
        yield ns


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_applies_as_written(k8s_cluster: Cluster, validation_ns: str,
                                    path: Path) -> None:
    """Every shipped example is accepted as written, and the server-side defaults equal the
    model's, so `kubectl get -o yaml` shows what the trainer will run."""
    c = k8s_cluster
    proc = c.kubectl("apply", "-n", validation_ns, "-f", str(path), check=False)
    assert proc.returncode == 0, f"{path.name} refused:\n{proc.stderr}"
    written = yaml.safe_load(path.read_text())
    name = written["metadata"]["name"]
    assert f"rljob.kuberl.dev/{name} created" in proc.stdout, proc.stdout
    stored = c.api().get(RLJOBS.format(ns=validation_ns) + f"/{name}")
    assert stored is not None
    model = parse(written).spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert stored["spec"] == model, "server defaults differ from the model's"
    # Applying the same file again changes nothing, also once the job has started (GitOps
    # re-applies): defaults don't fight the manifest, and the immutability rules compare the
    # defaulted sections. kubectl may still send a patch ("configured" rather than
    # "unchanged"): a CRD gets JSON merge patches, which replace lists whole, and the server
    # then fills in the same defaults inside the list items (evalSets[].nSamplesPerPrompt).
    c.kubectl("patch", "rljob", name, "-n", validation_ns, "--subresource=status",
              "--type=merge", "-p", '{"status": {"phase": "Running"}}')
    before = c.api().get(RLJOBS.format(ns=validation_ns) + f"/{name}")
    again = c.kubectl("apply", "-n", validation_ns, "-f", str(path), check=False)
    assert again.returncode == 0, f"re-applying a running job refused: {again.stderr}"
    after = c.api().get(RLJOBS.format(ns=validation_ns) + f"/{name}")
    assert after["metadata"]["generation"] == 1, after["metadata"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    c.kubectl("delete", "-n", validation_ns, "-f", str(path), "--wait=true")


# -------------------------------------------------------------------- 3. invalid manifests


def _bad_manifest(case: str, edit: Callable[[dict[str, Any]], None],
                  ns: str) -> dict[str, Any]:
    obj = base()
    edit(obj["spec"])
    obj["metadata"] = {"name": case[:40].rstrip("-").lower(), "namespace": ns}  # a valid name
    return obj


# The unit table's own spec editor (dotted path, creating intermediate maps).
_set: Callable[[str, Any], Callable[[dict[str, Any]], None]] = _validation.set_


# Wrong types, which the unit table leaves out (pydantic would coerce some of them: "8" -> 8).
WRONG_TYPES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("type-string-for-integer", _set("training.nodes", "two"), "spec.training.nodes", ""),
    ("type-number-as-string", _set("algorithm.lr", "1e-6"), "spec.algorithm.lr", ""),
    ("type-string-for-object", _set("reward", "math"), "spec.reward", ""),
    ("type-map-for-list", _set("training.nodePool.tolerations", {"key": "x"}),
     "spec.training.nodePool.tolerations", ""),
]


def test_invalid_manifests_refused_naming_the_field(k8s_cluster: Cluster,
                                                    validation_ns: str) -> None:
    """The unit tier's table of bad specs (tests/unit/test_api_validation.py: unknown fields,
    enums, minimums, patterns, and the CEL rules), plus wrong types, each applied with
    `kubectl apply`: refused, and the real server's message names the same field as the
    model and the emulated admission; where the emulation says a CEL rule fires, the real
    server prints that rule's message."""
    c = k8s_cluster
    manifests = [(case, field, _bad_manifest(case, edit, validation_ns))
                 for case, edit, field, _words in [*BAD_SPECS, *WRONG_TYPES]]
    assert len(manifests) >= 40
    assert len({m["metadata"]["name"] for _, _, m in manifests}) == len(manifests)

    def apply(item: tuple[str, str, dict[str, Any]]) -> tuple[str, str, dict[str, Any],
                                                               subprocess.CompletedProcess[str]]:
        case, field, obj = item
        return case, field, obj, kubectl_apply(c, obj)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(apply, manifests))

    failures = []
    for case, field, obj, proc in results:
        text = proc.stderr
        if proc.returncode == 0:
            failures.append(f"{case}: accepted ({proc.stdout.strip()})")
            continue
        if field not in text:
            failures.append(f"{case}: message does not name {field}: {text.strip()}")
            continue
        emulated = admit(SCHEMA, obj)
        for problem in emulated:
            _path, _, message = problem.partition(": ")
            if message in CEL_MESSAGES and message not in text:
                failures.append(f"{case}: CEL message {message!r} missing: {text.strip()}")
    assert not failures, "\n".join(failures)
    listed = c.api().get(RLJOBS.format(ns=validation_ns))["items"]
    assert not [o["metadata"]["name"] for o in listed], "a refused manifest was stored"


def test_near_misses_accepted(k8s_cluster: Cluster, validation_ns: str) -> None:
    """The unit tier's near misses of the rules (tests/unit/test_api_validation.py GOOD_SPECS:
    settings right beside a refused one, written at their defaults, or with the option they
    need) are accepted by the real server too; nothing more is refused than the model refuses.
    """
    c = k8s_cluster
    manifests = [_bad_manifest(f"ok-{case}", edit, validation_ns) for case, edit in GOOD_SPECS]
    assert len({m["metadata"]["name"] for m in manifests}) == len(manifests)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda obj: kubectl_apply(c, obj), manifests))
    refused = [f"{obj['metadata']['name']}: {proc.stderr.strip()}"
               for obj, proc in zip(manifests, results, strict=True) if proc.returncode != 0]
    assert not refused, "\n".join(refused)
    for obj in manifests:
        c.kubectl("delete", "rljob", obj["metadata"]["name"], "-n", validation_ns,
                  "--wait=true")


@pytest.mark.parametrize("name", ["a" * 41, "Math-GRPO", "1job", "job_1"])
def test_bad_names_refused(k8s_cluster: Cluster, validation_ns: str, name: str) -> None:
    obj = base()
    obj["metadata"] = {"name": name, "namespace": validation_ns}
    proc = kubectl_apply(k8s_cluster, obj)
    assert proc.returncode != 0, proc.stdout
    assert "metadata.name" in proc.stderr, proc.stderr
    # Names the API server itself accepts (a DNS-1123 subdomain) reach the CRD's root rules,
    # whose messages say what kuberl needs.
    if name in ("a" * 41, "1job"):
        expected = [p.partition(": ")[2] for p in admit(SCHEMA, obj)]
        assert expected and all(m in proc.stderr for m in expected), (expected, proc.stderr)


def test_spec_immutable_once_started(k8s_cluster: Cluster, validation_ns: str) -> None:
    """While Pending the spec may change; once status.phase moved on (the operator's status
    patch, played here through the status subresource), the sections that shape the run are
    refused by the API server and the operational fields stay editable."""
    c = k8s_cluster
    name = "immutable"
    obj = base()
    obj["metadata"] = {"name": name, "namespace": validation_ns}
    assert kubectl_apply(c, obj).returncode == 0

    edited = copy.deepcopy(obj)
    edited["spec"]["algorithm"] = {"lr": 1e-5}
    pending_edit = kubectl_apply(c, edited)
    assert pending_edit.returncode == 0, f"a Pending job is editable: {pending_edit.stderr}"

    for phase in ("Pending", "Running"):
        c.kubectl("patch", "rljob", name, "-n", validation_ns, "--subresource=status",
                  "--type=merge", "-p", json.dumps({"status": {"phase": phase}}))
    shown = c.kubectl("get", "rljob", name, "-n", validation_ns, "-o",
                      "jsonpath={.status.phase}").stdout
    assert shown == "Running"

    refused = []
    for section, value in [("training", {"nodes": 2}), ("algorithm", {"lr": 1e-4}),
                           ("model", {"path": "/models/other"}),
                           ("data", {"prompts": "/data/other.jsonl"})]:
        changed = copy.deepcopy(edited)
        changed["spec"][section] = value
        proc = kubectl_apply(c, changed)
        if proc.returncode == 0 or f"spec.{section} is immutable" not in proc.stderr:
            refused.append(f"spec.{section}: rc={proc.returncode} {proc.stderr.strip()}")
    assert not refused, "immutable sections not refused:\n" + "\n".join(refused)

    for field, value in [("suspend", True), ("backoffLimit", 5),
                         ("activeDeadlineSeconds", 3600), ("ttlSecondsAfterFinished", 60)]:
        edited["spec"][field] = value
        proc = kubectl_apply(c, edited)
        assert proc.returncode == 0, f"spec.{field} must stay editable: {proc.stderr}"
    stored = c.api().get(RLJOBS.format(ns=validation_ns) + f"/{name}")
    assert stored["spec"]["suspend"] is True and stored["spec"]["backoffLimit"] == 5
    c.kubectl("delete", "rljob", name, "-n", validation_ns)



def claims_of(manifest: Mapping[str, Any]) -> list[str]:
    spec = manifest["spec"]
    found = [(spec.get("model") or {}).get("storage", {}).get("pvc"),
             (spec.get("data") or {}).get("storage", {}).get("pvc"),
             (spec.get("checkpoint") or {}).get("pvc")]
    return sorted({c for c in found if c})


# ----------------------------------------------------------------------- 4. the operator


GPU_EXAMPLES = ["disaggregated.yaml", "multinode-megatron-rdma.yaml"]


@pytest.fixture(scope="module")
def volumes(k8s_cluster: Cluster, operator_ns: str) -> Iterator[list[str]]:
    """Statically provisioned PVs bound to the examples' claims (rljobs.static_claims)."""
    claims = sorted({c for name in GPU_EXAMPLES for c in claims_of(example(name))})
    with static_claims(k8s_cluster, operator_ns, claims):
        yield claims


def container(pod: Mapping[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod["spec"]["containers"][0]
    return first


def env_of(pod: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(pod).get("env", [])}


def shm_volume(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    mounts = {m["name"]: m["mountPath"] for m in container(pod).get("volumeMounts", [])}
    for vol in pod["spec"].get("volumes", []):
        if mounts.get(vol["name"]) == "/dev/shm":
            found: dict[str, Any] = vol
            return found
    return None


@pytest.mark.parametrize("example_name", GPU_EXAMPLES)
@pytest.mark.kuberay
def test_operator_runs_the_gpu_example(k8s_cluster: Cluster, operator: Operator,
                                       operator_ns: str, volumes: list[str],
                                       example_name: str) -> None:
    """A GPU example as a user applies it: Accepted, owned children, a RayJob that KubeRay
    turns into a RayCluster whose pods land on the right pools with their GPUs, shared memory,
    NCCL settings (and host network + RDMA for the Megatron example); ClusterReady;
    `kubectl get rljobs`; Events and metrics; deleting the RLJob garbage-collects the rest."""
    c, ns = k8s_cluster, operator_ns
    api = c.api()
    path = ROOT / "examples" / example_name
    manifest = example(example_name)
    job = manifest["metadata"]["name"]
    spec = parse(manifest).spec
    w = JobWatch(c, operator, ns, job)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    proc = c.kubectl("apply", "-n", ns, "-f", str(path))
    assert f"rljob.kuberl.dev/{job} created" in proc.stdout
    try:
        accepted = w.wait_condition("Accepted", "True")
        assert accepted["reason"] == "Accepted"
        timings["accepted"] = time.monotonic() - t0

        # The children, each controlled by the RLJob (so GC deletes them with it).
        owner = w.get()
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": job,
               "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        for template, name_of in CHILDREN:
            url = template.format(ns=ns) + f"/{name_of(job)}"
            if name_of is names.network_policy and spec.network.host_network:
                assert api.get(url) is None, url  # none on the host network (helm/README.md)
                continue
            child = wait_for(f"child {url}", partial(api.get, url), timeout=30,
                             detail=w.detail)
            assert child["metadata"]["ownerReferences"] == [ref], url
            assert child["metadata"]["labels"][names.LABEL_JOB] == job, url
        assert w.status()["rayJobName"] == names.rayjob(job, 0)
        # The head's config is the validated spec, defaults filled in (what the trainer loads).
        cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/{names.configmap(job)}")
        assert loads(cm["data"][names.CONFIG_KEY]).spec == parse(owner).spec
        # The attempt's engine API key: a random one in its own immutable Secret, which every
        # Ray pod reads by secretKeyRef (_check_pods); the ConfigMap does not hold it.
        secret = api.get(f"/api/v1/namespaces/{ns}/secrets/{names.engine_key_secret(job, 0)}")
        key = base64.b64decode(secret["data"][names.ENGINE_API_KEY_SECRET_KEY]).decode()
        assert len(key) >= 32 and secret["immutable"] is True
        assert key not in json.dumps(cm)

        # KubeRay: the RayJob's RayCluster, controlled by it; its pods on the pools.
        rc_url = w.raycluster_url(0)
        rc = wait_for(f"RayCluster {rc_url}", partial(api.get, rc_url), timeout=30)
        assert [o["kind"] for o in rc["metadata"]["ownerReferences"]] == ["RayJob"]
        # Ray's token authentication: authOptions survives the apply (the CRD keeps it, no
        # pruning), KubeRay copies it to the RayCluster and makes the token's Secret, named
        # after the RayCluster and owned by it; every Ray container reads it (_check_pods).
        rayjob = w.rayjob(0)
        assert rayjob is not None
        assert rayjob["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}, rayjob
        assert rc["spec"].get("authOptions") == {"mode": "token"}, rc["spec"]
        rc_name = rc["metadata"]["name"]
        token_secret = wait_for(f"KubeRay's Ray token Secret {rc_name}", partial(
            api.get, f"/api/v1/namespaces/{ns}/secrets/{rc_name}"), timeout=30)
        assert len(base64.b64decode(token_secret["data"][RAY_TOKEN_KEY])) >= 32
        assert [o["kind"] for o in token_secret["metadata"]["ownerReferences"]] == [
            "RayCluster"]
        rollout_per_pod = min(spec.rollout_gpus, spec.rollout.gpus_per_node)
        expected = {names.GROUP_HEAD: 1, names.GROUP_TRAIN: spec.training.nodes,
                    names.GROUP_ROLLOUT: -(-spec.rollout_gpus // rollout_per_pod)}

        def all_running() -> bool:
            groups = w.pods_by_group()
            return ({g: len(p) for g, p in groups.items()} == expected
                    and all(p["spec"].get("nodeName") and p["status"].get("phase") == "Running"
                            for ps in groups.values() for p in ps))

        wait_for(f"pods {expected} scheduled and Running", all_running, timeout=90,
                 detail=w.pod_detail)
        timings["pods running"] = time.monotonic() - t0
        _check_pods(api, w.pods_by_group(), spec, job, rc_name)

        w.wait_raycluster_ready(0)
        ready = w.wait_condition("ClusterReady", "True", timeout=30)
        timings["cluster ready"] = time.monotonic() - t0
        assert ready["message"].startswith("head ready"), ready
        w.wait_submitted(0)
        timings["submitted"] = time.monotonic() - t0
        # KubeRay's submitter (`ray job submit` to the head's dashboard) sends the token too.
        submitter = api.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{names.rayjob(job, 0)}")
        assert submitter is not None
        _check_ray_token_env(submitter["spec"]["template"]["spec"]["containers"][0], rc_name,
                             "the submitter")

        # What users look at: the printer columns, Events, metrics.
        table = c.kubectl("get", "rljobs", "-n", ns, "-o", "wide").stdout.splitlines()
        row = table_row(table)
        assert list(row)[:4] == ["NAME", "PHASE", "STEP", "REWARD"] and "RAYJOB" in row, table
        assert row["NAME"] == job and row["RAYJOB"].startswith(f"{job}-r"), table
        assert row["PHASE"] in ("Provisioning", "Running", "Restarting"), table
        created = wait_for("a Created Event", lambda: [
            e for e in events_for(api, ns, job) if e["reason"] == "Created"], timeout=30)
        assert len(created) == 1 and created[0]["type"] == "Normal", created

        def phase_series() -> list[str]:
            return [line for line in operator.metrics().splitlines()
                    if line.startswith("kuberl_rljob_status_phase{") and f'name="{job}"' in line
                    and f'namespace="{ns}"' in line and line.endswith(" 1.0")]

        wait_for("the phase gauge to match the status", lambda: [
            s for s in phase_series() if f'phase="{w.status().get("phase")}"' in s],
            timeout=10, detail=lambda: "\n".join(phase_series()))
        if spec.placement == "disaggregated":
            _a_lost_rollout_pod_is_replaced_by_kuberay_alone(c, w, expected, all_running)
            timings["rollout pod replaced"] = time.monotonic() - t0
    finally:
        timings["gc"] = w.delete_and_wait_gc()
    wait_for("the deleted RLJob's metrics series to go", lambda: f'name="{job}"'
             not in operator.metrics(), timeout=30)
    print(f"\n{example_name} on the cluster: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


def _a_lost_rollout_pod_is_replaced_by_kuberay_alone(
        c: Cluster, w: JobWatch, expected: dict[str, int],
        all_running: Callable[[], bool]) -> None:
    """A rollout worker pod deleted mid-run (a preempted node, a drain): KubeRay starts
    another in its place, and the operator restarts nothing: the RayJob, its attempt and the
    restart count stay (the trainer replaces the engines the pod held, fleet.py)."""
    before = w.status()
    victim = w.pods_by_group()[names.GROUP_ROLLOUT][0]["metadata"]["name"]
    c.kubectl("delete", "pod", victim, "-n", w.ns, "--wait=false")
    wait_for("KubeRay's replacement rollout pod, Running", lambda: all_running() and victim
             not in [p["metadata"]["name"] for p in w.pods_by_group()[names.GROUP_ROLLOUT]]
             and len(w.pods_by_group()[names.GROUP_ROLLOUT]) == expected[names.GROUP_ROLLOUT],
             timeout=90, detail=w.pod_detail)
    time.sleep(5 * RESYNC_SECONDS)  # (the operator's resyncs pass over it)
    after = w.status()
    assert (after["rayJobName"], after["restarts"]) == (
        before["rayJobName"], before["restarts"]), (before, after)
    assert "Restarting" not in [e["reason"] for e in events_for(c.api(), w.ns, w.job)]
    rayjob = w.rayjob(0)
    assert rayjob is not None and not rayjob["metadata"].get("deletionTimestamp"), rayjob


# KubeRay's Ray token Secret: its key, and the variables Ray reads (utils/constant.go).
RAY_TOKEN_KEY = "auth_token"


def _check_ray_token_env(c: dict[str, Any], secret: str, where: str) -> None:
    env = {e["name"]: e for e in c.get("env", [])}
    assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", (where, env)
    assert env.get("RAY_AUTH_TOKEN", {}).get("valueFrom") == {
        "secretKeyRef": {"name": secret, "key": RAY_TOKEN_KEY}}, (where, env)


def _check_pods(api: Api, groups: dict[str, list[dict[str, Any]]], spec: Any, job: str,
                ray_cluster: str) -> None:
    """Placement and wiring of the Ray pods, against the spec."""
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"].get("pool")
             for n in api.get("/api/v1/nodes")["items"]}
    pools = {g: sorted({nodes[p["spec"]["nodeName"]] for p in ps}) for g, ps in groups.items()}
    assert pools == {"head": ["cpu"], "train": ["train"], "rollout": ["rollout"]}, pools
    for group in (names.GROUP_TRAIN, names.GROUP_ROLLOUT):
        hosts = [p["spec"]["nodeName"] for p in groups[group]]
        assert len(set(hosts)) == len(hosts), f"one {group} pod per node: {hosts}"
    key_ref = {"secretKeyRef": {"name": names.engine_key_secret(job, 0),
                                "key": names.ENGINE_API_KEY_SECRET_KEY}}
    for pod in (p for ps in groups.values() for p in ps):
        env = {e["name"]: e for e in container(pod)["env"]}
        assert env[names.ENV_ENGINE_API_KEY].get("valueFrom") == key_ref, pod["metadata"]["name"]
        _check_ray_token_env(container(pod), ray_cluster, pod["metadata"]["name"])
    for pod in groups[names.GROUP_HEAD]:
        assert "nvidia.com/gpu" not in container(pod)["resources"].get("limits", {})
        assert pod["spec"]["serviceAccountName"] == names.service_account(job)
        assert not pod["spec"].get("hostNetwork"), "the head stays on the pod network"
    network = spec.network
    wanted_env = dict(network.env)
    if network.nccl_socket_ifname:
        wanted_env["NCCL_SOCKET_IFNAME"] = network.nccl_socket_ifname
    per_pod = {names.GROUP_TRAIN: (spec.training.gpus_per_node, spec.training.resources.memory,
                                   names.RESOURCE_TRAIN),
               names.GROUP_ROLLOUT: (min(spec.rollout_gpus, spec.rollout.gpus_per_node),
                                     spec.rollout.resources.memory, names.RESOURCE_ROLLOUT)}
    for group, (gpus, memory, ray_resource) in per_pod.items():
        for pod in groups[group]:
            where = f"{group} pod {pod['metadata']['name']}"
            res = container(pod)["resources"]
            for kind in ("requests", "limits"):
                assert res[kind].get("nvidia.com/gpu") == str(gpus), (where, res)
                if network.rdma is not None:
                    assert res[kind].get(network.rdma.resource) == str(network.rdma.count), (
                        where, res)
            shm = shm_volume(pod)
            assert shm is not None and shm["emptyDir"] == {"medium": "Memory",
                                                           "sizeLimit": memory}, (where, shm)
            env = env_of(pod)
            assert {k: env.get(k) for k in wanted_env} == wanted_env, (where, env)
            assert env.get(names.ENV_JOB_NAME) == job, (where, env)
            start = " ".join(container(pod).get("command", []) + container(pod).get("args", []))
            assert ray_resource in start, (where, "Ray custom resource missing", start)
            assert bool(pod["spec"].get("hostNetwork")) == network.host_network, where
            if network.host_network:
                assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet", where
            caps = (container(pod).get("securityContext") or {}).get("capabilities", {})
            assert ("IPC_LOCK" in caps.get("add", [])) == (network.rdma is not None), (where,
                                                                                      caps)
    if spec.placement == "disaggregated":
        ports = {p["name"]: p["containerPort"] for p in container(
            groups[names.GROUP_TRAIN][0]).get("ports", [])}
        assert ports.get(names.PORT_WEIGHT_SYNC) == network.weight_sync_port, ports



@pytest.mark.kuberay
def test_longest_name_runs_on_cpu(k8s_cluster: Cluster, operator: Operator,
                                  operator_ns: str) -> None:
    """The longest name the CRD admits (40 characters) still gives KubeRay names it accepts
    (RayJob, RayCluster, head Service, pods): the job reaches ClusterReady."""
    c, ns = k8s_cluster, operator_ns
    job = names.longest_job_name()
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns), check=True)
    try:
        w.wait_condition("ClusterReady", "True", timeout=90)
        rj = w.rayjob(0)
        assert rj is not None, "no RayJob"
        cluster_name = rj["status"]["rayClusterName"]
        services = c.api().get(f"/api/v1/namespaces/{ns}/services?"
                               + selector_query({"ray.io/cluster": cluster_name}))["items"]
        assert services, f"KubeRay made no head Service for {cluster_name}"
        groups = w.pods_by_group()
        assert {g: len(ps) for g, ps in groups.items()} == {"head": 1, "train": 1}, groups
        pools = {c.api().get(f"/api/v1/nodes/{p['spec']['nodeName']}")["metadata"]["labels"][
            "pool"] for ps in groups.values() for p in ps}
        assert pools == {"cpu"}, pools
    finally:
        w.delete_and_wait_gc()


@pytest.mark.kuberay
def test_head_service_account_reports_only_its_own_status(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    """The trainer on the Ray head reports progress with its pod's ServiceAccount token
    (kuberl_trainer.report.status, the real class): the Role the operator renders lets it patch its
    own RLJob's status, and nothing else - not its spec, not another RLJob's status."""
    from kuberl_trainer.report.status import StatusReporter

    c, ns = k8s_cluster, operator_ns
    job, other = "report-own", "report-other"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns), check=True)
    kubectl_apply(c, cpu_job(other, ns), check=True)
    try:
        w.wait_condition("Accepted", "True", timeout=60)
        wait_for("the head ServiceAccount", lambda: c.kubectl(
            "get", "serviceaccount", names.service_account(job), "-n", ns, check=False
        ).returncode == 0)
        token = c.kubectl("create", "token", names.service_account(job), "-n", ns).stdout.strip()
        ca = str(c.state_dir / "pki" / "ca.crt")

        StatusReporter(c.server, token, ns, job, ca_file=ca).report(
            step=3, total_steps=10, reward_mean=0.625, checkpoint=(2, "/checkpoints/step-2"),
            evals={"gsm8k": {"reward": 0.5, "pass@8": 0.875, "maj@8": 0.625}})
        progress = w.status().get("progress", {})
        assert progress["step"] == 3 and progress["rewardMean"] == 0.625, progress
        # (the CRD's status schema stores an eval set's scores as reported)
        assert progress["evals"] == [{"name": "gsm8k", "step": 3, "scores": {
            "reward": 0.5, "pass@8": 0.875, "maj@8": 0.625}}], progress
        assert progress["lastCheckpoint"] == {"step": 2, "path": "/checkpoints/step-2"}
        row = table_row(c.kubectl("get", "rljob", job, "-n", ns).stdout.splitlines())
        assert row["STEP"] == "3" and row["REWARD"] == "0.625", row

        with pytest.raises(urllib.error.HTTPError) as refused:
            StatusReporter(c.server, token, ns, other, ca_file=ca).report(
                step=1, total_steps=10, reward_mean=0.0)
        assert refused.value.code == 403
        as_head = c.state_dir / f"{job}-head.kubeconfig"  # the token alone, no admin cert
        write_kubeconfig(as_head, c.server, c.state_dir / "pki" / "ca.crt", "head", token=token)
        spec_edit = subprocess.run(
            [str(c.kubectl_path), f"--kubeconfig={as_head}", "patch", "rljob", job, "-n", ns,
             "--type=merge", "-p", '{"spec":{"backoffLimit":7}}'],
            capture_output=True, text=True, timeout=60)
        assert spec_edit.returncode != 0 and "forbidden" in spec_edit.stderr.lower(), (
            spec_edit.stdout, spec_edit.stderr)

        # Events: it may create them (an engine replaced), in its own namespace, and do
        # nothing else with them or with the pods beside it.
        def can_i(*args: str) -> str:
            return subprocess.run(
                [str(c.kubectl_path), f"--kubeconfig={as_head}", "auth", "can-i", *args],
                capture_output=True, text=True, timeout=60).stdout.strip()
        assert can_i("create", "events", "-n", ns) == "yes"
        for verb, what, where in [("delete", "events", ns), ("list", "events", ns),
                                  ("create", "events", "default"), ("delete", "pods", ns),
                                  ("patch", f"rljobs.kuberl.dev/{other}", ns),
                                  ("patch", "rayjobs.ray.io", ns)]:
            assert can_i(verb, what, "-n", where) == "no", (verb, what, where)
        StatusReporter(c.server, token, ns, job, ca_file=ca).event(
            "EngineReplaced", "engine at http://10.0.0.7:30000 stopped answering: replaced")
        assert "EngineReplaced" in [e["reason"] for e in events_for(c.api(), ns, job)]
    finally:
        c.kubectl("delete", "rljob", other, "-n", ns, "--ignore-not-found")
        w.delete_and_wait_gc()


@pytest.mark.kuberay
def test_failed_rayjob_restarts_as_next_attempt(k8s_cluster: Cluster, operator: Operator,
                                                operator_ns: str) -> None:
    """KubeRay marks the RayJob Failed, so the operator restarts the job as attempt 1 (within
    backoffLimit): r1 is created, r0 and its Ray cluster are deleted, status and a Warning
    Event say so, and r1's cluster comes up.

    Why the RayJob fails here: kwok "completes" the submitter Job's pod, but no Ray job exists
    behind the dashboard (which doesn't even resolve from the host), and KubeRay v1.5 fails a
    RayJob whose submitter finished 30 s earlier without a terminal Ray job status
    (JobDeploymentStatusTransitionGracePeriodExceeded). A real failure, for the operator."""
    c, ns = k8s_cluster, operator_ns
    job = "restart-me"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, backoffLimit=1), check=True)
    try:
        w.wait_condition("ClusterReady", "True", timeout=60)
        w.wait_submitted(0)
        st = wait_for("the restart as attempt 1", lambda: w.status().get("rayJobName")
                      == names.rayjob(job, 1) and w.status(), timeout=90, detail=w.detail)
        # (Restarting until KubeRay takes r1 up, then Provisioning: either may be seen here)
        assert st["restarts"] == 1 and st["phase"] in ("Restarting", "Provisioning"), st
        warnings = wait_for("a Restarting Event", lambda: [
            e for e in events_for(c.api(), ns, job) if e["reason"] == "Restarting"], timeout=30)
        message = warnings[0]["message"]
        assert warnings[0]["type"] == "Warning", warnings
        assert f"RayJob {names.rayjob(job, 0)} failed" in message, message
        assert f"as RayJob {names.rayjob(job, 1)} (restart 1 of 1)" in message, message
        wait_for("RayJob r0 and its pods gone", lambda: w.rayjob(0) is None
                 and not w.pods_by_group(attempt=0), timeout=60, detail=w.pod_detail)
        w.wait_raycluster_ready(1)
        wait_for("ClusterReady=True for attempt 1", lambda: condition(
            w.get(), "ClusterReady").get("status") == "True" and w.status().get(
            "rayJobName") == names.rayjob(job, 1), timeout=30, detail=w.detail)
        assert {g: len(ps) for g, ps in w.pods_by_group(attempt=1).items()} == {
            "head": 1, "train": 1}
    finally:
        w.delete_and_wait_gc()


# ---------------------------------------------------------- 5. refused by the operator only


def test_operator_refuses_what_the_api_server_let_through(k8s_cluster: Cluster,
                                                          operator: Operator,
                                                          operator_ns: str) -> None:
    """An RLJob that the API server admits but the operator's model refuses (the CRD without
    the RLJob's policy, as where only crds/rljob.yaml was applied, or the chart's
    validationPolicy.enabled=false): the operator says Accepted=False with the field in the
    message, posts one Warning Event, keeps the job Pending, and creates nothing."""
    c, ns = k8s_cluster, operator_ns
    api = c.api()
    job = "clip-order"
    obj = base()
    obj["metadata"] = {"name": job, "namespace": ns}
    obj["spec"]["algorithm"] = {"epsClip": 0.2, "epsClipHigh": 0.1}
    refused = kubectl_apply(c, obj)
    assert refused.returncode != 0 and "epsClipHigh must be at least epsClip" in refused.stderr
    url = RLJOBS.format(ns=ns) + f"/{job}"
    try:
        with policy_unbound(c, ns):
            applied = kubectl_apply(c, obj)
            assert applied.returncode == 0, applied.stderr
        accepted = wait_for("Accepted=False", lambda: condition(api.get(url), "Accepted").get(
            "status") == "False" and condition(api.get(url), "Accepted"), timeout=30,
            detail=operator.tail)
        assert accepted["reason"] == "InvalidSpec", accepted
        assert "spec.algorithm.epsClipHigh" in accepted["message"], accepted
        assert "epsClipHigh must be at least epsClip" in accepted["message"], accepted
        assert api.get(url)["status"]["phase"] == "Pending"
        warnings = wait_for("an InvalidSpec Event", lambda: [
            e for e in events_for(api, ns, job) if e["reason"] == "InvalidSpec"], timeout=30)
        assert warnings[0]["type"] == "Warning"
        assert "spec.algorithm.epsClipHigh" in warnings[0]["message"]
        # Several resyncs later: still nothing created, and the Event was posted once.
        time.sleep(4 * RESYNC_SECONDS)
        for template, name_of in CHILDREN:
            child = template.format(ns=ns) + f"/{name_of(job)}"
            assert api.get(child) is None, f"{child} created for a refused spec"
        assert len([e for e in events_for(api, ns, job) if e["reason"] == "InvalidSpec"]) == 1
        shown = c.kubectl("get", "rljob", job, "-n", ns, "-o", "jsonpath={.status.phase}").stdout
        assert shown == "Pending"

        # The user fixes the spec (the restored policy checks the edited section again): the
        # operator accepts it and starts the job.
        obj["spec"]["algorithm"]["epsClipHigh"] = 0.28
        fixed = kubectl_apply(c, obj)
        assert fixed.returncode == 0, fixed.stderr
        accepted = wait_for("Accepted=True after the fix", lambda: condition(
            api.get(url), "Accepted").get("status") == "True" and condition(
            api.get(url), "Accepted"), timeout=30, detail=operator.tail)
        assert accepted["reason"] == "Accepted"
        wait_for("RayJob r0 after the fix", lambda: api.get(
            RAYJOBS.format(ns=ns) + f"/{names.rayjob(job, 0)}"), timeout=30,
            detail=operator.tail)
    finally:
        JobWatch(c, operator, ns, job).delete_and_wait_gc()


# --------------------------------------------------------- 6. the policy that holds the rules


def test_policy_is_installed_as_generated_and_type_checks(k8s_cluster: Cluster) -> None:
    """The policy from crds/ (as `kubectl apply -f crds/` installs it) is stored as the model
    generates it, and the API server's type check of its CEL against the RLJob's schema (the
    controller-manager's, in the policy's status) finds nothing to warn about."""
    c = k8s_cluster
    url = f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{POLICY_NAME}"

    def checked() -> dict[str, Any] | None:
        stored: dict[str, Any] = c.api().get(url)
        status = stored.get("status") or {}
        return stored if status.get("observedGeneration") == stored["metadata"][
            "generation"] and "typeChecking" in status else None

    stored = wait_for("the policy's type check", checked, timeout=60)
    assert stored["status"]["typeChecking"].get("expressionWarnings") is None, stored["status"]
    generated = rljob_policy()["spec"]
    for key in ("failurePolicy", "matchConditions", "variables", "validations"):
        assert stored["spec"][key] == generated[key], key
    rules = stored["spec"]["matchConstraints"]["resourceRules"]
    assert [r["resources"] for r in rules] == [["rljobs"]]


def test_status_writes_never_meet_the_policy(k8s_cluster: Cluster, validation_ns: str) -> None:
    """The policy matches what the RLJob's policy matches, but refuses everything: the real
    API server applies it to a label change of an RLJob and never to a status patch (a
    subresource is matched only by its own name). So a trainer's heartbeat costs no rule."""
    c, ns = k8s_cluster, validation_ns
    name = "e2e-status-probe"
    obj = base()
    obj["metadata"] = {"name": "status-probe", "namespace": ns}
    assert kubectl_apply(c, obj).returncode == 0
    probe = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
             "metadata": {"name": name},
             "spec": {"failurePolicy": "Fail",
                      "matchConstraints": rljob_policy()["spec"]["matchConstraints"],
                      "validations": [{"expression": "false", "message": "refused by the probe"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": name},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": ns}}}}}
    values = iter(range(1000))

    def labelled() -> subprocess.CompletedProcess[str]:  # a new value: a write every time
        proc: subprocess.CompletedProcess[str] = c.kubectl(
            "label", "rljob", "status-probe", "-n", ns, f"probe={next(values)}", "--overwrite",
            check=False)
        return proc

    try:
        assert kubectl_apply(c, {"apiVersion": "v1", "kind": "List",
                                 "items": [probe, binding]}).returncode == 0
        wait_for("the probe in force", lambda: "refused by the probe" in labelled().stderr,
                 timeout=30, interval=0.5)
        for step in range(3):
            patched = c.kubectl("patch", "rljob", "status-probe", "-n", ns,
                                "--subresource=status", "--type=merge", "-p", json.dumps(
                                    {"status": {"progress": {"step": step}}}), check=False)
            assert patched.returncode == 0, patched.stderr
    finally:
        c.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name,
                  "--ignore-not-found")
        wait_for("the probe out of force", lambda: labelled().returncode == 0, timeout=30,
                 interval=0.5)
        c.kubectl("delete", "rljob", "status-probe", "-n", ns, "--ignore-not-found")


def test_policy_ratchets_what_was_stored_before_it(k8s_cluster: Cluster,
                                                  validation_ns: str) -> None:
    """A job stored while the policy did not hold it (an older kuberl's rules, or none) and
    that breaks a rule now: its labels, its status and the spec sections the rule does not read
    still take writes; an edit of what the rule reads is refused with the rule's message."""
    c, ns = k8s_cluster, validation_ns
    obj = base()
    obj["metadata"] = {"name": "stored-before", "namespace": ns}
    obj["spec"]["training"] = {"backend": "megatron", "gpusPerNode": 0}  # megatron needs GPUs
    obj["spec"]["rollout"] = {"engine": "reference", "gpus": 0}
    refused = kubectl_apply(c, obj)
    rule = "backend megatron trains on GPUs"
    assert refused.returncode != 0 and rule in refused.stderr, refused.stderr
    with policy_unbound(c, ns):
        stored = kubectl_apply(c, obj)
        assert stored.returncode == 0, stored.stderr
    try:
        labelled = c.kubectl("label", "rljob", "stored-before", "-n", ns, "team=a", check=False)
        assert labelled.returncode == 0, labelled.stderr
        status = c.kubectl("patch", "rljob", "stored-before", "-n", ns, "--subresource=status",
                           "--type=merge", "-p", '{"status": {"phase": "Pending"}}', check=False)
        assert status.returncode == 0, status.stderr
        for ok in ({"algorithm": {"lr": 1e-5}}, {"suspend": True}):
            edited = c.kubectl("patch", "rljob", "stored-before", "-n", ns, "--type=merge",
                               "-p", json.dumps({"spec": ok}), check=False)
            assert edited.returncode == 0, (ok, edited.stderr)
        edited = c.kubectl("patch", "rljob", "stored-before", "-n", ns, "--type=merge", "-p",
                           '{"spec": {"training": {"nodes": 2}}}', check=False)
        assert edited.returncode != 0, edited.stdout
        assert f"spec.training.gpusPerNode: {rule}" in edited.stderr, edited.stderr
    finally:
        c.kubectl("delete", "rljob", "stored-before", "-n", ns, "--ignore-not-found")


def test_env_names_refused_at_apply(k8s_cluster: Cluster, validation_ns: str) -> None:
    """Found by this tier: the API server refuses pods with such env names, so a job that
    got past apply would sit in Provisioning while KubeRay failed to create its GPU pods."""
    obj = base()
    obj["metadata"] = {"name": "bad-env-name", "namespace": validation_ns}
    obj["spec"]["network"] = {"env": {"NCCL_DEBUG=INFO": "1"}}
    proc = kubectl_apply(k8s_cluster, obj)
    k8s_cluster.kubectl("delete", "rljob", "bad-env-name", "-n", validation_ns,
                        "--ignore-not-found")
    assert proc.returncode != 0 and "spec.network.env" in proc.stderr, proc.stdout


# ------------------------------------------------- CEL rules after a violated minimum or maximum
# Found by this tier when the rules were the CRD's: the API server still runs a CRD's CEL rules
# after a schema error such as a minimum or a maximum (only a wrong type, a missing field, an
# enum or a length stops them), and the rules that divide added "division by zero evaluating
# rule" to the message, those that multiply "integer overflow evaluating rule" (int64), until
# they were guarded. The policy runs only on objects the schema accepted; these keep the bound's
# message alone, whatever holds the rules.

# The unit tier's tables, as (id, edit of spec, the field, a field a CEL rule names too, or "",
# the bound the server reports: "<field> in body should be <bound>"): a divisor at 0, and an
# operand far outside its range.
BOUND_VIOLATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str, str, str]] = [
    *[(case, edit, field, also, "greater than or equal to 1")
      for case, edit, field, also in _validation.ZERO_DIVISORS],
    *_validation.OVERFLOWS,
]


@pytest.mark.parametrize(("case", "edit", "field", "also", "bound"), BOUND_VIOLATIONS,
                         ids=[c[0] for c in BOUND_VIOLATIONS])
def test_no_cel_evaluation_errors_when_a_bound_is_violated(
        k8s_cluster: Cluster, validation_ns: str, case: str,
        edit: Callable[[dict[str, Any]], None], field: str, also: str, bound: str) -> None:
    """A divisor of a cross-field rule at 0, or an operand at 2**62, is refused by its own
    minimum or maximum alone: no CEL rule fails to evaluate (division by zero, int64
    overflow), and the CEL messages are just those the unit tier's emulation gives."""
    obj = _bad_manifest(case, edit, validation_ns)
    proc = kubectl_apply(k8s_cluster, obj)
    k8s_cluster.kubectl("delete", "rljob", obj["metadata"]["name"], "-n", validation_ns,
                        "--ignore-not-found")
    text = proc.stderr
    assert proc.returncode != 0, proc.stdout
    for noise in ("evaluating rule", "overflow", "by zero"):
        assert noise not in text, text
    assert f"{field} in body should be {bound}" in text, text
    # The CRD's schema refuses the object before admission runs the policy: no rule adds to
    # the bound's message (`also`, a field a rule names too, was reported when the rules were
    # the CRD's, which the server runs after such an error).
    expected = {p.partition(": ")[2] for p in admit(SCHEMA, obj)} & CEL_MESSAGES
    assert {m for m in CEL_MESSAGES if m in text} == expected, text


@pytest.mark.kuberay
def test_operator_log_is_clean(operator: Operator) -> None:
    """No reconcile errors on a real API server (they'd show as retries, not failures)."""
    lines = operator.log.read_text(errors="replace").splitlines()
    assert lines, "the operator logged nothing"
    errors = [line for line in lines if "reconcile of" in line and "failed" in line]
    assert not errors, "\n".join(errors[:20])
