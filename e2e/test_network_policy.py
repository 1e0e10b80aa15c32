"""The job's NetworkPolicy on a real control plane: the operator (the chart's identity and its
rendered peers) makes one per RLJob, owned by it; the API server's own label selection with the
policy's podSelector finds the head pod KubeRay made and the submitter's pod, and not a pod of
another job in the namespace; the chart's peer for the operator selects the chart's operator
pod; the policy goes with the RLJob and the other job's stays.

No CNI runs here (kwok's pods run nothing), so what is tested is the object and what its
selectors select; that a CNI enforces a NetworkPolicy is Kubernetes' part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from rljobs import JobWatch, Operator, cpu_job, kubectl_apply, provisioned, selector_query

from kuberl_api.rljob import API_VERSION, KIND
from kuberl_operator.render import names

# kuberay: KubeRay makes the head and the submitter pods whose labels are checked (both versions).
pytestmark = [pytest.mark.e2e, pytest.mark.kuberay]


def policy_url(ns: str, job: str) -> str:
    return f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{names.network_policy(job)}"


def query(selector: Mapping[str, Any]) -> str:
    """A LabelSelector as a list query (this policy's selectors use matchLabels only)."""
    assert set(selector) <= {"matchLabels"}, selector
    labels: dict[str, str] = selector.get("matchLabels") or {}
    return str(selector_query(labels))


def pods(c: Cluster, ns: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = c.api().get(f"/api/v1/namespaces/{ns}/pods?"
                                              + query(selector))["items"]
    return items


def test_each_job_gets_a_policy_that_selects_its_pods_and_no_others(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    c, ns, api = k8s_cluster, operator_ns, k8s_cluster.api()
    mine, other = JobWatch(c, operator, ns, "np-mine"), JobWatch(c, operator, ns, "np-other")
    kubectl_apply(c, "\n---\n".join(json.dumps(cpu_job(w.job, ns)) for w in (mine, other)),
                  check=True)
    try:
        policy = wait_for("the NetworkPolicy", lambda: api.get(policy_url(ns, mine.job)),
                          timeout=60, detail=mine.detail)
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": mine.job,
               "uid": mine.get()["metadata"]["uid"], "controller": True,
               "blockOwnerDeletion": True}
        assert policy["metadata"]["ownerReferences"] == [ref]
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"] and not spec.get("egress")

        # KubeRay's pods of both jobs are up, and the submitter of ours has started.
        provisioned(mine, 0)
        other.wait_raycluster_ready(0)
        cluster = (mine.rayjob(0) or {})["status"]["rayClusterName"]
        selected = {p["metadata"]["name"] for p in pods(c, ns, spec["podSelector"])}
        (head,) = pods(c, ns, {"matchLabels": {"ray.io/cluster": cluster,
                                               "ray.io/node-type": "head"}})
        assert head["metadata"]["name"] in selected, (head["metadata"]["name"], selected)
        submitter = wait_for("the submitter's pod", lambda: pods(c, ns, {"matchLabels": {
            "batch.kubernetes.io/job-name": names.rayjob(mine.job, 0)}}), timeout=60)
        assert {p["metadata"]["name"] for p in submitter} <= selected, selected
        others = {p["metadata"]["name"] for p in pods(c, ns, {"matchLabels": {
            names.LABEL_JOB: other.job}})}
        assert others and not others & selected, (others, selected)
        assert all(p["metadata"]["labels"][names.LABEL_JOB] == mine.job
                   for p in pods(c, ns, spec["podSelector"]))

        # Who else gets in: the job's own pods, then the chart's peers; the operator's selects
        # the chart's operator pod (its namespace by the label the API server sets).
        (rule,) = spec["ingress"]
        assert rule["from"][0] == {"podSelector": spec["podSelector"]}
        ours = [p for p in rule["from"][1:] if "kubernetes.io/metadata.name" in (
            p.get("namespaceSelector") or {}).get("matchLabels", {})]
        assert len(ours) == 1, rule["from"]
        (peer,) = ours
        (in_ns,) = api.get("/api/v1/namespaces?" + query(peer["namespaceSelector"]))["items"]
        assert in_ns["metadata"]["name"] == ns
        chart_pods = pods(c, ns, {"matchLabels": {"app.kubernetes.io/instance":
                                                  Operator.RELEASE}})
        assert chart_pods and {p["metadata"]["name"] for p in chart_pods} == {
            p["metadata"]["name"] for p in pods(c, ns, peer["podSelector"])}
    finally:
        mine.delete_and_wait_gc()  # (CHILDREN includes the NetworkPolicy)
    assert api.get(policy_url(ns, mine.job)) is None
    try:
        assert api.get(policy_url(ns, other.job)) is not None  # the other job's is its own
    finally:
        other.delete_and_wait_gc()
