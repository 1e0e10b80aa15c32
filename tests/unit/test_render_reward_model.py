"""A reward model the job serves (reward.type model) as the operator renders it: a Ray worker
group of its own in every mode and placement, `replicas` pods of `gpusPerReplica` GPUs that
advertise the reward resource the trainer's engine actors ask for, on its own image, pool and
resources, with what every engine pod gets; its PVC mounted in every Ray pod, once where
another section names the same storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from kuberl_api import RLJob, loads, runtime
from kuberl_operator.render import names, render_children
from kuberl_operator.render.pod import GPU_RESOURCE, VOLUME_MODEL, VOLUME_REWARD_MODEL

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

RM_POOL = {"nodeSelector": {"pool": "l4"},
           "tolerations": [{"key": "dedicated", "value": "reward", "effect": "NoSchedule"}]}
REWARD: Obj = {"type": "model", "model": {
    "path": "/mnt/rm/skywork", "storage": {"pvc": "reward-models", "mountPath": "/mnt/rm"},
    "replicas": 2, "gpusPerReplica": 1, "image": "registry.example/sglang:1",
    "nodePool": RM_POOL, "resources": {"cpu": "8", "memory": "64Gi"}}}
ON_CPU: Obj = {"training": {"backend": "fsdp", "gpusPerNode": 0},
               "rollout": {"engine": "reference"}}
DISAGG: Obj = {"placement": "disaggregated", "training": {"nodes": 1, "gpusPerNode": 8},
               "rollout": {"gpus": 8, "gpusPerEngine": 2}}


def rayjob(job: RLJob) -> Obj:
    (found,) = [o for o in render_children(job) if o["kind"] == "RayJob"]
    return found


def groups(job: RLJob) -> dict[str, Obj]:
    return {g["groupName"]: g for g in rayjob(job)["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def pods(job: RLJob) -> dict[str, Obj]:
    """group -> pod spec, the head's as "head"."""
    cluster = rayjob(job)["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"]["spec"],
            **{name: g["template"]["spec"] for name, g in groups(job).items()}}


def container(pod: Obj) -> Obj:
    return pod["containers"][0]


def env(pod: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod)["env"]}


def mounts(pod: Obj) -> dict[str, Obj]:
    return {m["mountPath"]: m for m in container(pod)["volumeMounts"]}


def volumes(pod: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in pod["volumes"]}


def test_the_reward_group_is_replicas_pods_of_its_gpus(make_rljob: MakeJob) -> None:
    g = groups(make_rljob(spec={**DISAGG, "reward": REWARD}))
    assert list(g) == [names.GROUP_TRAIN, names.GROUP_ROLLOUT, names.GROUP_REWARD]
    reward = g[names.GROUP_REWARD]
    assert reward["replicas"] == reward["minReplicas"] == reward["maxReplicas"] == 2
    # one engine per pod: the pod offers as many units as the engine actor asks for
    assert reward["resources"] == {names.RESOURCE_REWARD: "1"}
    assert reward["rayStartParams"] == {}  # KubeRay refuses resources in both places
    pod = reward["template"]["spec"]
    c = container(pod)
    assert c["image"] == "registry.example/sglang:1"
    assert c["resources"]["requests"] == c["resources"]["limits"] == {
        "cpu": "8", "memory": "64Gi", GPU_RESOURCE: "1"}
    assert pod["nodeSelector"] == {"pool": "l4"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "reward", "effect": "NoSchedule"}]
    # The other groups' resources are untouched: no engine of the policy lands here.
    assert names.RESOURCE_REWARD not in {k for n, grp in g.items() if n != names.GROUP_REWARD
                                         for k in grp["resources"]}


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_a_wider_reward_model_takes_its_gpus_on_one_pod(make_rljob: MakeJob, gpus: int) -> None:
    reward = {**REWARD, "model": {**REWARD["model"], "gpusPerReplica": gpus, "replicas": 3}}
    g = groups(make_rljob(spec={**DISAGG, "reward": reward}))[names.GROUP_REWARD]
    assert g["replicas"] == 3
    assert g["resources"] == {names.RESOURCE_REWARD: str(gpus)}
    assert container(g["template"]["spec"])["resources"]["limits"][GPU_RESOURCE] == str(gpus)


