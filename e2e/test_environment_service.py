"""environment.image on a real control plane: the operator (with the chart's identity) runs
the environment as a Deployment and a headless Service owned by the RLJob; the Deployment's
controller makes the pods, the scheduler puts them on the pool the spec names, the endpoint
controller lists the ready ones behind the Service (the addresses the head resolves), the
head is told the Service's URL; a suspended job's service is deleted and a resumed one's
comes back, and everything goes with the RLJob (the garbage collector). A malformed
environment section is refused at apply.

kwok's pods run nothing, so readiness is kwok's word, not /health's; what the probe and the
server do is the unit and integration tiers' (test_environment_service.py, test_agents.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from rljobs import JobWatch, Operator, cpu_job, kubectl_apply, selector_query

from kuberl_api import runtime
from kuberl_api.rljob import API_VERSION, KIND
from kuberl_env import protocol
from kuberl_operator.render import names

pytestmark = pytest.mark.e2e

ENVIRONMENT = {"class": "envs.calc:Calculator", "image": "registry.example/calc:1",
               "args": {"level": "2"}, "replicas": 2, "timeoutSeconds": 30,
               "resources": {"cpu": "1", "memory": "1Gi"}, "env": {"LEVEL": "2"},
               "nodePool": {"nodeSelector": {"pool": "cpu"}}}


def deployments(ns: str) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/deployments"


def services(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/services"


def ready_addresses(c: Cluster, ns: str, service: str) -> list[str]:
    """The ready endpoints behind `service` (its EndpointSlices): what its name resolves to."""
    slices = c.api().get(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?"
                         + selector_query({"kubernetes.io/service-name": service}))["items"]
    return sorted(a for s in slices for e in s.get("endpoints") or []
                  if (e.get("conditions") or {}).get("ready") for a in e["addresses"])


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_the_environment_runs_as_a_service_owned_by_the_rljob(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    c, ns, job = k8s_cluster, operator_ns, "env-service"
    api = c.api()
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, environment=ENVIRONMENT, rollout={
        "engine": "reference", "gpus": 0, "maxTurns": 3}), check=True)
    name = names.environment(job)
    try:
        w.wait_condition("Accepted", "True", timeout=60)
        owner = w.get()
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": job,
               "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        dep = wait_for(f"Deployment {name}", partial(api.get, f"{deployments(ns)}/{name}"),
                       timeout=30, detail=w.detail)
        svc = wait_for(f"Service {name}", partial(api.get, f"{services(ns)}/{name}"),
                       timeout=30, detail=w.detail)
        for child in (dep, svc):
            assert child["metadata"]["ownerReferences"] == [ref], child["metadata"]
            assert child["metadata"]["labels"][names.LABEL_JOB] == job
        assert svc["spec"]["clusterIP"] == "None"
        (box,) = dep["spec"]["template"]["spec"]["containers"]
        assert box["command"][:4] == ["python", "-m", "kuberl_env", ENVIRONMENT["class"]]
        probe = box["readinessProbe"]["httpGet"]
        assert probe["path"] == protocol.HEALTH and probe["port"] == protocol.PORT_NAME
        assert env_of(box) == {"LEVEL": "2"}

        # The head of the attempt is told where the service is.
        rayjob = wait_for("the RayJob", lambda: w.rayjob(0), timeout=30, detail=w.detail)
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        assert env_of(head["containers"][0])[runtime.ENV_ENVIRONMENT_URL] == (
            f"http://{name}:{protocol.DEFAULT_PORT}")

        # The cluster's controllers run it: two pods on the cpu pool, both behind the
        # Service once ready.
        pods_url = f"/api/v1/namespaces/{ns}/pods?" + selector_query(
            names.environment_selector(job))

        def running() -> list[dict[str, Any]]:
            pods = api.get(pods_url)["items"]
            ok = [p for p in pods if p["status"].get("phase") == "Running"
                  and p["spec"].get("nodeName")]
            return ok if len(ok) == 2 else []

        pods = wait_for("2 environment pods Running", running, timeout=60,
                        detail=lambda: str(api.get(pods_url)["items"]))
        pools = {api.get(f"/api/v1/nodes/{p['spec']['nodeName']}")["metadata"]["labels"]["pool"]
                 for p in pods}
        assert pools == {"cpu"}, pools
        wait_for("the Deployment's 2 replicas ready", lambda: (api.get(
            f"{deployments(ns)}/{name}") or {}).get("status", {}).get("readyReplicas") == 2,
            timeout=60)
        addresses = wait_for("2 ready addresses behind the Service",
                             lambda: len(found := ready_addresses(c, ns, name)) == 2 and found,
                             timeout=60, detail=lambda: str(ready_addresses(c, ns, name)))
        assert sorted(addresses) == sorted(p["status"]["podIP"] for p in pods)

        # Suspended, nothing calls it: it goes (the RLJob stays); resumed, it comes back with
        # the new attempt.
        c.kubectl("patch", "rljob", job, "-n", ns, "--type=merge",
                  "-p", '{"spec": {"suspend": true}}')
        wait_for("the environment service deleted while suspended", lambda: api.get(
            f"{deployments(ns)}/{name}") is None and api.get(f"{services(ns)}/{name}") is None,
            timeout=60, detail=w.detail)
        assert w.status()["phase"] == "Suspended"
        c.kubectl("patch", "rljob", job, "-n", ns, "--type=merge",
                  "-p", '{"spec": {"suspend": false}}')
        wait_for("the environment service back with attempt 1", lambda: w.rayjob(1) and api.get(
            f"{deployments(ns)}/{name}") and api.get(f"{services(ns)}/{name}"), timeout=60,
            detail=w.detail)
    finally:
        w.delete_and_wait_gc()  # (its leftovers include every pod with the job's label)
    for url in (f"{deployments(ns)}/{name}", f"{services(ns)}/{name}"):
        wait_for(f"{url} garbage-collected", lambda u=url: api.get(u) is None, timeout=60)


@pytest.mark.parametrize("environment, message", [
    ({"image": "registry.example/calc:1"}, "image needs class"),
    ({"class": "envs.calc:Calculator", "replicas": 2}, "replicas applies only with image"),
])
def test_a_malformed_environment_is_refused_at_apply(
        k8s_cluster: Cluster, operator_ns: str, environment: dict[str, Any],
        message: str) -> None:
    proc = kubectl_apply(k8s_cluster, cpu_job("env-malformed", operator_ns,
                                              environment=environment))
    assert proc.returncode != 0 and message in proc.stderr, (proc.stdout, proc.stderr)
    assert k8s_cluster.api().get(f"{deployments(operator_ns)}/env-malformed-env") is None
