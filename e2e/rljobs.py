"""The RLJob side of the e2e tier: the operator as the chart runs it, watching an RLJob and its
children, and the small helpers the test modules share (test_rljob.py, test_lifecycle.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from cluster import Api, Cluster, terminate, write_kubeconfig
from polling import wait_for

from kuberl_api.rljob import API_VERSION, KIND
from kuberl_operator.policy import POLICY_NAME
from kuberl_operator.render import names

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"  # what the session's cluster starts with (conftest.py)
# The RLJob's rules as a ValidatingAdmissionPolicy and its binding (`kuberl crd --policy`):
# installed with crds/ when the cluster starts, as `kubectl apply -f crds/` installs them.
POLICY_FILE = CRDS / "rljob-policy.yaml"

RLJOBS = "/apis/kuberl.dev/v1alpha1/namespaces/{ns}/rljobs"
RAYJOBS = "/apis/ray.io/v1/namespaces/{ns}/rayjobs"
RAYCLUSTERS = "/apis/ray.io/v1/namespaces/{ns}/rayclusters"
# The children the operator renders, by URL template and name function.
CHILDREN: list[tuple[str, Callable[[str], str]]] = [
    ("/api/v1/namespaces/{ns}/serviceaccounts", names.service_account),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", names.role),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", names.role_binding),
    ("/api/v1/namespaces/{ns}/configmaps", names.configmap),
    ("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", names.network_policy),
    ("/api/v1/namespaces/{ns}/secrets", lambda job: names.engine_key_secret(job, 0)),
    (RAYJOBS, lambda job: names.rayjob(job, 0)),
]
RESYNC_SECONDS = 1.0


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def namespace(cluster: Cluster, prefix: str) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (without waiting: the namespace controller
    finishes it in the background)."""
    ns = unique(prefix)
    api = cluster.api()
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": ns}})
    # Pods can't be admitted before the service-account controller made `default`.
    wait_for(f"ServiceAccount {ns}/default", lambda: api.get(
        f"/api/v1/namespaces/{ns}/serviceaccounts/default"), timeout=30)
    try:
        yield ns
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def install_crds(c: Cluster, files: list[Path] | None = None) -> None:
    """Install a release's CRDs as an upgrade (or a downgrade) does: `kubectl apply
    --server-side` of its crd files (default: this checkout's crds/, as the README says), taking
    over fields another apply set. Objects this checkout's crds/ holds and `files` do not are
    deleted: a release without them had none (before issue 36, the rules were the CRD's, and
    there was no policy). Returns once the rules' policy is in force, or out of force where
    `files` have none; the API server serves a new schema a moment after this returns: wait for
    its effect."""
    chosen = files if files is not None else sorted(CRDS.glob("*.yaml"))
    for path in chosen:
        c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))

    def objects(paths: list[Path]) -> set[tuple[str, str]]:
        docs = [d for path in paths for d in yaml.safe_load_all(path.read_text()) if d]
        return {(d["kind"], d["metadata"]["name"]) for d in docs}

    for kind, name in sorted(objects(sorted(CRDS.glob("*.yaml"))) - objects(chosen)):
        c.kubectl("delete", kind, name, "--ignore-not-found")
    c.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    policy = ("ValidatingAdmissionPolicyBinding", POLICY_NAME) in objects(chosen)
    wait_for(f"the RLJob policy {'in' if policy else 'out of'} force",
             lambda: policy_enforced(c, "default") == policy, timeout=30, interval=0.5)


@contextlib.contextmanager
def static_claims(cluster: Cluster, ns: str, claims: list[str]) -> Iterator[list[str]]:
    """Statically provisioned PVs bound to `claims` in `ns` (there is no provisioner here, and
    pods whose claims are unbound never schedule); the PVs are deleted afterwards."""
    api = cluster.api()
    for claim in claims:
        pv = f"{ns}-{claim}"
        api.create("/api/v1/persistentvolumes", {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
            "spec": {"capacity": {"storage": "1Ti"},
                     "accessModes": ["ReadWriteMany", "ReadOnlyMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": f"/tmp/kuberl-e2e/{pv}"},
                     "claimRef": {"namespace": ns, "name": claim}}})
        api.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "volumeName": pv, "resources": {"requests": {"storage": "1Ti"}}}})

    def bound() -> bool:
        return all((api.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}") or {})
                   .get("status", {}).get("phase") == "Bound" for claim in claims)

    wait_for(f"PVCs {claims} in {ns} Bound", bound, timeout=60)
    try:
        yield claims
    finally:
        for claim in claims:
            with contextlib.suppress(urllib.error.HTTPError):
                api.request("DELETE", f"/api/v1/persistentvolumes/{ns}-{claim}")


