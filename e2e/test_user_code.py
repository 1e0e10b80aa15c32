"""spec.code on a real control plane: an RLJob whose ConfigMap is missing waits with
Accepted=False (CodeNotFound, with an Event) and nothing created; once the ConfigMap exists the
operator creates the RayJob, whose head and worker templates mount it read-only at CODE_DIR
with CODE_DIR on PYTHONPATH, and KubeRay's head pod keeps both.

What the pods do with the files (Python importing them) is no control plane's business: kwok's
pods run nothing; the unit tier checks the rendering (tests/unit/test_render_code.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from rljobs import JobWatch, Operator, cpu_job, events_for, kubectl_apply, selector_query

from kuberl_api.spec import CODE_DIR
from kuberl_operator.render import names

pytestmark = pytest.mark.e2e

CONFIGMAP = "my-agent"
AGENT = "async def run(ctx, **args):\n    return ctx.trajectory()\n"


def the_code(pod: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """The Ray container's mount at CODE_DIR (readOnly), the ConfigMap its volume names and its
    PYTHONPATH (the API server adds defaultMode to a pod's ConfigMap volume)."""
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    mount = mounts.get(CODE_DIR) or {}
    source = (volumes.get(mount.get("name", "")) or {}).get("configMap") or {}
    return mount.get("readOnly"), source.get("name"), env.get("PYTHONPATH")


CARRIED = (True, CONFIGMAP, CODE_DIR)


@pytest.mark.kuberay
def test_code_from_a_configmap_waits_for_it_then_reaches_the_pods(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    c, ns, job = k8s_cluster, operator_ns, "user-code"
    api = c.api()
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, code={"configMap": CONFIGMAP}, rollout={
        "engine": "reference", "gpus": 0, "function": "my_agent:run"}), check=True)
    try:
        refused = w.wait_condition("Accepted", "False", timeout=60)
        assert refused["reason"] == "CodeNotFound", refused
        assert f'configmaps "{CONFIGMAP}" not found' in refused["message"], refused
        assert "CodeNotFound" in {e.get("reason") for e in events_for(api, ns, job)}
        assert w.rayjob(0) is None and w.status().get("rayJobName") is None

        c.kubectl("create", "configmap", CONFIGMAP, "-n", ns, f"--from-literal=my_agent.py={AGENT}")
        w.wait_condition("Accepted", "True", timeout=60)
        rayjob = wait_for("the RayJob", lambda: w.rayjob(0), timeout=30, detail=w.detail)
        cluster = rayjob["spec"]["rayClusterSpec"]
        templates = {"head": cluster["headGroupSpec"]["template"]["spec"]} | {
            g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]}
        assert {g: the_code(t) for g, t in templates.items()} == dict.fromkeys(
            ("head", names.GROUP_TRAIN), CARRIED)

        # KubeRay builds the head pod from the template: the mount and PYTHONPATH survive it.
        pods_url = f"/api/v1/namespaces/{ns}/pods?" + selector_query(
            {**names.selector(job), names.LABEL_GROUP: names.GROUP_HEAD})
        head = wait_for("the head pod", lambda: next(iter(api.get(pods_url)["items"]), None),
                        timeout=60, detail=w.detail)
        assert the_code(head["spec"]) == CARRIED
    finally:
        w.delete_and_wait_gc()
        c.kubectl("delete", "configmap", CONFIGMAP, "-n", ns, "--ignore-not-found")
