"""What a user relies on in the rendered objects, asserted directly (the goldens show all of it;
these say which parts are promises)."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl_api import InvalidRLJob, RLJob, load, loads
from kuberl_operator.render import names, render_children
from kuberl_operator.render.nccl import SHM_PATH, SHM_VOLUME
from kuberl_operator.render.pod import GPU_RESOURCE
from kuberl_operator.render.rayjob import ENTRYPOINT

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
GPU_POOL = {"nodeSelector": {"pool": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}]}
ROLLOUT_POOL = {"nodeSelector": {"pool": "l40s"},
                "tolerations": [{"key": "dedicated", "value": "rollout",
                                 "effect": "NoSchedule"}]}
DISAGG: Obj = {
    "placement": "disaggregated",
    "training": {"nodes": 2, "gpusPerNode": 8, "nodePool": GPU_POOL,
                 "resources": {"cpu": "32", "memory": "256Gi"}},
    "rollout": {"gpus": 8, "gpusPerEngine": 2, "nodePool": ROLLOUT_POOL,
                "resources": {"memory": "128Gi"}},
}


# --- helpers -------------------------------------------------------------------------------

def by_kind(objs: list[Obj]) -> dict[str, Obj]:
    return {o["kind"]: o for o in objs}


def rayjob_of(job: RLJob, attempt: int = 0) -> Obj:
    return by_kind(render_children(job, attempt))["RayJob"]


def groups(job: RLJob) -> dict[str, Obj]:
    cluster = rayjob_of(job)["spec"]["rayClusterSpec"]
    return {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def head(job: RLJob) -> Obj:
    return rayjob_of(job)["spec"]["rayClusterSpec"]["headGroupSpec"]


def pods(job: RLJob) -> dict[str, Obj]:
    """group -> pod spec (head included as "head")."""
    out = {"head": head(job)["template"]["spec"]}
    out.update({name: g["template"]["spec"] for name, g in groups(job).items()})
    return out


def container(pod: Obj) -> Obj:
    return pod["containers"][0]


def env(pod: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod)["env"]}


def mounts(pod: Obj) -> dict[str, Obj]:
    return {m["mountPath"]: m for m in container(pod)["volumeMounts"]}


def volumes(pod: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in pod["volumes"]}


def gpus(pod: Obj) -> tuple[str | None, str | None]:
    res = container(pod)["resources"]
    return res.get("requests", {}).get(GPU_RESOURCE), res.get("limits", {}).get(GPU_RESOURCE)


# --- the set of children ---------------------------------------------------------------------

def test_children_in_apply_order_namespaced_and_unowned(make_rljob: MakeJob) -> None:
    objs = render_children(make_rljob())
    assert [o["kind"] for o in objs] == [
        "NetworkPolicy", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Secret",
        "RayJob"]
    for o in objs:
        assert o["metadata"]["namespace"] == "team-a"
        assert "ownerReferences" not in o["metadata"]
        assert o["metadata"]["labels"][names.LABEL_JOB] == "demo"


def test_the_engine_key_is_a_secret_of_the_attempt_every_ray_pod_reads(
        make_rljob: MakeJob) -> None:
    """The engines' API key lives in an immutable Secret per attempt (a new key per attempt)
    that every Ray container reads by secretKeyRef: it is in no env value, ConfigMap,
    entrypoint or command line of the rendered objects."""
    key = "k3y-0f-attempt-2"
    objs = render_children(make_rljob(spec=DISAGG), 2, engine_api_key=key)
    secret = by_kind(objs)["Secret"]
    assert secret["metadata"]["name"] == names.engine_key_secret("demo", 2) == "demo-r2-engine-key"
    assert secret["metadata"]["labels"][names.LABEL_ATTEMPT] == "2"
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"][names.ENGINE_API_KEY_SECRET_KEY]).decode() == key
    others = [o for o in objs if o["kind"] != "Secret"]
    assert key not in yaml.safe_dump_all(others)
    cluster = by_kind(objs)["RayJob"]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"],
            *(g["template"] for g in cluster["workerGroupSpecs"])]
    assert len(pods) == 3  # head, train, rollout
    for pod in pods:
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env[names.ENV_ENGINE_API_KEY] == {
                "name": "KUBERL_ENGINE_API_KEY", "valueFrom": {"secretKeyRef": {
                    "name": "demo-r2-engine-key", "key": "api-key"}}}
    with pytest.raises(ValueError, match="must not be empty"):
        render_children(make_rljob(), engine_api_key="")


def test_the_engine_key_variable_is_the_one_trainer_and_engines_read() -> None:
    from kuberl_wire.protocol import ENGINE_API_KEY_ENV

    assert names.ENV_ENGINE_API_KEY == ENGINE_API_KEY_ENV


def test_namespace_defaults_to_default(make_rljob: MakeJob) -> None:
    job = make_rljob(metadata={"namespace": None})
    assert {o["metadata"]["namespace"] for o in render_children(job)} == {"default"}


def test_rendering_is_pure(make_rljob: MakeJob) -> None:
    job = make_rljob(spec=DISAGG)
    before = job.model_dump()
    first = render_children(job, 3)
    assert render_children(job, 3) == first
    assert job.model_dump() == before


def test_no_object_is_shared_between_places(make_rljob: MakeJob) -> None:
    """A list or dict used twice (YAML would show an anchor) lets a caller's mutation of one
    place leak into another, e.g. a reconciler patching one rule's resourceNames."""
    text = yaml.safe_dump_all(render_children(make_rljob(spec=DISAGG)))
    assert "&id" not in text


