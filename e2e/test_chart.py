"""The Helm chart (helm/kuberl) against the real control plane: lint, render, install, RBAC,
and the observability pack (dashboard, alerts) rendered from the chart's own files.

What a user relies on: `helm lint` is clean in both RBAC modes; `helm install` creates a
one-replica Recreate Deployment that runs non-root on a read-only root filesystem and becomes
Available, and the RLJob's ValidatingAdmissionPolicy, which then refuses a bad RLJob; and the
operator's ServiceAccount may do exactly what the operator does (asked of the real API server's
authorizer with `kubectl auth can-i --as`), nothing cluster-wide in namespaced mode, and never
write an RLJob's spec.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import Cluster
from polling import wait_for
from prometheus import promtool
from rljobs import POLICY_FILE, cpu_job, kubectl_apply, policy_enforced, policy_unbound

from kuberl_operator.policy import POLICY_NAME
from kuberl_operator.settings import parse_args

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parent.parent / "helm" / "kuberl"
DASHBOARD = CHART / "dashboards" / "kuberl.json"
RULES = CHART / "rules" / "kuberl-alerts.yaml"

# (verb, resource) pairs the operator uses on the namespaces it watches.
OPERATOR_NEEDS = [
    ("watch", "rljobs.kuberl.dev"), ("list", "rljobs.kuberl.dev"),
    ("patch", "rljobs.kuberl.dev/status"),
    ("create", "rayjobs.ray.io"), ("delete", "rayjobs.ray.io"), ("watch", "rayjobs.ray.io"),
    ("get", "rayclusters.ray.io"), ("create", "configmaps"), ("create", "serviceaccounts"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"), ("create", "events"),
    ("create", "deployments.apps"), ("patch", "deployments.apps"), ("create", "services"),
    ("create", "secrets"),
    ("create", "networkpolicies.networking.k8s.io"), ("get", "networkpolicies.networking.k8s.io"),
    ("patch", "networkpolicies.networking.k8s.io"),
]
# What it must never be able to do there.
OPERATOR_MUST_NOT = [
    ("update", "rljobs.kuberl.dev"), ("patch", "rljobs.kuberl.dev"),  # the user's spec
    ("create", "pods"), ("delete", "pods"), ("get", "secrets"), ("list", "secrets"),
    ("update", "secrets"), ("delete", "secrets"), ("create", "statefulsets.apps"),
    ("create", "daemonsets.apps"),
]


# The observability pack on (docs/observability.md): monitors, alerts, dashboard.
OBSERVABILITY = ["--set", "metrics.serviceMonitor.enabled=true",
                 "--set", "metrics.podMonitor.enabled=true",
                 "--set", "metrics.prometheusRule.enabled=true",
                 "--set", "metrics.grafanaDashboard.enabled=true"]


def helm(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(cluster.helm_path), *args], capture_output=True, text=True,
                          env=cluster.env, timeout=120)
    if check and done.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def can_i(cluster: Cluster, sa: str, verb: str, resource: str, ns: str) -> bool:
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    done = cluster.kubectl("auth", "can-i", verb, resource, *extra, "-n", ns, f"--as={sa}",
                           check=False)
    return bool(done.stdout.strip() == "yes")


@pytest.fixture
def namespaces(k8s_cluster: Cluster) -> Iterator[list[str]]:
    names = [f"chart-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for ns in names:
        k8s_cluster.kubectl("create", "namespace", ns)
    yield names
    for ns in names:
        k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.parametrize("values", [
    [],
    ["--set", "watchNamespaces={ml,team-a}", "--set", "metrics.serviceMonitor.enabled=true",
     "--set", "metrics.podMonitor.enabled=true"],
    [*OBSERVABILITY, "--set", "metrics.prometheusRule.alerts.KuberlRLJobStalled.for=1h",
     "--set", "metrics.prometheusRule.alerts.KuberlEngineRestartsClimbing.threshold=10"],
], ids=["cluster-wide", "namespaced-with-monitors", "observability"])
def test_chart_lints_clean(k8s_cluster: Cluster, values: list[str]) -> None:
    done = helm(k8s_cluster, "lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in done.stdout



def rendered(cluster: Cluster, *values: str) -> list[dict[str, Any]]:
    out = helm(cluster, "template", "kuberl", str(CHART), "-n", "kuberl-system",
               "--kube-version", "1.37.2", *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_renders_the_policy_crds_has(k8s_cluster: Cluster) -> None:
    """The chart's policy is crds/rljob-policy.yaml's, as generated; a value turns it off."""
    policy = [d for d in rendered(k8s_cluster)
              if d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert policy == [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]
    off = rendered(k8s_cluster, "--set", "validationPolicy.enabled=false")
    assert not [d for d in off if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_namespaced_mode_grants_nothing_cluster_wide(k8s_cluster: Cluster) -> None:
    docs = rendered(k8s_cluster, "--set", "watchNamespaces={ml,team-a}")
    kinds = [(d["kind"], d["metadata"].get("namespace")) for d in docs]
    assert not any(k in ("ClusterRole", "ClusterRoleBinding") for k, _ in kinds), kinds
    assert ("Role", "ml") in kinds and ("Role", "team-a") in kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBERL_NAMESPACES"] == "ml,team-a" and env["KUBERL_SCANNING"] == "false"


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e.get("value") for e in
            deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_network_policy_values_reach_the_operator(k8s_cluster: Cluster) -> None:
    """networkPolicy.*: on by default; the peers (this operator's pods in its namespace,
    KubeRay's, the scrapers, the extra ones, in that order) as the operator parses them."""
    env = operator_env(rendered(k8s_cluster, "--set-json", 'networkPolicy.extraPeers='
                                '[{"ipBlock": {"cidr": "10.1.0.0/16"}}]'))
    assert env["KUBERL_NETWORK_POLICY"] == "true"
    config = parse_args([], env)
    operator, kuberay, prometheus, extra = config.network_policy_peers
    assert operator == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberl-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberl",
                                        "app.kubernetes.io/instance": "kuberl",
                                        "app.kubernetes.io/component": "operator"}}}
    assert kuberay["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    assert prometheus["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    assert extra == {"ipBlock": {"cidr": "10.1.0.0/16"}}
    off = operator_env(rendered(k8s_cluster, "--set", "networkPolicy.enabled=false",
                                "--set", "networkPolicy.kuberayOperator=null"))
    assert not parse_args([], off).ingress.enabled
    assert len(parse_args([], off).network_policy_peers) == 2  # no KubeRay peer


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_observability_pack_is_off_by_default(k8s_cluster: Cluster) -> None:
    docs = rendered(k8s_cluster)
    assert not by_kind(docs, "PrometheusRule")
    assert not [d for d in by_kind(docs, "ConfigMap")
                if "grafana_dashboard" in d["metadata"].get("labels", {})]


def test_observability_pack_renders_the_chart_files(k8s_cluster: Cluster) -> None:
    """The dashboard ConfigMap carries the sidecar's label and the JSON file as is; the
    PrometheusRule with default values is the rule file that promtool tests, group for group
    (values.yaml's alert defaults cannot drift from it); the PodMonitor labels a head's series
    with the RLJob the dashboard and alerts select on."""
    docs = rendered(k8s_cluster, *OBSERVABILITY)
    [dashboard] = [d for d in by_kind(docs, "ConfigMap")
                   if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert dashboard["metadata"]["namespace"] == "kuberl-system"
    assert json.loads(dashboard["data"]["kuberl.json"]) == json.loads(DASHBOARD.read_text())
    [rule] = by_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    # The operator's series name each RLJob's namespace: that label, not the target's (the
    # operator's namespace), is the one the dashboard and alerts select on.
    [service_monitor] = by_kind(docs, "ServiceMonitor")
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    [pod_monitor] = by_kind(docs, "PodMonitor")
    relabel = pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_kuberl_dev_rljob"],
            "targetLabel": "rljob"} in relabel
    # The sidecar's label, the ConfigMap's namespace and folder annotation are settable.
    [moved] = [d for d in by_kind(rendered(
        k8s_cluster, *OBSERVABILITY, "--set", "metrics.grafanaDashboard.namespace=monitoring",
        "--set", "metrics.grafanaDashboard.label=dashboards",
        "--set", "metrics.grafanaDashboard.labelValue=kuberl",
        "--set", "metrics.grafanaDashboard.annotations.grafana_folder=ML"), "ConfigMap")
        if d["metadata"].get("labels", {}).get("dashboards") == "kuberl"]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "ML"}