def test_on_cpu_one_unit_per_pod_and_no_gpu(make_rljob: MakeJob) -> None:
    reward = {"type": "model", "model": {"path": "/models/rm", "engine": "reference",
                                         "gpusPerReplica": 0, "replicas": 2}}
    job = make_rljob(spec={**ON_CPU, "reward": reward})
    g = groups(job)[names.GROUP_REWARD]
    assert g["replicas"] == 2 and g["resources"] == {names.RESOURCE_REWARD: "1"}
    pod = g["template"]["spec"]
    assert GPU_RESOURCE not in str(container(pod)["resources"])
    assert "affinity" not in pod and "hostNetwork" not in pod


def test_every_mode_and_placement_gives_it_pods_of_its_own(make_rljob: MakeJob) -> None:
    """Colocated engines share the training GPUs; a reward model never does (nothing trains
    it), and mode eval grades its sets with it, so it keeps its pods even there."""
    evaluate = {"mode": "eval", "data": {"prompts": None,
                                         "evalSets": [{"name": "held", "path": "/d/e.jsonl"}]}}
    for spec in ({}, DISAGG, {**DISAGG, "mode": "async"}, {**DISAGG, **evaluate}, evaluate):
        g = groups(make_rljob(spec={**spec, "reward": REWARD}))
        assert g[names.GROUP_REWARD]["replicas"] == 2, spec
        assert g[names.GROUP_REWARD]["resources"] == {names.RESOURCE_REWARD: "1"}, spec
    colocated = groups(make_rljob(spec={"reward": REWARD}))
    assert list(colocated) == [names.GROUP_TRAIN, names.GROUP_REWARD]
    assert names.RESOURCE_REWARD not in colocated[names.GROUP_TRAIN]["resources"]
    assert list(groups(make_rljob(spec={**DISAGG, **evaluate, "reward": REWARD}))) == [
        names.GROUP_ROLLOUT, names.GROUP_REWARD]


@pytest.mark.parametrize("reward", [{"type": "math"}, {"type": "remote",
                                                       "url": "http://rm:8000/score"}])
def test_no_reward_group_unless_the_job_serves_one(make_rljob: MakeJob, reward: Obj) -> None:
    assert names.GROUP_REWARD not in groups(make_rljob(spec={**DISAGG, "reward": reward}))


def test_its_pods_get_what_an_engine_pod_gets(make_rljob: MakeJob) -> None:
    """The same identity, engine API key (the engines check it, the head sends it) and NCCL
    settings (its tensor parallelism) as the rollout engines' pods; no API token; no
    checkpoint, preStop hook or grace period (it holds no state)."""
    job = make_rljob(spec={**DISAGG, "reward": REWARD,
                           "network": {"ncclSocketIfname": "eth0", "env": {"NCCL_DEBUG": "WARN"}}},
                     metadata={"labels": {"team": "a"}})
    p = pods(job)
    reward, rollout = p[names.GROUP_REWARD], p[names.GROUP_ROLLOUT]
    assert env(reward) == env(rollout)
    assert env(reward)[names.ENV_ENGINE_API_KEY] == {"secretKeyRef": {
        "name": names.engine_key_secret("demo", 0), "key": names.ENGINE_API_KEY_SECRET_KEY}}
    assert env(reward)["NCCL_SOCKET_IFNAME"] == "eth0"
    assert reward["automountServiceAccountToken"] is False
    assert reward["restartPolicy"] == "Never"
    for absent in ("lifecycle", "ports"):
        assert absent not in container(reward)
    assert "terminationGracePeriodSeconds" not in reward
    assert job.spec.checkpoint.path not in mounts(reward)
    labels = groups(job)[names.GROUP_REWARD]["template"]["metadata"]["labels"]
    assert labels == names.pod_labels("demo", names.GROUP_REWARD, 0)
    assert labels[names.LABEL_COMPONENT] == names.COMPONENT_WORKER