# --- RayJob ------------------------------------------------------------------------------------

def test_rayjob_leaves_retries_and_deadlines_to_the_operator(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={"backoffLimit": 7, "activeDeadlineSeconds": 3600,
                           "ttlSecondsAfterFinished": 60})
    spec = rayjob_of(job)["spec"]
    assert spec["backoffLimit"] == 0
    assert "activeDeadlineSeconds" not in spec
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["submissionMode"] == "K8sJobMode"
    assert "suspend" not in spec and "deletionStrategy" not in spec
    assert spec["rayClusterSpec"]["enableInTreeAutoscaling"] is False


@pytest.mark.parametrize("spec", [{}, DISAGG], ids=["colocated", "disaggregated"])
def test_every_rayjob_turns_on_ray_token_auth(make_rljob: MakeJob, spec: dict[str, Any]) -> None:
    """Ray's token authentication on every job (issue 36): KubeRay then makes the token Secret
    and gives RAY_AUTH_MODE / RAY_AUTH_TOKEN to every Ray container and the submitter. Nothing
    kuberl renders sets them itself (KubeRay owns the Secret; a second token would conflict),
    and Ray 2.52 is the first Ray that has token auth (KubeRay refuses less)."""
    cluster = rayjob_of(make_rljob(spec=spec))["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(int(p) for p in cluster["rayVersion"].split(".")) >= (2, 52)
    text = yaml.safe_dump_all(render_children(make_rljob(spec=spec)))
    assert "RAY_AUTH_MODE" not in text and "RAY_AUTH_TOKEN" not in text


def test_entrypoint_runs_the_mounted_config(make_rljob: MakeJob) -> None:
    spec = rayjob_of(make_rljob())["spec"]
    assert spec["entrypoint"] == ENTRYPOINT
    assert names.CONFIG_PATH in spec["entrypoint"].split()
    assert "--in-cluster" in spec["entrypoint"].split()


def test_attempt_in_name_labels_and_env(make_rljob: MakeJob) -> None:
    job = make_rljob(spec=DISAGG)
    rj = rayjob_of(job, 4)
    assert rj["metadata"]["name"] == "demo-r4"
    assert rj["metadata"]["labels"][names.LABEL_ATTEMPT] == "4"
    cluster = rj["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]
    for t in templates:
        assert t["metadata"]["labels"][names.LABEL_ATTEMPT] == "4"
        assert env(t["spec"])[names.ENV_ATTEMPT] == "4"
        assert env(t["spec"])[names.ENV_JOB_NAME] == "demo"
        assert env(t["spec"])[names.ENV_JOB_NAMESPACE] == {
            "fieldRef": {"fieldPath": "metadata.namespace"}}


def test_worker_groups_have_fixed_size(make_rljob: MakeJob) -> None:
    for g in groups(make_rljob(spec=DISAGG)).values():
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] > 0


def test_an_eval_only_job_asks_for_no_training_pods_where_engines_have_their_own(
        make_rljob: MakeJob) -> None:
    """mode eval trains nothing: disaggregated, only the engines' pods are rendered (the
    training group's GPUs would sit idle); colocated, the engines run on the training pods."""
    from kuberl_api.load import parse
    from tests.conftest import BASE_RLJOB

    def eval_job(placement: Obj) -> RLJob:
        manifest = copy.deepcopy(BASE_RLJOB)
        manifest["spec"] = {**manifest["spec"], **copy.deepcopy(placement), "mode": "eval"}
        manifest["spec"]["data"] = {
            k: v for k, v in manifest["spec"]["data"].items() if k != "prompts"}
        manifest["spec"]["data"]["evalSets"] = [{"name": "held-out", "path": "/data/e.jsonl"}]
        return parse(manifest)

    assert set(groups(eval_job(DISAGG))) == set(groups(make_rljob(spec=DISAGG))) - {"train"}
    assert set(groups(eval_job({}))) == set(groups(make_rljob())) == {"train"}


# --- head ----------------------------------------------------------------------------------

def test_head_has_no_gpus_mounts_config_and_uses_its_service_account(
        make_rljob: MakeJob) -> None:
    job = make_rljob(spec=DISAGG)
    h = head(job)
    assert h["rayStartParams"]["num-gpus"] == "0"
    pod = h["template"]["spec"]
    assert gpus(pod) == (None, None)
    assert pod["serviceAccountName"] == names.service_account("demo")
    config = volumes(pod)["config"]
    assert config["configMap"]["name"] == names.configmap("demo")
    assert mounts(pod)[names.CONFIG_DIR]["name"] == "config"
    assert mounts(pod)[names.CONFIG_DIR]["readOnly"] is True
    assert "resources" not in h  # no Ray custom resource: no train/rollout actor lands here


def test_head_resources_are_guaranteed(make_rljob: MakeJob) -> None:
    res = container(head(make_rljob())["template"]["spec"])["resources"]
    assert res["requests"] == res["limits"]
    assert set(res["limits"]) == {"cpu", "memory"}


def test_workers_get_no_api_token_and_never_restart_in_place(make_rljob: MakeJob) -> None:
    for group, pod in pods(make_rljob(spec=DISAGG)).items():
        assert pod["restartPolicy"] == "Never"
        if group != "head":
            assert pod["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in pod


# --- GPUs, groups and pools ----------------------------------------------------------------

def test_gpu_requests_per_group(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec=DISAGG))
    assert gpus(p["train"]) == ("8", "8")
    assert gpus(p["rollout"]) == ("8", "8")
    assert gpus(p["head"]) == (None, None)


def test_cpu_and_memory_requests_equal_limits(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec=DISAGG))
    train = container(p["train"])["resources"]
    assert train["requests"] == train["limits"] == {
        "cpu": "32", "memory": "256Gi", GPU_RESOURCE: "8"}
    assert container(p["rollout"])["resources"]["limits"] == {
        "memory": "128Gi", GPU_RESOURCE: "8"}