def kubectl_apply(c: Cluster, obj: Mapping[str, Any] | str, *args: str,
                  check: bool = False) -> subprocess.CompletedProcess[str]:
    text: str = obj if isinstance(obj, str) else json.dumps(obj)
    proc: subprocess.CompletedProcess[str] = c.kubectl("apply", "-f", "-", *args, input=text,
                                                       check=check)
    return proc


def policy_enforced(c: Cluster, ns: str) -> bool:
    """Whether the RLJob's policy refuses a job that breaks a rule (a server-side dry run: the
    API server loads policies and bindings asynchronously, so a test waits for this)."""
    job = cpu_job("policy-probe", ns, training={"backend": "megatron", "gpusPerNode": 0})
    proc = c.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(job),
                     check=False)
    return proc.returncode != 0 and f"ValidatingAdmissionPolicy '{POLICY_NAME}'" in proc.stderr


@contextlib.contextmanager
def policy_unbound(c: Cluster, ns: str, *delete: str) -> Iterator[None]:
    """The RLJob's rules out of force, as on a cluster whose admin applied only the CRD (or an
    older kuberl's rules): `kubectl delete *delete` (default: the policy's binding), the
    policy and its binding re-applied from crds/ afterwards."""
    c.kubectl("delete", *(delete or ("validatingadmissionpolicybinding", POLICY_NAME)))
    wait_for("the RLJob policy out of force", lambda: not policy_enforced(c, ns), timeout=30,
             interval=0.5)
    try:
        yield
    finally:
        c.kubectl("apply", "-f", str(POLICY_FILE))
        wait_for("the RLJob policy in force", lambda: policy_enforced(c, ns), timeout=30,
                 interval=0.5)


def condition(obj: Mapping[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def events_for(api: Api, ns: str, name: str) -> list[dict[str, Any]]:
    selector = urllib.parse.quote(f"involvedObject.name={name},involvedObject.kind={KIND}")
    items = api.get(f"/api/v1/namespaces/{ns}/events?fieldSelector={selector}")["items"]
    return list(items)


def selector_query(labels: Mapping[str, str]) -> str:
    return "labelSelector=" + urllib.parse.quote(",".join(f"{k}={v}" for k, v in labels.items()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 3) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def table_row(lines: list[str]) -> dict[str, str]:
    """The first row of `kubectl get` output by column (cells may be blank)."""
    header, row = lines[0], lines[1]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts[1:], max(len(header), len(row)) + 1]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, bounds, strict=True)}