def test_alert_thresholds_come_from_values(k8s_cluster: Cluster, tmp_path: Path) -> None:
    docs = rendered(
        k8s_cluster, *OBSERVABILITY,
        "--set", "metrics.prometheusRule.alerts.KuberlEngineRestartsClimbing.threshold=10",
        "--set", "metrics.prometheusRule.alerts.KuberlTrainerHeartbeatOld.for=45m",
        "--set", "metrics.prometheusRule.alerts.KuberlTrainerHeartbeatOld.threshold=900",
        "--set", "metrics.prometheusRule.alerts.KuberlRLJobFailed.severity=critical",
        "--set", "metrics.prometheusRule.alerts.KuberlRLJobStalled.enabled=false",
        "--set", "metrics.prometheusRule.alertLabels.team=ml",
        "--set", "metrics.prometheusRule.labels.release=kube-prometheus-stack")
    [rule] = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "KuberlRLJobStalled" not in alerts
    assert alerts["KuberlEngineRestartsClimbing"]["expr"].endswith(">= 10")
    assert alerts["KuberlTrainerHeartbeatOld"]["for"] == "45m"
    assert alerts["KuberlTrainerHeartbeatOld"]["expr"].endswith(") > 900")
    assert alerts["KuberlRLJobFailed"]["labels"] == {"severity": "critical", "team": "ml"}
    assert all(r["labels"]["team"] == "ml" for r in alerts.values())
    # What the PrometheusRule holds is a rule file Prometheus accepts.
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr
    # A threshold for an alert without one is refused, naming the key.
    done = helm(k8s_cluster, "template", "kuberl", str(CHART), "--kube-version", "1.37.2",
                *OBSERVABILITY, "--set",
                "metrics.prometheusRule.alerts.KuberlRLJobStalled.threshold=3",
                check=False)
    assert done.returncode != 0
    assert "metrics.prometheusRule.alerts.KuberlRLJobStalled.threshold" in done.stderr


