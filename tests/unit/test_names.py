"""Every name and label the operator creates is valid for the longest RLJob name the CRD admits
and the highest attempt, so no job is accepted that then can't be run."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kuberl_api import RLJob
from kuberl_operator.render import names, render_children

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?=[a-z0-9]))*$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")

LAST_ATTEMPT = names.MAX_ATTEMPTS - 1
# KubeRay (v1.5, utils/constant.go): RayCluster names <= 53, RayJob names <= 53 - 6, because a
# RayJob's cluster is named "<rayjob>-<5 random characters>".
MAX_RAYCLUSTER_NAME = 53


def is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not all(
            DNS1123_LABEL.match(p) for p in prefix.split("."))):
        return False
    return len(name) <= 63 and bool(LABEL_NAME_PART.match(name))


def label_ok(value: str) -> bool:
    return len(value) <= 63 and bool(LABEL_VALUE.match(value))


@pytest.fixture
def longest(make_rljob: MakeJob) -> RLJob:
    """Longest name, every worker group, every optional piece switched on."""
    return make_rljob(
        metadata={"name": names.longest_job_name(), "namespace": "n" * 63},
        spec={
            "placement": "disaggregated",
            "training": {"nodes": 2},
            "rollout": {"gpus": 8},
            "checkpoint": {"pvc": "c" * 253},
            "model": {"path": "/m/x", "storage": {"pvc": "m" * 253, "mountPath": "/m"}},
            "data": {"prompts": "/d/x", "storage": {"pvc": "d" * 253, "mountPath": "/d"}},
            "algorithm": {"advantageEstimator": "ppo"},
            "critic": {"placement": "dedicated"},
            "reward": {"type": "model", "model": {
                "path": "/r/x", "storage": {"pvc": "r" * 253, "mountPath": "/r"}}},
            "network": {"hostNetwork": True, "ncclSocketIfname": "eth0",
                        "rdma": {"resource": "rdma/hca", "count": 1}},
        },
    )


def templates(rayjob: Obj) -> Iterator[Obj]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    yield cluster["headGroupSpec"]["template"]
    for g in cluster["workerGroupSpecs"]:
        yield g["template"]


def all_labels(objs: list[Obj]) -> Iterator[dict[str, str]]:
    for o in objs:
        yield o["metadata"]["labels"]
        if o["kind"] == "RayJob":
            for t in templates(o):
                yield t["metadata"]["labels"]
                for term in t["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
                        "requiredDuringSchedulingIgnoredDuringExecution", []):
                    yield term["labelSelector"]["matchLabels"]


def test_longest_name_is_the_crd_maximum() -> None:
    from kuberl_api.rljob import MAX_NAME_LENGTH
    assert len(names.longest_job_name()) == MAX_NAME_LENGTH


def test_object_names_fit_for_the_longest_job_and_last_attempt(longest: RLJob) -> None:
    for o in render_children(longest, LAST_ATTEMPT):
        name = o["metadata"]["name"]
        assert len(name) <= 63, (o["kind"], name)
        assert DNS1123_LABEL.match(name), (o["kind"], name)


def test_rayjob_name_within_kuberays_limits(longest: RLJob) -> None:
    rayjob = render_children(longest, LAST_ATTEMPT)[-1]
    name = rayjob["metadata"]["name"]
    assert len(name) <= names.MAX_RAYJOB_NAME == MAX_RAYCLUSTER_NAME - 6
    assert DNS1035_LABEL.match(name)  # KubeRay validates RayJob names as DNS-1035 labels
    assert len(f"{name}-abcde") <= MAX_RAYCLUSTER_NAME


def test_referenced_names_fit(longest: RLJob) -> None:
    """Names the pods refer to (ServiceAccount, ConfigMap, volumes, containers, ports,
    groups) are valid too."""
    rayjob = render_children(longest, LAST_ATTEMPT)[-1]
    for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert DNS1123_LABEL.match(g["groupName"]) and len(g["groupName"]) <= 63
    for t in templates(rayjob):
        spec = t["spec"]
        if "serviceAccountName" in spec:
            assert DNS1123_LABEL.match(spec["serviceAccountName"])
        for v in spec["volumes"]:
            assert DNS1123_LABEL.match(v["name"]) and len(v["name"]) <= 63
            if "configMap" in v:
                assert DNS1123_LABEL.match(v["configMap"]["name"])
        for c in spec["containers"]:
            assert DNS1123_LABEL.match(c["name"]) and len(c["name"]) <= 63
            for p in c.get("ports", []):
                assert len(p["name"]) <= 15 and IANA_SVC_NAME.match(p["name"])
            for e in c["env"]:
                assert ENV_NAME.match(e["name"])


def test_label_keys_and_values_valid(longest: RLJob) -> None:
    for labels in all_labels(render_children(longest, LAST_ATTEMPT)):
        for key, value in labels.items():
            assert is_label_key(key), key
            assert label_ok(value), (key, value)


def test_user_labels_pass_through_valid(make_rljob: MakeJob) -> None:
    job = make_rljob(metadata={"labels": {"example.com/team": "rl", "cost-center": "x" * 63}})
    for labels in all_labels(render_children(job)):
        for key, value in labels.items():
            assert is_label_key(key) and label_ok(value)


def test_configmap_key_is_valid() -> None:
    assert CONFIG_KEY.match(names.CONFIG_KEY) and len(names.CONFIG_KEY) <= 253


def test_attempt_range_is_enforced() -> None:
    assert names.rayjob("a", 0) == "a-r0"
    assert names.rayjob("a", LAST_ATTEMPT) == f"a-r{LAST_ATTEMPT}"
    for bad in (-1, names.MAX_ATTEMPTS):
        with pytest.raises(ValueError):
            names.rayjob("a", bad)


def test_max_attempts_covers_backoff_limit() -> None:
    """attempt n is the n-th restart; backoffLimit (<= 99 in the model) restarts must fit."""
    from kuberl_api.spec import RLJobSpec
    le = [m.le for m in RLJobSpec.model_fields["backoff_limit"].metadata if hasattr(m, "le")]
    assert le and le[0] <= LAST_ATTEMPT


def test_names_are_distinct(longest: RLJob) -> None:
    seen = {(o["kind"], o["metadata"]["name"]) for o in render_children(longest)}
    assert len(seen) == 6


def test_merged_labels_owned_win_and_order_is_stable() -> None:
    owned = names.labels("j", names.COMPONENT_CONFIG)
    merged = names.merged_labels(owned, {"z": "1", names.LABEL_JOB: "x", "a": "2",
                                         names.LABEL_ATTEMPT: "3"})
    assert merged == {**owned, "a": "2", "z": "1"}
    assert list(merged) == [*owned, "a", "z"]


def test_pod_labels_match_the_job_selector() -> None:
    for group in (names.GROUP_HEAD, names.GROUP_TRAIN, names.GROUP_ROLLOUT, names.GROUP_CRITIC,
                  names.GROUP_REWARD):
        labels = names.pod_labels("j", group, 0)
        assert names.selector("j").items() <= labels.items()
        assert labels[names.LABEL_GROUP] == group


@pytest.mark.parametrize(("rayjob", "job"), [
    ("grpo-r0", "grpo"),
    ("my-run-r12", "my-run"),
    ("a-r-b-r3", "a-r-b"),
    (f"grpo-r{names.MAX_ATTEMPTS}", None),  # beyond the attempts a job may have
    ("grpo-r", None),
    ("grpo-rx", None),
    ("grpo", None),
    ("-r1", None),
    ("grpo-r01", None),  # not a name `rayjob` makes
])
def test_job_of_rayjob(rayjob: str, job: str | None) -> None:
    """A Kueue Workload names its RayJob: the RLJob to reconcile is read back from that name."""
    assert names.job_of_rayjob(rayjob) == job
    if job is not None:
        assert names.rayjob(job, int(rayjob.rsplit("-r", 1)[1])) == rayjob
