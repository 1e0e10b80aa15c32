"""The job's NetworkPolicy as the operator renders it: it selects every pod the job runs (the
Ray head, each worker group, KubeRay's submitter, the environment service) and no pod of
another job; it admits the job's own pods and the configured peers, ingress only; it is off
when the operator's setting is, and for host-network jobs; the chart's settings reach it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kuberl_api import RLJob
from kuberl_operator.reconcile.children import adopt
from kuberl_operator.render import IngressPolicy, names, render_children
from kuberl_operator.render.network_policy import check_peers
from kuberl_operator.render.pod import SUBMITTER_CONTAINER
from kuberl_operator.settings import parse_args

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

# Every kind of pod a job can run: the GPU worker groups (training, rollout, a dedicated critic,
# a served reward model, whose engines the head calls) and the environment service.
FULL: Obj = {
    "placement": "disaggregated",
    "training": {"nodes": 2, "gpusPerNode": 8},
    "rollout": {"gpus": 8, "gpusPerEngine": 2, "maxTurns": 3},
    "environment": {"class": "envs.calc:Calculator", "image": "registry.example/calc:1"},
    "algorithm": {"advantageEstimator": "ppo"},
    "critic": {"placement": "dedicated"},
    "reward": {"type": "model", "model": {"path": "/models/rm", "replicas": 2}},
}
PROMETHEUS: Obj = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
OPERATOR: Obj = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberl"}}}


def policy_of(objs: list[Obj]) -> Obj:
    (found,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return found


def pod_templates(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    """(what, labels) of every pod template among the children."""
    for o in objs:
        if o["kind"] == "RayJob":
            cluster = o["spec"]["rayClusterSpec"]
            yield "head", cluster["headGroupSpec"]["template"]["metadata"]["labels"]
            for group in cluster["workerGroupSpecs"]:
                yield group["groupName"], group["template"]["metadata"]["labels"]
            yield "submitter", o["spec"]["submitterPodTemplate"]["metadata"]["labels"]
        elif o["kind"] == "Deployment":
            yield "environment", o["spec"]["template"]["metadata"]["labels"]


def matches(selector: Obj, labels: Obj) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # no expressions to evaluate here
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_it_selects_every_pod_of_the_job_and_none_of_another(make_rljob: MakeJob) -> None:
    objs = render_children(make_rljob(spec=FULL), 1)
    selector = policy_of(objs)["spec"]["podSelector"]
    assert selector == {"matchLabels": {names.LABEL_JOB: "demo"}}
    seen = {what for what, labels in pod_templates(objs) if matches(selector, labels)}
    assert seen == {"head", "train", "rollout", "critic", "reward", "submitter", "environment"}
    # Another job in the same namespace (its name a prefix of ours, the same labels besides):
    # none of its pods.
    other = render_children(make_rljob(spec=FULL, metadata={"name": "dem"}), 1)
    assert not [what for what, labels in pod_templates(other) if matches(selector, labels)]


def test_a_user_label_cannot_put_another_jobs_pods_under_it(make_rljob: MakeJob) -> None:
    sneaky = make_rljob(spec=FULL, metadata={"name": "other",
                                             "labels": {names.LABEL_JOB: "demo"}})
    selector = policy_of(render_children(make_rljob()))["spec"]["podSelector"]
    assert not [w for w, labels in pod_templates(render_children(sneaky)) if
                matches(selector, labels)]


def test_it_admits_the_job_and_the_configured_peers_ingress_only(make_rljob: MakeJob) -> None:
    ingress = IngressPolicy(allowed_from=(OPERATOR, PROMETHEUS))
    policy = policy_of(render_children(make_rljob(), 0, ingress))
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["name"] == "demo-netpol"
    assert policy["metadata"]["namespace"] == "team-a"
    assert "ownerReferences" not in policy["metadata"]  # the reconciler adopts it
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec  # egress untouched
    (rule,) = spec["ingress"]
    assert "ports" not in rule  # any port, for these peers only
    assert rule["from"] == [{"podSelector": {"matchLabels": {names.LABEL_JOB: "demo"}}},
                            OPERATOR, PROMETHEUS]
    # With no peers configured only the job's own pods get in.
    (alone,) = policy_of(render_children(make_rljob()))["spec"]["ingress"]
    assert alone["from"] == [{"podSelector": {"matchLabels": {names.LABEL_JOB: "demo"}}}]


def test_one_policy_for_every_attempt_applied_before_any_pod(make_rljob: MakeJob) -> None:
    job = make_rljob(spec=FULL)
    first, later = render_children(job, 0), render_children(job, 7)
    assert first[0]["kind"] == later[0]["kind"] == "NetworkPolicy"
    assert policy_of(first) == policy_of(later)
    assert names.LABEL_ATTEMPT not in policy_of(first)["metadata"]["labels"]


def test_owned_by_the_rljob(make_rljob: MakeJob) -> None:
    owner = {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
             "metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1"}}
    adopted = adopt(policy_of(render_children(make_rljob())), owner)
    assert adopted["metadata"]["ownerReferences"] == [
        {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "name": "demo", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}]


def test_none_when_off_or_on_the_host_network(make_rljob: MakeJob) -> None:
    off = render_children(make_rljob(spec=FULL), 0, IngressPolicy(enabled=False))
    assert "NetworkPolicy" not in [o["kind"] for o in off]
    host = make_rljob(spec={**FULL, "network": {"hostNetwork": True}})
    assert "NetworkPolicy" not in [o["kind"] for o in render_children(host)]


def test_the_submitter_is_kuberays_default_with_the_jobs_labels(make_rljob: MakeJob) -> None:
    job = make_rljob()
    rayjob = render_children(job)[-1]
    template = rayjob["spec"]["submitterPodTemplate"]
    assert template["metadata"]["labels"] == names.labels("demo", names.COMPONENT_SUBMITTER)
    spec = template["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    (box,) = spec["containers"]
    assert box["name"] == SUBMITTER_CONTAINER and box["image"] == job.spec.training.image
    assert "command" not in box  # KubeRay's `ray job submit`
    assert box["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}


def test_the_settings_reach_the_renderer(make_rljob: MakeJob) -> None:
    env = {"KUBERL_NETWORK_POLICY_PEERS": json.dumps([OPERATOR, PROMETHEUS])}
    config = parse_args([], env)
    (rule,) = policy_of(render_children(make_rljob(), 0, config.ingress))["spec"]["ingress"]
    assert rule["from"][1:] == [OPERATOR, PROMETHEUS]
    off = parse_args([], {**env, "KUBERL_NETWORK_POLICY": "false"})
    assert not off.ingress.enabled
    assert not parse_args(["--no-network-policy"], {}).ingress.enabled
    assert parse_args([], {}).ingress == IngressPolicy()  # on, the job's own pods only


@pytest.mark.parametrize("peers", ['{"podSelector": {}}', '[{"pods": {}}]', "[{}]", "[1]",
                                   "not json"])
def test_malformed_peers_stop_the_operator(peers: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--network-policy-peers", peers], {})


def test_check_peers_names_the_bad_one() -> None:
    with pytest.raises(ValueError, match=r"peer 1 .*podSelector"):
        check_peers([PROMETHEUS, {"selector": {}}])