@pytest.mark.parametrize(("gpus_total", "per_node", "per_engine", "replicas", "per_pod"), [
    (8, 8, 2, 1, 8),
    (4, 8, 2, 1, 4),     # fits on one node: one smaller pod
    (16, 8, 4, 2, 8),
    (24, 8, 8, 3, 8),
    (1, 8, 1, 1, 1),
    (12, 4, 2, 3, 4),
    (32, 8, 16, 4, 8),   # two engines, each over two whole nodes
])
def test_rollout_group_arithmetic(make_rljob: MakeJob, gpus_total: int, per_node: int,
                                  per_engine: int, replicas: int, per_pod: int) -> None:
    job = make_rljob(spec={**DISAGG, "rollout": {
        "gpus": gpus_total, "gpusPerNode": per_node, "gpusPerEngine": per_engine}})
    rollout = groups(job)[names.GROUP_ROLLOUT]
    assert rollout["replicas"] == replicas
    pod = rollout["template"]["spec"]
    assert gpus(pod) == (str(per_pod), str(per_pod))
    assert rollout["resources"] == {names.RESOURCE_ROLLOUT: str(per_pod)}
    assert replicas * per_pod == gpus_total


def test_colocate_has_no_rollout_group_and_train_pods_carry_both_resources(
        make_rljob: MakeJob) -> None:
    job = make_rljob(spec={"training": {"nodes": 2, "gpusPerNode": 8}})
    g = groups(job)
    assert list(g) == [names.GROUP_TRAIN]
    train = g[names.GROUP_TRAIN]
    assert train["replicas"] == 2
    assert train["resources"] == {names.RESOURCE_TRAIN: "8", names.RESOURCE_ROLLOUT: "8"}
    assert train["rayStartParams"] == {}  # KubeRay refuses resources in both places


