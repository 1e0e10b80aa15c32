"""reward.type model on a real control plane: the operator renders a Ray worker group for the
reward model the job serves, KubeRay makes its pods in the RayJob's RayCluster, the scheduler
puts them on the pool the spec names; they advertise the Ray resource the trainer's engine
actors ask for, the reward model's PVC is mounted in the head (its tokenizer) and in its
pods (its weights), and the head's config carries reward.model. A reward.model the system
could not run is refused at `kubectl apply`, naming the field.

kwok's pods run nothing, so "Running" is kwok's word. What a reward pod would run is run here:
the spec the head reads from the rendered ConfigMap starts a real reference engine through the
trainer's own command line (the one a reward pod's engine actor runs), and the trainer's scorer,
built from that spec as the head builds it, scores through it exactly what the tiny reward
model scores in-process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
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
    free_port,
    kubectl_apply,
    policy_enforced,
    static_claims,
)
from transformers import AutoTokenizer

from kuberl_api import RLJobSpec
from kuberl_api.load import load_rendered
from kuberl_api.spec.reward import SGLANG_NEEDS_GPUS
from kuberl_operator.render import names
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.engines.command import reward_engine_command
from kuberl_trainer.rollout.reward_client import RemoteScorer
from kuberl_trainer.rollout.rewards.model_io import chat_render
from kuberl_trainer.rollout.rewards.scorer import RewardInput

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


def tiny_reward_model() -> Path:
    """The tiny reward model on an untrained tiny policy (seeded, cached like the tiny job:
    its scores, not its judgement, are what this checks)."""
    from kuberl_trainer.tiny.build import BuildConfig, build
    from kuberl_trainer.tiny.reward_model import build_reward_model

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kuberl"
    policy = cache / "e2e-tiny-sft0"
    build(policy, BuildConfig(sft_steps=0), log=lambda _: None)
    out = cache / "e2e-tiny-sft0-reward-model"
    build_reward_model(out, policy / "model", log=lambda _: None)
    return out


def in_process(path: Path, texts: list[str]) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_the_rendered_reward_model_serves_and_scores_as_in_process(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str, tmp_path: Path) -> None:
    c, ns, job = k8s_cluster, operator_ns, "reward-served"
    model = tiny_reward_model()
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, reward={"type": "model", "batchSize": 3, "model": {
        "path": str(model), "engine": "reference", "gpusPerReplica": 0}}), check=True)
    try:
        w.wait_condition("Accepted", "True", timeout=60)
        spec = wait_for("the head's config", lambda: rendered_spec(c, ns, job), timeout=30,
                        detail=w.detail)
    finally:
        w.delete_and_wait_gc()
    served = spec.reward.model
    assert served is not None
    port = free_port()
    cmd = reward_engine_command(spec, port=port, nccl_port=0, seed=0, torch_threads=1,
                                python=sys.executable)
    log = (tmp_path / "engine.log").open("w")
    engine = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    items = [RewardInput(id=f"0:0:{i}:0", prompt=f"{i}+{i}=", response=r, label=str(2 * i))
             for i in range(4) for r in (str(2 * i), str(2 * i + 1))]

    async def score() -> list[float | None]:
        client = EngineClient([url])
        try:
            await client.wait_healthy(timeout_s=120, exited=lambda: (
                {url: code} if (code := engine.poll()) is not None else {}))
        finally:
            await client.close()
        render = chat_render(AutoTokenizer.from_pretrained(served.tokenizer_path))
        return (await RemoteScorer.for_model(spec.reward, [url], render).score(items)).rewards

    try:
        got = asyncio.run(score())
    finally:
        engine.terminate()
        engine.wait(timeout=30)
        log.close()
    want = in_process(model, [i.prompt + i.response for i in items])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (tmp_path / "engine.log").read_text()