def wait_available(cluster: Cluster, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    def available() -> dict[str, Any] | None:
        obj: dict[str, Any] = json.loads(cluster.kubectl("get", "deployment", name, "-n", ns,
                                                         "-o", "json").stdout)
        conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
        return obj if conditions.get("Available") == "True" else None

    result: dict[str, Any] = wait_for(f"deployment {ns}/{name} Available", available, timeout)
    return result


@pytest.fixture
def policy_from_the_chart(k8s_cluster: Cluster, namespaces: list[str]) -> Iterator[None]:
    """The harness installed the RLJob's policy from crds/ (one per cluster): out for a chart
    that installs its own, back afterwards."""
    with policy_unbound(k8s_cluster, namespaces[1], "-f", str(POLICY_FILE)):
        yield


def test_install_cluster_wide(k8s_cluster: Cluster, namespaces: list[str],
                              policy_from_the_chart: None) -> None:
    release_ns, job_ns, _ = namespaces
    release = f"kuberl-{release_ns[-6:]}"
    # The CRD is already in the cluster (the harness applies crds/ at start): --skip-crds, as a
    # user upgrading it with `kubectl apply --server-side -f crds/` would. The policy is the
    # chart's (validationPolicy.enabled, on by default).
    helm(k8s_cluster, "install", release, str(CHART), "-n", release_ns, "--skip-crds",
         "--wait=false")
    try:
        policy = json.loads(k8s_cluster.kubectl(
            "get", "validatingadmissionpolicy", POLICY_NAME, "-o", "json").stdout)
        assert policy["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        wait_for("the chart's policy in force", lambda: policy_enforced(k8s_cluster, job_ns),
                 timeout=30, interval=0.5)
        # a good job is admitted, and its status takes writes (as the trainer's heartbeat)
        good = kubectl_apply(k8s_cluster, cpu_job("chart-policy", job_ns))
        assert good.returncode == 0, good.stderr
        status = k8s_cluster.kubectl("patch", "rljob", "chart-policy", "-n", job_ns,
                                     "--subresource=status", "--type=merge", "-p",
                                     '{"status": {"progress": {"step": 1}}}', check=False)
        assert status.returncode == 0, status.stderr

        deployment = wait_available(k8s_cluster, release_ns, release)
        spec = deployment["spec"]
        assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["resources"]["requests"] and container["resources"]["limits"]
        service = json.loads(k8s_cluster.kubectl("get", "service", f"{release}-metrics", "-n",
                                                 release_ns, "-o", "json").stdout)
        assert service["spec"]["ports"][0]["targetPort"] == "metrics"

        sa = f"system:serviceaccount:{release_ns}:{release}"
        for verb, resource in OPERATOR_NEEDS:
            assert can_i(k8s_cluster, sa, verb, resource, job_ns), (verb, resource)
        for verb, resource in OPERATOR_MUST_NOT:
            assert not can_i(k8s_cluster, sa, verb, resource, job_ns), (verb, resource)
    finally:
        helm(k8s_cluster, "uninstall", release, "-n", release_ns, check=False)


def test_install_namespaced(k8s_cluster: Cluster, namespaces: list[str]) -> None:
    release_ns, watched, other = namespaces
    release = f"kuberl-{release_ns[-6:]}"
    # The cluster has the RLJob's policy from crds/ (one per cluster): not this release's.
    helm(k8s_cluster, "install", release, str(CHART), "-n", release_ns, "--skip-crds",
         "--set", f"watchNamespaces={{{watched}}}", "--set", "validationPolicy.enabled=false",
         "--wait=false")
    try:
        wait_available(k8s_cluster, release_ns, release)
        sa = f"system:serviceaccount:{release_ns}:{release}"
        for verb, resource in OPERATOR_NEEDS:
            assert can_i(k8s_cluster, sa, verb, resource, watched), (verb, resource)
            assert not can_i(k8s_cluster, sa, verb, resource, other), (verb, resource, other)
        assert not can_i(k8s_cluster, sa, "list", "namespaces", watched)
    finally:
        helm(k8s_cluster, "uninstall", release, "-n", release_ns, check=False)