def test_disaggregated_train_group_carries_only_the_train_resource(make_rljob: MakeJob) -> None:
    g = groups(make_rljob(spec=DISAGG))
    assert list(g) == [names.GROUP_TRAIN, names.GROUP_ROLLOUT]
    assert g[names.GROUP_TRAIN]["resources"] == {names.RESOURCE_TRAIN: "8"}
    assert g[names.GROUP_TRAIN]["replicas"] == 2


def test_images_per_group(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={**DISAGG, "training": {**DISAGG["training"], "image": "t:1"},
                           "rollout": {**DISAGG["rollout"], "image": "r:1"}})
    p = pods(job)
    assert container(p["head"])["image"] == "t:1"
    assert container(p["train"])["image"] == "t:1"
    assert container(p["rollout"])["image"] == "r:1"


def test_worker_groups_sit_on_their_node_pools(make_rljob: MakeJob) -> None:
    unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                   "effect": "NoExecute", "tolerationSeconds": 300}
    training = {**DISAGG["training"], "nodePool": {
        **GPU_POOL, "tolerations": [*GPU_POOL["tolerations"], unreachable]}}
    p = pods(make_rljob(spec={**DISAGG, "training": training}))
    assert p["train"]["nodeSelector"] == {"pool": "h100"}
    assert p["train"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 300}]
    assert p["rollout"]["nodeSelector"] == {"pool": "l40s"}
    assert p["rollout"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "rollout", "effect": "NoSchedule"}]
    assert "nodeSelector" not in p["head"] and "tolerations" not in p["head"]


def test_one_gpu_pod_per_node(make_rljob: MakeJob) -> None:
    for group, pod in pods(make_rljob(spec=DISAGG)).items():
        if group == "head":
            assert "affinity" not in pod
            continue
        terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms == [{
            "labelSelector": {"matchLabels": {names.LABEL_JOB: "demo", names.LABEL_GROUP: group}},
            "topologyKey": "kubernetes.io/hostname",
        }]
        # ...and the selector matches the group's own pods.
        labels = groups(make_rljob(spec=DISAGG))[group]["template"]["metadata"]["labels"]
        assert terms[0]["labelSelector"]["matchLabels"].items() <= labels.items()


def test_cpu_job_has_no_gpus_and_one_actor_slot_per_pod(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={
        "placement": "disaggregated",
        "training": {"nodes": 2, "gpusPerNode": 0, "backend": "fsdp"},
        "rollout": {"engine": "reference", "gpus": 0, "engines": 3},
    })
    g = groups(job)
    assert g["train"]["resources"] == {names.RESOURCE_TRAIN: "1"}
    assert g["rollout"]["replicas"] == 3
    assert g["rollout"]["resources"] == {names.RESOURCE_ROLLOUT: "1"}
    for group, pod in pods(job).items():
        assert gpus(pod) == (None, None)
        assert "affinity" not in pod  # small clusters may pack CPU pods
        assert not any(k.startswith("NCCL_") for k in env(pod)), group


def test_cpu_engines_wider_than_a_pod_take_one_pod_per_part(make_rljob: MakeJob) -> None:
    """On CPU an engine's processes stand in for GPUs: 4 of them at 2 per pod is 2 pods."""
    job = make_rljob(spec={
        "placement": "disaggregated",
        "training": {"gpusPerNode": 0, "backend": "fsdp"},
        "rollout": {"engine": "reference", "gpus": 0, "engines": 3, "gpusPerEngine": 4,
                    "gpusPerNode": 2},
    })
    rollout = groups(job)["rollout"]
    assert rollout["replicas"] == 6
    assert rollout["resources"] == {names.RESOURCE_ROLLOUT: "1"}


