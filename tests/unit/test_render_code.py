"""spec.code in the rendered pods: the ConfigMap's or the PVC directory's files mounted
read-only at CODE_DIR in the head and every worker group, CODE_DIR first on the Ray
container's PYTHONPATH (before network.env's own entries), and nothing without the section."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuberl_api import RLJob
from kuberl_api.spec import CODE_DIR
from kuberl_operator.render import names, render_children
from kuberl_operator.render.code import VOLUME_CODE
from tests.unit.test_render import DISAGG, container, env, mounts, pods, volumes

MakeJob = Callable[..., RLJob]
AGENT = {"function": "my_agent:run", "maxTurns": 2}
# Disaggregated, PPO with a dedicated critic: head, train, rollout and critic pods.
EVERY_GROUP: dict[str, Any] = {
    **DISAGG, "rollout": {**DISAGG["rollout"], **AGENT},
    "algorithm": {"advantageEstimator": "ppo"}, "critic": {"placement": "dedicated"}}


def test_a_configmap_is_mounted_and_on_pythonpath_in_every_ray_pod(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec={**EVERY_GROUP, "code": {"configMap": "my-agent"}}))
    assert set(p) == {"head", "train", "rollout", "critic"}
    for group, pod in p.items():
        assert mounts(pod)[CODE_DIR] == {"name": VOLUME_CODE, "mountPath": CODE_DIR,
                                         "readOnly": True}, group
        assert volumes(pod)[VOLUME_CODE] == {"name": VOLUME_CODE,
                                             "configMap": {"name": "my-agent"}}, group
        assert env(pod)["PYTHONPATH"] == CODE_DIR, group
        pythonpaths = [e for e in container(pod)["env"] if e["name"] == "PYTHONPATH"]
        assert len(pythonpaths) == 1, group


def test_a_pvc_directory_is_mounted_read_only(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec={**EVERY_GROUP, "code": {"pvc": "agent-code",
                                                      "subPath": "calc/src"}}))
    for group, pod in p.items():
        assert mounts(pod)[CODE_DIR] == {"name": VOLUME_CODE, "mountPath": CODE_DIR,
                                         "readOnly": True, "subPath": "calc/src"}, group
        assert volumes(pod)[VOLUME_CODE]["persistentVolumeClaim"] == {
            "claimName": "agent-code", "readOnly": True}, group
        assert env(pod)["PYTHONPATH"] == CODE_DIR, group
    root = pods(make_rljob(spec={"rollout": AGENT, "code": {"pvc": "agent-code"}}))
    assert "subPath" not in mounts(root["head"])[CODE_DIR]


def test_the_code_goes_before_network_envs_pythonpath_on_gpu_pods(make_rljob: MakeJob) -> None:
    p = pods(make_rljob(spec={**EVERY_GROUP, "code": {"configMap": "my-agent"},
                              "network": {"env": {"PYTHONPATH": "/opt/site:/opt/more"}}}))
    for group in ("train", "rollout", "critic"):
        assert env(p[group])["PYTHONPATH"] == f"{CODE_DIR}:/opt/site:/opt/more", group
        listed = [e["name"] for e in container(p[group])["env"]]
        assert listed.count("PYTHONPATH") == 1, group
    assert env(p["head"])["PYTHONPATH"] == CODE_DIR  # network.env is for GPU pods only
    # Without the section network.env's PYTHONPATH is left as it was.
    plain = pods(make_rljob(spec={**EVERY_GROUP,
                                  "network": {"env": {"PYTHONPATH": "/opt/site"}}}))
    assert env(plain["train"])["PYTHONPATH"] == "/opt/site"


def test_without_code_nothing_is_mounted_or_set(make_rljob: MakeJob) -> None:
    for group, pod in pods(make_rljob(spec=EVERY_GROUP)).items():
        assert CODE_DIR not in mounts(pod) and VOLUME_CODE not in volumes(pod), group
        assert "PYTHONPATH" not in env(pod), group


def test_the_environment_services_pods_get_no_code(make_rljob: MakeJob) -> None:
    """environment.image's class is its image's: the service's pods mount nothing of code
    (here the code is the reward function's, which the head imports)."""
    job = make_rljob(spec={
        "environment": {"class": "envs:Calc", "image": "registry.example/calc:1"},
        "rollout": {"maxTurns": 2}, "reward": {"type": "custom", "function": "my_rewards:score"},
        "code": {"configMap": "my-rewards"}})
    objs = render_children(job)
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert not pod.get("volumes") and "PYTHONPATH" not in {
        e["name"] for e in pod["containers"][0].get("env", [])}
    assert env(pods(job)["head"])["PYTHONPATH"] == CODE_DIR
    assert deployment["metadata"]["name"] == names.environment(job.name)