def cpu_job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    """A CPU-only colocated job without PVCs: its pods go to the untainted cpu pool."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"path": "/models/tiny"}, "data": {"prompts": "/data/p.jsonl"},
                     "training": {"backend": "fsdp", "gpusPerNode": 0},
                     "rollout": {"engine": "reference", "gpus": 0}, **spec}}


# ----------------------------------------------------------------------- the operator


class Operator:
    """`python -m kuberl_operator`, exactly as the chart's Deployment runs it, watching one
    namespace, *with the chart's identity*: the chart is installed (namespaced mode) and the
    operator logs in with its ServiceAccount's token, so a permission the chart lacks fails
    these tests. (The chart's own pod is a kwok stand-in that runs nothing.)

    `code`: the root of another kuberl source tree to run instead of this checkout's (an
    earlier release's operator, e2e/test_upgrade.py), with this checkout's venv; a test may
    change it (and `log`) between a stop and a start."""

    RELEASE = "kuberl"  # the chart names its ServiceAccount after the release

    def __init__(self, cluster: Cluster, ns: str, log: Path,
                 resync_seconds: float = RESYNC_SECONDS, code: Path | None = None) -> None:
        self.cluster = cluster
        self.ns = ns
        self.log = log
        self.identity = log.with_suffix(".kubeconfig")
        self.resync_seconds = resync_seconds
        self.code = code
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def chart_identity(self) -> Path:
        path = self.identity
        if path.exists():  # installed by an earlier start (a restarted operator)
            return path
        # The cluster has the CRD and the RLJob's policy from crds/ (conftest.py): the chart
        # installs neither (--skip-crds; the policy is one per cluster).
        helm = subprocess.run(
            [str(self.cluster.helm_path), "install", self.RELEASE, str(ROOT / "helm" / "kuberl"),
             "-n", self.ns, "--skip-crds", "--set", f"watchNamespaces={{{self.ns}}}",
             "--set", "validationPolicy.enabled=false"],
            capture_output=True, text=True, env=self.cluster.env, timeout=120)
        assert helm.returncode == 0, helm.stderr
        token = self.cluster.kubectl("create", "token", self.RELEASE, "-n", self.ns,
                                     "--duration", "3h").stdout.strip()
        write_kubeconfig(path, self.cluster.server, self.cluster.state_dir / "pki" / "ca.crt",
                         f"system:serviceaccount:{self.ns}:{self.RELEASE}", token=token)
        return path

    def chart_env(self) -> dict[str, str]:
        """The chart Deployment's KUBERL_NETWORK_POLICY* variables (the peers it renders from
        its values), so the jobs' NetworkPolicies are the ones the chart's operator makes."""
        dep = self.cluster.api().get(
            f"/apis/apps/v1/namespaces/{self.ns}/deployments/{self.RELEASE}")
        assert dep is not None, f"the chart's Deployment {self.ns}/{self.RELEASE}"
        (box,) = dep["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in box.get("env", [])
                if e["name"].startswith("KUBERL_NETWORK_POLICY")}

    def start(self) -> None:
        kubeconfig = str(self.chart_identity())
        env = {**self.cluster.env, "PYTHONUNBUFFERED": "1", "KUBECONFIG": kubeconfig,
               **self.chart_env()}
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never the in-cluster login
        if self.code is not None:  # its packages first on the path (the venv's come after)
            paths = [str(self.code / d) for d in ("operator", "env_image", "wire")]
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        # --no-scanning: as the chart sets it in namespaced mode (no cluster-wide reads).
        args = [sys.executable, "-m", "kuberl_operator", "-n", self.ns, "-v", "--no-scanning",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--health-port", str(self.health_port),
                "--resync-seconds", str(self.resync_seconds), "--error-backoff-seconds", "1"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT)

        def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, (
                f"the operator exited with {self.proc and self.proc.returncode}\n{self.tail()}")
            return http_get(f"http://127.0.0.1:{self.health_port}/healthz")[0] == 200

        wait_for("the operator's /healthz", healthy, timeout=90, detail=self.tail)

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "----- operator log (end) -----\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, grace=15)



class JobWatch:
    """Reads of one RLJob and what it owns, with failure details for wait_for."""

    def __init__(self, cluster: Cluster, operator: Operator, ns: str, job: str) -> None:
        self.c, self.api, self.operator, self.ns, self.job = (cluster, cluster.api(), operator,
                                                              ns, job)
        self.url = RLJOBS.format(ns=ns) + f"/{job}"
        self.pods_url = f"/api/v1/namespaces/{ns}/pods?" + selector_query(names.selector(job))

    def get(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.api.get(self.url) or {}
        return obj

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.get().get("status") or {}
        return st

    def detail(self) -> str:
        return json.dumps(self.status(), indent=1) + "\n" + self.operator.tail()

    def wait_condition(self, type_: str, status: str, timeout: float = 60) -> dict[str, Any]:
        found: dict[str, Any] = wait_for(
            f"{type_}={status} on RLJob {self.ns}/{self.job}",
            lambda: condition(self.get(), type_).get("status") == status
            and condition(self.get(), type_), timeout=timeout, detail=self.detail)
        return found

    def rayjob(self, attempt: int) -> dict[str, Any] | None:
        obj: dict[str, Any] | None = self.api.get(
            RAYJOBS.format(ns=self.ns) + f"/{names.rayjob(self.job, attempt)}")
        return obj

    def raycluster_url(self, attempt: int) -> str:
        name = wait_for(f"RayJob {names.rayjob(self.job, attempt)} status.rayClusterName",
                        lambda: (self.rayjob(attempt) or {}).get("status", {}).get(
                            "rayClusterName"), detail=self.detail)
        return RAYCLUSTERS.format(ns=self.ns) + f"/{name}"

    def wait_raycluster_ready(self, attempt: int, timeout: float = 90) -> str:
        """The RayCluster that the RayJob's status names *now* is ready. The name is read
        again on each poll: a RayJob created suspended (Kueue) gets a name from KubeRay's
        first reconcile, and a new one once unsuspended (the first cluster never existed)."""
        url = self.raycluster_url(attempt)

        def ready() -> bool:
            nonlocal url
            url = self.raycluster_url(attempt)
            return bool((self.api.get(url) or {}).get("status", {}).get("state") == "ready")

        wait_for(f"RayCluster of RayJob {names.rayjob(self.job, attempt)} status.state ready",
                 ready, timeout=timeout, detail=lambda: url + " " + json.dumps((self.api.get(
                     url) or {}).get("status"), indent=1) + "\n" + self.pod_detail())
        return url

    def wait_submitted(self, attempt: int, timeout: float = 30) -> None:
        """KubeRay found the dashboard on the head Service and started the submitter Job
        (jobDeploymentStatus Running): the RayJob did not stall in Initializing."""
        name = names.rayjob(self.job, attempt)

        def detail() -> str:
            rj = self.rayjob(attempt) or {}
            ports = (self.head_service(attempt) or {}).get("spec", {}).get("ports", [])
            return (f"RayJob status: {json.dumps(rj.get('status'), indent=1)}\nhead Service "
                    f"ports: {[p.get('name') for p in ports]}")

        wait_for(f"RayJob {name} submitted (jobDeploymentStatus Running)", lambda: (
            self.rayjob(attempt) or {}).get("status", {}).get("jobDeploymentStatus")
            == "Running", timeout=timeout, detail=detail)
        svc = self.head_service(attempt)
        ports = {p.get("name") for p in (svc or {}).get("spec", {}).get("ports", [])}
        assert {"gcs-server", "dashboard", "client", "trainer-metrics"} <= ports, ports
        jobs = self.api.get(f"/apis/batch/v1/namespaces/{self.ns}/jobs/{name}")
        assert jobs is not None, f"no submitter Job {name}"

    def head_service(self, attempt: int) -> dict[str, Any] | None:
        cluster = ((self.rayjob(attempt) or {}).get("status") or {}).get("rayClusterName")
        if not cluster:
            return None
        items = self.api.get(f"/api/v1/namespaces/{self.ns}/services?" + selector_query(
            {"ray.io/cluster": cluster, "ray.io/node-type": "head"}))["items"]
        return dict(items[0]) if items else None

    def pods_by_group(self, attempt: int | None = None) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for pod in self.api.get(self.pods_url)["items"]:
            labels = pod["metadata"]["labels"]
            group = labels.get(names.LABEL_GROUP)
            if group and (attempt is None or labels.get(names.LABEL_ATTEMPT) == str(attempt)):
                out.setdefault(group, []).append(pod)  # (not KubeRay's submitter pod: no group)
        return out

    def pod_detail(self) -> str:
        lines = []
        for group, ps in self.pods_by_group().items():
            for p in ps:
                conds = [(x["type"], x["status"], x.get("message", ""))
                         for x in p["status"].get("conditions", [])]
                lines.append(f"{group} {p['metadata']['name']} node={p['spec'].get('nodeName')} "
                             f"phase={p['status'].get('phase')} {conds}")
        return "\n".join(lines) or "no pods"

    def delete_and_wait_gc(self, timeout: float = 90) -> float:
        """Delete the RLJob; the garbage collector removes every child, the RayJobs'
        RayClusters and their pods. Returns the seconds GC took."""
        # (not found: a test that failed before creating it; its cleanup must not hide that)
        self.c.kubectl("delete", "rljob", self.job, "-n", self.ns, "--wait=true",
                       "--timeout=60s", "--ignore-not-found")
        t0 = time.monotonic()

        def leftovers() -> list[str]:
            api, ns, job = self.api, self.ns, self.job
            left = [url for template, name_of in CHILDREN
                    if api.get(url := template.format(ns=ns) + f"/{name_of(job)}") is not None]
            sel = selector_query(names.selector(job))
            left += [f"RayJob {o['metadata']['name']}" for o in api.get(
                RAYJOBS.format(ns=ns) + "?" + sel)["items"]]
            left += [f"RayCluster {o['metadata']['name']}" for o in api.get(
                RAYCLUSTERS.format(ns=ns))["items"]
                if o["metadata"]["name"].startswith(f"{job}-r")]
            left += [f"pod {p['metadata']['name']}" for p in api.get(self.pods_url)["items"]]
            return left

        wait_for(f"garbage collection of everything RLJob {self.job} owned",
                 lambda: not leftovers(), timeout=timeout, detail=lambda: f"left: {leftovers()}")
        return time.monotonic() - t0


def wait_phase(w: JobWatch, phase: str, timeout: float = 60) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(f"RLJob {w.job} phase {phase}", lambda: (
        st := w.status()).get("phase") == phase and st, timeout=timeout, detail=w.detail)
    return found


def event_reasons(c: Cluster, ns: str, job: str) -> list[str]:
    return [e["reason"] for e in events_for(c.api(), ns, job)]


def provisioned(w: JobWatch, attempt: int) -> None:
    """KubeRay brought attempt `attempt`'s cluster up and started its submitter."""
    w.wait_raycluster_ready(attempt)
    wait_for(f"ClusterReady=True for attempt {attempt}", lambda: condition(
        w.get(), "ClusterReady").get("status") == "True" and w.status().get(
        "rayJobName") == names.rayjob(w.job, attempt), timeout=60, detail=w.detail)
    w.wait_submitted(attempt)