def test_engine_sized_pods_may_share_a_node_except_on_the_host_network(
        make_rljob: MakeJob) -> None:
    """Two 1-GPU reward pods fit one 8-GPU node (no anti-affinity); on the host network they
    would fight over Ray's fixed ports, so there each takes a node of its own."""
    assert "affinity" not in pods(make_rljob(spec={**DISAGG, "reward": REWARD}))["reward"]
    host = make_rljob(spec={**DISAGG, "reward": REWARD, "network": {
        "hostNetwork": True, "rdma": {"resource": "rdma/hca", "count": 1}}})
    pod = pods(host)[names.GROUP_REWARD]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == {names.LABEL_JOB: "demo",
                                                    names.LABEL_COMPONENT: names.COMPONENT_WORKER}
    # RDMA as on every GPU pod of the job (the network section's promise)
    assert container(pod)["resources"]["limits"]["rdma/hca"] == "1"
    assert container(pod)["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}


def test_its_pvc_is_mounted_in_every_ray_pod(make_rljob: MakeJob) -> None:
    """The head reads its tokenizer, its engines its weights; mounted as model.storage is."""
    job = make_rljob(spec={**DISAGG, "reward": REWARD, "algorithm": {
        "advantageEstimator": "ppo"}, "critic": {"placement": "dedicated"}})
    p = pods(job)
    assert set(p) == {"head", "train", "rollout", "critic", "reward"}
    for group, pod in p.items():
        assert mounts(pod)["/mnt/rm"] == {"name": VOLUME_REWARD_MODEL, "mountPath": "/mnt/rm",
                                          "readOnly": True}, group
        assert volumes(pod)[VOLUME_REWARD_MODEL]["persistentVolumeClaim"] == {
            "claimName": "reward-models", "readOnly": True}, group
    writable = {**REWARD, "model": {**REWARD["model"], "storage": {
        "pvc": "reward-models", "mountPath": "/mnt/rm", "subPath": "v2", "readOnly": False}}}
    pod = pods(make_rljob(spec={**DISAGG, "reward": writable}))[names.GROUP_REWARD]
    assert mounts(pod)["/mnt/rm"] == {"name": VOLUME_REWARD_MODEL, "mountPath": "/mnt/rm",
                                      "subPath": "v2"}
    assert pod["securityContext"]["fsGroup"] == 1000  # a claim it may write to


def test_a_reward_model_on_the_policys_pvc_is_mounted_once(make_rljob: MakeJob) -> None:
    shared = {"pvc": "models", "mountPath": "/mnt/m"}
    job = make_rljob(spec={
        **DISAGG, "model": {"path": "/mnt/m/qwen", "storage": shared},
        "data": {"prompts": "/mnt/m/p.jsonl", "storage": shared},
        "reward": {**REWARD, "model": {**REWARD["model"], "path": "/mnt/m/skywork",
                                       "storage": shared}}})
    for group, pod in pods(job).items():
        at = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == "/mnt/m"]
        assert at == [{"name": VOLUME_MODEL, "mountPath": "/mnt/m", "readOnly": True}], group
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert [v["name"] for v in claims] == [VOLUME_MODEL], group
        assert {m["name"] for m in container(pod)["volumeMounts"]} <= set(volumes(pod)), group


def test_the_head_reads_reward_model_from_the_configmap(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={**DISAGG, "reward": REWARD})
    (cm,) = [o for o in render_children(job) if o["kind"] == "ConfigMap"]
    doc = yaml.safe_load(cm["data"][names.CONFIG_KEY])
    assert doc["spec"]["reward"]["model"]["gpusPerReplica"] == 1
    back = loads(cm["data"][names.CONFIG_KEY]).spec.reward.model
    assert back is not None and back == job.spec.reward.model
    assert back.tokenizer_path == "/mnt/rm/skywork"


def test_reward_auth_reaches_the_head_from_its_secret(make_rljob: MakeJob) -> None:
    """reward.auth (type remote): the head, where the loop grades, reads the credential from
    the Secret the spec names; no other pod gets it, nor does the ConfigMap hold it."""
    auth = {"type": "remote", "url": "https://grader.example/score",
            "auth": {"secret": "grader", "key": "api-token", "header": "X-API-Key"}}
    job = make_rljob(spec={**DISAGG, "reward": auth})
    every = pods(job)
    assert env(every["head"])[runtime.ENV_REWARD_AUTH] == {
        "secretKeyRef": {"name": "grader", "key": "api-token"}}
    assert all(runtime.ENV_REWARD_AUTH not in env(p) for g, p in every.items() if g != "head")
    assert runtime.ENV_REWARD_AUTH not in env(pods(make_rljob(spec=DISAGG))["head"])