def test_colocated_cpu_job_spreads_engines_over_train_pods(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={"training": {"nodes": 2, "gpusPerNode": 0, "backend": "fsdp"},
                           "rollout": {"engine": "reference", "engines": 3}})
    assert groups(job)["train"]["resources"] == {
        names.RESOURCE_TRAIN: "1", names.RESOURCE_ROLLOUT: "2"}


# --- NCCL and network wiring ---------------------------------------------------------------

def test_dev_shm_is_memory_backed_on_every_pod(make_rljob: MakeJob) -> None:
    for group, pod in pods(make_rljob(spec=DISAGG)).items():
        shm = volumes(pod)[SHM_VOLUME]
        assert shm["emptyDir"]["medium"] == "Memory", group
        assert mounts(pod)[SHM_PATH]["name"] == SHM_VOLUME
    p = pods(make_rljob(spec=DISAGG))
    assert volumes(p["train"])[SHM_VOLUME]["emptyDir"]["sizeLimit"] == "256Gi"
    assert volumes(p["rollout"])[SHM_VOLUME]["emptyDir"]["sizeLimit"] == "128Gi"


def test_dev_shm_unbounded_without_a_memory_limit(make_rljob: MakeJob) -> None:
    pod = pods(make_rljob())["train"]
    assert volumes(pod)[SHM_VOLUME]["emptyDir"] == {"medium": "Memory"}


def test_dev_shm_uses_kuberays_volume_name() -> None:
    """KubeRay v1.5 adds its own /dev/shm volume unless the container already mounts that path;
    using its name too means no second volume even if its check were by name."""
    assert SHM_VOLUME == "shared-mem"


def test_nccl_env_on_gpu_pods(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={**DISAGG, "network": {
        "ncclSocketIfname": "eth0",
        "env": {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "ignored", "NCCL_DEBUG": "WARN",
                names.ENV_JOB_NAME: "spoofed"}}})
    p = pods(job)
    for group in ("train", "rollout"):
        e = env(p[group])
        assert e["NCCL_SOCKET_IFNAME"] == "eth0"  # the typed field wins over env
        assert e["NCCL_IB_HCA"] == "mlx5"
        assert e["NCCL_DEBUG"] == "WARN"
        assert e[names.ENV_JOB_NAME] == "demo"  # identity can't be overridden
        names_in_order = [x["name"] for x in container(p[group])["env"]]
        assert len(names_in_order) == len(set(names_in_order))
    assert "NCCL_SOCKET_IFNAME" not in env(p["head"])


def test_no_nccl_env_unless_asked(make_rljob: MakeJob) -> None:
    for pod in pods(make_rljob(spec=DISAGG)).values():
        assert not any(k.startswith("NCCL_") for k in env(pod))


def test_host_network_only_when_asked(make_rljob: MakeJob) -> None:
    for pod in pods(make_rljob(spec=DISAGG)).values():
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    on = pods(make_rljob(spec={**DISAGG, "network": {"hostNetwork": True}}))
    for group in ("train", "rollout"):
        assert on[group]["hostNetwork"] is True
        assert on[group]["dnsPolicy"] == "ClusterFirstWithHostNet"
        # Two Ray pods of the job must not share a host's ports: one term over all workers.
        term = on[group]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["labelSelector"]["matchLabels"] == {
            names.LABEL_JOB: "demo", names.LABEL_COMPONENT: names.COMPONENT_WORKER}
    assert "hostNetwork" not in on["head"]


def test_rdma_only_when_asked(make_rljob: MakeJob) -> None:
    for pod in pods(make_rljob(spec=DISAGG)).values():
        assert "securityContext" not in container(pod)
        assert not any(k.startswith("rdma/") for k in container(pod)["resources"].get(
            "limits", {}))
    rdma = {"resource": "rdma/rdma_shared_device_a", "count": 2}
    p = pods(make_rljob(spec={**DISAGG, "network": {"rdma": rdma}}))
    for group in ("train", "rollout"):
        res = container(p[group])["resources"]
        assert res["requests"]["rdma/rdma_shared_device_a"] == "2"
        assert res["limits"]["rdma/rdma_shared_device_a"] == "2"
        assert container(p[group])["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert "securityContext" not in container(p["head"])
    assert "rdma/rdma_shared_device_a" not in container(p["head"])["resources"]["limits"]


def test_weight_sync_port_on_the_train_pods_when_disaggregated(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec={**DISAGG, "network": {"weightSyncPort": 31000}}))
    assert container(p["train"])["ports"] == [
        {"name": names.PORT_WEIGHT_SYNC, "containerPort": 31000, "protocol": "TCP"}]
    assert "ports" not in container(p["rollout"])  # engines dial out to trainer rank 0
    # Colocated engines get weights by CUDA IPC handle: no group, no port.
    assert "ports" not in container(pods(make_rljob())["train"])


