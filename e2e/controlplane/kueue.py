"""Kueue (optional): quota and admission for RayJobs through its ``ray.io/rayjob`` integration.

Its manager runs as the ServiceAccount kueue-system/kueue-controller-manager bound to Kueue's
own roles (``config/components/rbac/``: the manager's ClusterRole, its Role on Secrets in its
namespace, its metrics endpoint's ClusterRole; named as Kueue's kustomization names them, with
the prefix ``kueue-``), leader election off, with a Configuration file in the state dir.
Kueue's own certificate management is off: it names the certificates after the in-cluster
Service, and here the API server calls the webhooks at https://127.0.0.1:<port>. The cluster
CA signs a serving certificate for 127.0.0.1 instead, and Kueue's webhook configurations
(``config/components/webhook/manifests.yaml``) are registered pointing there, with that CA: the
webhooks of Kueue's own kinds and of the enabled integrations (the others would only reach
Kueue's no-op handlers). Kueue reads its metrics certificate from the fixed path
/etc/kueue/metrics/certs, where a Deployment mounts a Secret; here the manager runs in a mount
namespace of its own (``unshare``) whose /etc is an overlay holding that certificate, so the
machine's /etc is untouched."""

from __future__ import annotations

import json
import os
import shlex
import urllib.error
from typing import TYPE_CHECKING, Any

from . import serviceaccount
from .base import Component, http_ok
from .boot import Boot
from .pki import b64, serving_cert
from .versions import binaries_for

if TYPE_CHECKING:
    from .cluster import Cluster

NAMESPACE = "kueue-system"
SA = "kueue-controller-manager"
CLUSTER_ROLE = "kueue-manager-role"
PREFIX = "kueue-"  # Kueue's kustomization prefixes its objects' names with it
COMPONENT = Component("kueue", ("kueue-webhook", "kueue-metrics", "kueue-probe"),
                      lambda p: f"http://127.0.0.1:{p['kueue-probe']}/readyz")
# The integrations enabled, and the (group, plural) each one's webhooks admit.
INTEGRATIONS = {"ray.io/rayjob": ("ray.io", "rayjobs")}
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"


def _crd_names(boot: Boot) -> list[str]:
    names = []
    for path in boot.bins.kueue_crds:  # kueue.x-k8s.io_workloads.yaml: <group>_<plural>.yaml
        group, _, plural = path.stem.partition("_")
        names.append(f"{plural}.{group}")
    return names


def _established(crd: dict[str, Any] | None) -> bool:
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd or {}).get("status", {}).get("conditions", []))


def install_crds(boot: Boot) -> None:
    """Kueue's CRDs, Established (skipped when they are: e.g. given to Cluster.start)."""
    api = boot.cluster.api()
    names = _crd_names(boot)
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
    if all(_established(api.get(path + n)) for n in names):
        return
    boot.apply(*boot.bins.kueue_crds)
    boot.cluster.kubectl("wait", "--for=condition=Established",
                         f"--timeout={int(boot.left())}s", *[f"crd/{n}" for n in names],
                         timeout=boot.left())


def _rbac(boot: Boot) -> str:
    """Kueue's ClusterRole, its Role on Secrets in its namespace and its metrics ClusterRole,
    named and placed as Kueue's kustomization does (prefix kueue-, namespace kueue-system)."""
    docs = [f.read_text() for f in boot.bins.kueue_rbac]
    text = "\n---\n".join(docs).replace("namespace: system", f"namespace: {NAMESPACE}")
    for name in ("manager-role", "manager-secrets-role", "metrics-auth-role"):
        text = text.replace(f"name: {name}\n", f"name: {PREFIX}{name}\n")
    return text


