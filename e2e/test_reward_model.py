"""reward.type model on a real control plane: the operator renders a Ray worker group for the
reward model the job serves, KubeRay makes its pods in the RayJob's RayCluster, the scheduler
puts them on the pool the spec names; they advertise the Ray resource the trainer's engine
actors ask for, the reward model's PVC is mounted in the head (its tokenizer) and in its
pods (its weights), and the head's config carries reward.model. A reward.model the system
could not run is refused at `kubectl apply`, naming the field.

kwok's pods run nothing, so "Running" is kwok's word; what the engines do with the spec is the
integration tier's (`rendered_spec` gives it the spec the head would read here).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from rljobs import (
    JobWatch,
    Operator,
    cpu_job,
    kubectl_apply,
    policy_enforced,
    static_claims,
)

from kuberl_api import RLJobSpec
from kuberl_api.load import load_rendered
from kuberl_api.spec.reward import SGLANG_NEEDS_GPUS
from kuberl_operator.render import names

pytestmark = pytest.mark.e2e

CLAIM = "reward-models"
MOUNT = "/mnt/rm"
REWARD_MODEL: dict[str, Any] = {
    "path": f"{MOUNT}/tiny-rm", "storage": {"pvc": CLAIM, "mountPath": MOUNT},
    "engine": "reference", "gpusPerReplica": 0, "replicas": 2,
    "nodePool": {"nodeSelector": {"pool": "cpu"}},
    "resources": {"cpu": "1", "memory": "2Gi"}}


def rendered_spec(c: Cluster, ns: str, job: str) -> RLJobSpec:
    """The RLJobSpec the job's head reads: its ConfigMap's rljob.yaml, loaded as `kuberl run
    --in-cluster` loads the mounted file (the rules the operator waived for it waived)."""
    cm = c.api().get(f"/api/v1/namespaces/{ns}/configmaps/{names.configmap(job)}")
    assert cm is not None, f"no ConfigMap {ns}/{names.configmap(job)}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / names.CONFIG_KEY
        path.write_text(cm["data"][names.CONFIG_KEY])
        job_config, _ = load_rendered(path)
    return job_config.spec


def claims_at(pod: Mapping[str, Any]) -> dict[str, str]:
    """mountPath -> claim of the Ray container's PVC mounts."""
    spec = pod["spec"]
    claim_of = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claim_of[m["name"]]
            for m in spec["containers"][0].get("volumeMounts", []) if m["name"] in claim_of}


@pytest.mark.kuberay
def test_the_reward_model_gets_pods_of_its_own(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    c, ns, job = k8s_cluster, operator_ns, "reward-model"
    api = c.api()
    w = JobWatch(c, operator, ns, job)
    with static_claims(c, ns, [CLAIM]):
        kubectl_apply(c, cpu_job(job, ns, reward={"type": "model", "model": REWARD_MODEL}),
                      check=True)
        try:
            w.wait_condition("Accepted", "True", timeout=60)
            # KubeRay's RayCluster of the operator's RayJob has the reward group as rendered.
            rc_url = w.raycluster_url(0)
            rc = wait_for(f"RayCluster {rc_url}", partial(api.get, rc_url), timeout=30,
                          detail=w.detail)
            groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
            reward = groups[names.GROUP_REWARD]
            assert reward["replicas"] == 2, reward
            assert reward["resources"] == {names.RESOURCE_REWARD: "1"}, reward

            def running() -> list[dict[str, Any]]:
                pods = w.pods_by_group(0).get(names.GROUP_REWARD, [])
                ok = [p for p in pods if p["status"].get("phase") == "Running"
                      and p["spec"].get("nodeName")]
                return ok if len(ok) == 2 else []

            pods = wait_for("2 reward pods Running", running, timeout=60, detail=w.pod_detail)
            for pod in pods:
                node = api.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
                assert node["metadata"]["labels"]["pool"] == "cpu", pod["spec"]["nodeName"]
                box = pod["spec"]["containers"][0]
                # `ray start --resources` as KubeRay wrote it from the group's resources: the
                # unit each engine actor asks for.
                start = " ".join(box.get("command", []) + box.get("args", []))
                assert names.RESOURCE_REWARD in start, start
                assert box["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}, box
                assert claims_at(pod)[MOUNT] == CLAIM
            (head,) = w.pods_by_group(0)[names.GROUP_HEAD]
            assert claims_at(head)[MOUNT] == CLAIM  # the head reads its tokenizer

            # The head's config carries reward.model as the job's spec has it.
            served = rendered_spec(c, ns, job).reward.model
            assert served is not None
            assert (served.path, served.replicas, served.gpus_per_replica, served.engine) == (
                REWARD_MODEL["path"], 2, 0, "reference")
            assert served.tokenizer_path == REWARD_MODEL["path"]
        finally:
            w.delete_and_wait_gc()


@pytest.mark.parametrize(("model", "field", "message"), [
    ({"path": "/models/judge", "form": "judge", "engine": "reference", "gpusPerReplica": 0},
     "spec.reward.model.judge", "judge is required when form is judge"),
    ({"path": "/models/rm", "engine": "sglang", "gpusPerReplica": 0},
     "spec.reward.model.gpusPerReplica", SGLANG_NEEDS_GPUS),
    # another claim where the policy's model is mounted: the pod would have two volumes there
    ({"path": "/models/rm", "storage": {"pvc": "other", "mountPath": "/models"}},
     "spec.reward.model.storage.mountPath",
     "model.storage and reward.model.storage need different mountPath values"),
], ids=["judge-without-judge", "sglang-on-cpu", "another-claim-on-the-model-mount"])
def test_a_reward_model_it_cannot_run_is_refused_at_apply(
        k8s_cluster: Cluster, operator_ns: str, model: dict[str, Any], field: str,
        message: str) -> None:
    c = k8s_cluster
    wait_for("the RLJob policy in force", lambda: policy_enforced(c, operator_ns), timeout=30,
             interval=0.5)
    obj = cpu_job("reward-refused", operator_ns, reward={"type": "model", "model": model})
    obj["spec"]["model"] = {"path": "/models/tiny",
                            "storage": {"pvc": "m", "mountPath": "/models"}}
    proc = kubectl_apply(c, obj)
    assert proc.returncode != 0, proc.stdout
    assert f"{field}: {message}" in proc.stderr, proc.stderr