# --- volumes ----------------------------------------------------------------------------------

def test_checkpoint_volume(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec={**DISAGG, "checkpoint": {"pvc": "ckpt", "path": "/ckpt"}}))
    for group in ("head", "train"):
        assert mounts(p[group])["/ckpt"]["name"] == "checkpoints"
        assert volumes(p[group])["checkpoints"] == {
            "name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}
        assert not mounts(p[group])["/ckpt"].get("readOnly")
    assert "/ckpt" not in mounts(p["rollout"])
    no_pvc = pods(make_rljob())
    assert volumes(no_pvc["train"])["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert mounts(no_pvc["head"])["/checkpoints"]["name"] == "checkpoints"


def test_model_and_data_pvcs(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={
        **DISAGG,
        "model": {"path": "/mnt/m/qwen", "storage": {"pvc": "models", "mountPath": "/mnt/m",
                                                     "subPath": "hf"}},
        "data": {"prompts": "/mnt/d/p.jsonl", "storage": {"pvc": "data", "mountPath": "/mnt/d",
                                                          "readOnly": False}},
    })
    p = pods(job)
    for group in ("head", "train", "rollout"):
        assert mounts(p[group])["/mnt/m"] == {
            "name": "model", "mountPath": "/mnt/m", "subPath": "hf", "readOnly": True}
        assert volumes(p[group])["model"]["persistentVolumeClaim"] == {
            "claimName": "models", "readOnly": True}
    # The prompts are read by the driver on the head only.
    assert mounts(p["head"])["/mnt/d"] == {"name": "data", "mountPath": "/mnt/d"}
    assert volumes(p["head"])["data"]["persistentVolumeClaim"] == {"claimName": "data"}
    assert "/mnt/d" not in mounts(p["train"]) and "/mnt/d" not in mounts(p["rollout"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_pod_specs_are_internally_consistent(example: Path) -> None:
    """What the API server would refuse and no schema catches: a mount of a missing volume,
    duplicate volume names, mount paths or env names."""
    for group, pod in pods(load(example)).items():
        vol_names = [v["name"] for v in pod["volumes"]]
        assert len(vol_names) == len(set(vol_names)), group
        c = container(pod)
        paths = [m["mountPath"] for m in c["volumeMounts"]]
        assert len(paths) == len(set(paths)), group
        assert {m["name"] for m in c["volumeMounts"]} <= set(vol_names), group
        env_names = [e["name"] for e in c["env"]]
        assert len(env_names) == len(set(env_names)), group


# --- ConfigMap and RBAC ------------------------------------------------------------------

@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_configmap_round_trips_to_an_equal_spec(example: Path) -> None:
    job = load(example)
    cm = by_kind(render_children(job))["ConfigMap"]
    assert cm["metadata"]["name"] == names.configmap(job.name)
    back = loads(cm["data"][names.CONFIG_KEY])
    assert back.spec == job.spec
    assert (back.name, back.namespace) == (job.name, job.namespace)
    assert back.status is None


def test_value_clip_off_survives_the_configmap(make_rljob: MakeJob) -> None:
    """critic.valueClip 0 (off) reaches the trainer: the ConfigMap drops None values, so "off"
    must be a value, not an unset field that would come back as the 0.2 default."""
    job = make_rljob(spec={"algorithm": {"advantageEstimator": "ppo"},
                           "critic": {"valueClip": 0}})
    cm = by_kind(render_children(job))["ConfigMap"]
    assert yaml.safe_load(cm["data"][names.CONFIG_KEY])["spec"]["critic"]["valueClip"] == 0
    back = loads(cm["data"][names.CONFIG_KEY])
    assert back.spec.critic.value_clip == 0 and back.spec == job.spec


def test_configmap_holds_defaults_explicitly(make_rljob: MakeJob) -> None:
    cm = by_kind(render_children(make_rljob()))["ConfigMap"]
    doc = yaml.safe_load(cm["data"][names.CONFIG_KEY])
    assert doc["spec"]["training"]["gpusPerNode"] == 8
    assert doc["spec"]["algorithm"]["advantageEstimator"] == "grpo"
    assert set(doc["metadata"]) == {"name", "namespace"}


def test_role_grants_only_this_jobs_status_and_creating_events(make_rljob: MakeJob) -> None:
    objs = by_kind(render_children(make_rljob()))
    *rules, events = objs["Role"]["rules"]
    # (an engine replaced: an Event on the RLJob; `create` can't be pinned to a name)
    assert events == {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}
    for rule in rules:
        assert rule["apiGroups"] == ["kuberl.dev"]
        assert rule["resourceNames"] == ["demo"]
        assert set(rule["verbs"]) <= {"get", "patch"}
    writable = {r for rule in rules if "patch" in rule["verbs"] for r in rule["resources"]}
    assert writable == {"rljobs/status"}
    readable = {r for rule in rules for r in rule["resources"]}
    assert readable == {"rljobs", "rljobs/status"}
    binding = objs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": objs["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": objs["ServiceAccount"]["metadata"]["name"],
                                    "namespace": "team-a"}]


# --- labels and determinism ------------------------------------------------------------------

def test_user_labels_cannot_override_operator_owned_keys(make_rljob: MakeJob) -> None:
    job = make_rljob(metadata={"labels": {
        names.LABEL_JOB: "someone-else", names.LABEL_MANAGED_BY: "me",
        names.LABEL_ATTEMPT: "42", names.LABEL_COMPONENT: "x", names.LABEL_GROUP: "y",
        "team": "post-training"}})
    for o in render_children(job, 1):
        labels = o["metadata"]["labels"]
        assert labels[names.LABEL_JOB] == "demo"
        assert labels[names.LABEL_MANAGED_BY] == names.MANAGER
        assert labels.get(names.LABEL_ATTEMPT) in (None, "1")
        assert names.LABEL_GROUP not in labels  # only pods carry a group
        assert labels["team"] == "post-training"
    for t in [head(job)["template"], *[g["template"] for g in groups(job).values()]]:
        assert t["metadata"]["labels"][names.LABEL_JOB] == "demo"


def test_no_output_depends_on_dict_ordering(make_rljob: MakeJob) -> None:
    labels = {"b": "2", "a": "1", "c": "3"}
    selector = {"zone": "z1", "pool": "h100", "arch": "amd64"}
    nccl = {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN", "NCCL_IB_GID_INDEX": "3"}
    engine_args = {"schedule-conservativeness": "0.8", "chunked-prefill-size": "4096"}

    def build(order: Callable[[dict[str, str]], dict[str, str]]) -> str:
        spec = {**DISAGG,
                "training": {**DISAGG["training"], "nodePool": {"nodeSelector": order(selector)}},
                "rollout": {**DISAGG["rollout"], "engineArgs": order(engine_args)},
                "network": {"env": order(nccl)}}
        job = make_rljob(spec=spec, metadata={"labels": order(labels)})
        return yaml.safe_dump_all(render_children(job), sort_keys=False)

    assert build(dict) == build(lambda d: dict(reversed(list(d.items()))))


def test_pods_writing_to_a_claim_get_the_image_group(make_rljob: MakeJob) -> None:
    """The images run as uid/gid 1000; a fresh PVC belongs to root. fsGroup makes it writable."""
    p = pods(make_rljob(spec={**DISAGG, "checkpoint": {"pvc": "ckpt"}}))
    for group in ("head", "train"):
        assert p[group]["securityContext"] == {"fsGroup": 1000,
                                               "fsGroupChangePolicy": "OnRootMismatch"}
    assert "securityContext" not in p["rollout"]  # reads the model only
    for pod in pods(make_rljob(spec=DISAGG)).values():  # emptyDir checkpoints: nothing to fix
        assert "securityContext" not in pod


def test_dedicated_critic_gets_its_own_pods(make_rljob: MakeJob) -> None:
    critic_pool = {"nodeSelector": {"pool": "a100"}}
    job = make_rljob(spec={**DISAGG, "algorithm": {"advantageEstimator": "ppo"},
                           "critic": {"placement": "dedicated", "nodes": 2, "gpusPerNode": 4,
                                      "nodePool": critic_pool,
                                      "resources": {"memory": "64Gi"}}})
    g = groups(job)
    assert sorted(g) == ["critic", "rollout", "train"]
    critic = g["critic"]
    assert critic["replicas"] == critic["minReplicas"] == critic["maxReplicas"] == 2
    assert critic["resources"] == {names.RESOURCE_CRITIC: "4"}
    spec, train = critic["template"]["spec"], g["train"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "a100"}
    assert gpus(spec) == ("4", "4")
    assert env(spec) == env(train)  # the same NCCL settings as the trainers it all-reduces like
    # critic rank 0 writes the value model's checkpoint, on the same volume as the trainers
    assert job.spec.checkpoint.path in {m["mountPath"] for m in container(spec)["volumeMounts"]}
    assert names.RESOURCE_CRITIC not in g["train"]["resources"]


def test_shared_critic_rides_the_training_pods(make_rljob: MakeJob) -> None:
    g = groups(make_rljob(spec={**DISAGG, "algorithm": {"advantageEstimator": "ppo"}}))
    assert sorted(g) == ["rollout", "train"]
    assert g["train"]["resources"][names.RESOURCE_CRITIC] == \
        g["train"]["resources"][names.RESOURCE_TRAIN] == "8"
    # without ppo there is no critic: no critic resources, no critic pods (and a critic
    # section is refused, see test_api_validation's critic-without-ppo)
    plain = groups(make_rljob(spec=DISAGG))
    assert sorted(plain) == ["rollout", "train"]
    assert names.RESOURCE_CRITIC not in plain["train"]["resources"]
    with pytest.raises(InvalidRLJob, match=r"spec\.critic: critic applies to "
                                            r"advantageEstimator: ppo only"):
        make_rljob(spec={**DISAGG, "critic": {"placement": "dedicated"}})


# --- scheduling: Kueue, priority, stopping gracefully ---------------------------------------

def test_without_a_queue_the_rayjob_starts_at_once(make_rljob: MakeJob) -> None:
    rj = rayjob_of(make_rljob())
    assert "suspend" not in rj["spec"]
    assert "kueue.x-k8s.io/queue-name" not in rj["metadata"]["labels"]


def test_a_queued_rayjob_is_created_suspended_with_kueues_label(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={"scheduling": {"queueName": "team-a"}})
    rj = rayjob_of(job)
    assert rj["spec"]["suspend"] is True
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    # only the RayJob is queued: the ConfigMap and RBAC objects carry no queue label
    others = [o for o in render_children(job, 0) if o["kind"] != "RayJob"]
    assert all("kueue.x-k8s.io/queue-name" not in o["metadata"].get("labels", {})
               for o in others)


def test_priority_class_on_every_pod(make_rljob: MakeJob) -> None:
    job = make_rljob(spec={**DISAGG, "scheduling": {"priorityClassName": "research-high"}})
    assert {g: p.get("priorityClassName") for g, p in pods(job).items()} == {
        "head": "research-high", "train": "research-high", "rollout": "research-high"}
    assert all("priorityClassName" not in p for p in pods(make_rljob(spec=DISAGG)).values())


def test_pods_holding_the_checkpoint_stop_gracefully(make_rljob: MakeJob) -> None:
    """Head and train pods get the grace period and a preStop hook that lets the driver save a
    checkpoint; engines (rollout pods) hold no training state and stop at once."""
    job = make_rljob(spec={**DISAGG, "scheduling": {"terminationGracePeriodSeconds": 600}})
    specs = pods(job)
    assert specs["head"]["terminationGracePeriodSeconds"] == 600
    assert specs["train"]["terminationGracePeriodSeconds"] == 600
    assert "terminationGracePeriodSeconds" not in specs["rollout"]
    hooks = {g: container(p).get("lifecycle", {}).get("preStop", {}).get("exec", {})
             .get("command") for g, p in specs.items()}
    assert hooks == {"head": ["kuberl", "graceful-stop", "head", "--within", "590"],
                     "train": ["kuberl", "graceful-stop", "worker", "--within", "590"],
                     "rollout": None}