def prepare(boot: Boot) -> None:
    """Kueue's roles and the ServiceAccount bound to them."""
    serviceaccount.bind(boot, NAMESPACE, SA, CLUSTER_ROLE)
    boot.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                         input=_rbac(boot), timeout=boot.left())
    api, rbac = boot.cluster.api(), "/apis/rbac.authorization.k8s.io/v1"
    subject = [{"kind": "ServiceAccount", "name": SA, "namespace": NAMESPACE}]
    api.create(f"{rbac}/namespaces/{NAMESPACE}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": f"{PREFIX}manager-secrets-rolebinding", "namespace": NAMESPACE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": f"{PREFIX}manager-secrets-role"}, "subjects": subject})
    api.create(f"{rbac}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{PREFIX}metrics-auth-rolebinding"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": f"{PREFIX}metrics-auth-role"}, "subjects": subject})


def configuration(boot: Boot) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for this cluster."""
    p, pki = boot.cluster.ports, boot.cluster.state_dir / "pki"
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{p['kueue-probe']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{p['kueue-metrics']}"},
        "webhook": {"host": "127.0.0.1", "port": p["kueue-webhook"],
                    "certDir": str(pki / "kueue-webhook")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": sorted(INTEGRATIONS)},
        # The visibility API is served through the aggregation layer (an APIService this
        # cluster doesn't register); off, it doesn't bind its fixed port either.
        "featureGates": {"VisibilityOnDemand": False},
    }


def _in_mount_namespace(boot: Boot, argv: list[str]) -> list[str]:
    """argv run in a private mount namespace whose /etc is an overlay (on a tmpfs) of the
    real one plus Kueue's metrics certificate at METRICS_CERT_DIR."""
    d = boot.cluster.state_dir / "kueue-mounts"
    d.mkdir(exist_ok=True)
    certs = serving_cert(boot.cluster.state_dir / "pki", boot.cluster.state_dir / "pki" /
                         "kueue-metrics", "kueue-metrics")
    q = shlex.quote
    script = (f"mount -t tmpfs tmpfs {q(str(d))} && mkdir {q(str(d / 'up'))} "
              f"{q(str(d / 'work'))} && mount -t overlay overlay -o lowerdir=/etc,"
              f"upperdir={q(str(d / 'up'))},workdir={q(str(d / 'work'))} /etc && "
              f"mkdir -p {METRICS_CERT_DIR} && cp {q(str(certs))}/tls.crt "
              f"{q(str(certs))}/tls.key {METRICS_CERT_DIR}/ && exec \"$@\"")
    userns = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", "--mount", "--propagation", "private", *userns,
            "sh", "-c", script, "kueue-mounts", *argv]


def start(boot: Boot) -> None:
    """The manager, ready, and its webhooks registered and answering."""
    c = boot.cluster
    serving_cert(c.state_dir / "pki", c.state_dir / "pki" / "kueue-webhook", "kueue-webhook")
    cfg_file = c.state_dir / "kueue-config.yaml"
    cfg_file.write_text(json.dumps(configuration(boot), indent=2) + "\n")
    kubeconfig = serviceaccount.kubeconfig(boot, NAMESPACE, SA)
    boot.spawn("kueue", _in_mount_namespace(boot, [boot.bin("kueue"), f"--config={cfg_file}"]),
               env={"KUBECONFIG": str(kubeconfig)})
    url = f"http://127.0.0.1:{c.ports['kueue-probe']}/readyz"
    boot.wait_for("kueue", "/readyz", lambda: http_ok(url))
    register_webhooks(boot)
    boot.wait_for("kueue", "its RayJob webhook refusing a bad RayJob",
                  lambda: _webhook_refuses(c))


def _webhook_refuses(c: Cluster) -> bool:
    """A dry-run create of a queued RayJob that Kueue's validating webhook must refuse (it keeps
    its cluster after finishing) is refused by it: the API server calls the webhooks (it
    picks their configurations up asynchronously) and they answer."""
    job = {"apiVersion": "ray.io/v1", "kind": "RayJob",
           "metadata": {"name": "kueue-webhook-probe", "namespace": "default",
                        "labels": {"kueue.x-k8s.io/queue-name": "none"}},
           "spec": {"suspend": True, "shutdownAfterJobFinishes": False,
                    "rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}, "template": {
                        "spec": {"containers": [{"name": "ray-head", "image": "none"}]}}}}}}
    try:
        c.api().request("POST", "/apis/ray.io/v1/namespaces/default/rayjobs?dryRun=All", job)
    except urllib.error.HTTPError as e:
        return "a kueue managed job should delete the cluster" in e.read().decode(errors="replace")
    return False


def _wanted(webhook: dict[str, Any]) -> bool:
    enabled = set(INTEGRATIONS.values())
    for rule in webhook.get("rules", []):
        for group in rule.get("apiGroups", []):
            if group != "kueue.x-k8s.io" and not any(
                    (group, r) in enabled for r in rule.get("resources", [])):
                return False
    return True


def _json_stream(text: str) -> list[dict[str, Any]]:
    """kubectl -o json of a multi-document file: one JSON object after another."""
    out, decoder, i = [], json.JSONDecoder(), 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def webhook_configurations(cluster: Cluster) -> list[dict[str, Any]]:
    """Kueue's Mutating/ValidatingWebhookConfiguration, pointed at 127.0.0.1."""
    src = binaries_for(cluster.versions).kueue_webhooks
    text = cluster.kubectl("create", "--dry-run=client", "-o", "json", "-f", str(src)).stdout
    ca = b64(cluster.state_dir / "pki" / "ca.crt")
    base = f"https://127.0.0.1:{cluster.ports['kueue-webhook']}"
    out = []
    for obj in _json_stream(text):
        obj["metadata"] = {"name": PREFIX + obj["metadata"]["name"]}
        obj["webhooks"] = [w for w in obj["webhooks"] if _wanted(w)]
        for w in obj["webhooks"]:
            w["clientConfig"] = {"url": base + w["clientConfig"]["service"]["path"],
                                 "caBundle": ca}
        out.append(obj)
    return out


def register_webhooks(boot: Boot) -> None:
    for obj in webhook_configurations(boot.cluster):
        boot.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                             input=json.dumps(obj), timeout=boot.left())


def unregister_webhooks(cluster: Cluster) -> None:
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        cluster.kubectl("delete", kind, f"{PREFIX}{kind.removesuffix('webhookconfiguration')}"
                        "-webhook-configuration", "--ignore-not-found", check=False)
