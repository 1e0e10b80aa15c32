"""environment.image as the operator renders it: a Deployment of the image's server and a
headless Service in front of it, before the RayJob, the same for every attempt, and the
head told where they are. What the spec asks for (replicas, resources, env, node pool) is
what the pods get; without an image nothing of it is rendered."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import schemas

from kuberl_api import RLJob, runtime
from kuberl_env import protocol
from kuberl_operator.render import names, render_children

MakeJob = Callable[..., RLJob]
Obj = dict[str, Any]

SERVICE: Obj = {"environment": {
    "class": "envs.calc:Calculator", "image": "registry.example/calc:1", "replicas": 3,
    "resources": {"cpu": "2", "memory": "4Gi"}, "env": {"LEVEL": "2", "A_FIRST": "1"},
    "nodePool": {"nodeSelector": {"pool": "cpu"},
                 "tolerations": [{"key": "cpu-only", "operator": "Exists"}]}},
    "rollout": {"maxTurns": 3}}


def kinds(objs: list[Obj]) -> list[str]:
    return [o["kind"] for o in objs]


def of_kind(objs: list[Obj], kind: str) -> Obj:
    (found,) = [o for o in objs if o["kind"] == kind and o["apiVersion"] != "ray.io/v1"]
    return found


def head_env(objs: list[Obj]) -> dict[str, Any]:
    rayjob = next(o for o in objs if o["kind"] == "RayJob")
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    return {e["name"]: e.get("value") for e in head["containers"][0]["env"]}


def test_without_an_image_nothing_of_it_is_rendered(make_rljob: MakeJob) -> None:
    objs = render_children(make_rljob(spec={"environment": {"class": "envs:Calculator"}}))
    assert "Deployment" not in kinds(objs) and "Service" not in kinds(objs)
    assert runtime.ENV_ENVIRONMENT_URL not in head_env(objs)


def test_the_environment_service_is_a_deployment_behind_a_headless_service(
        make_rljob: MakeJob) -> None:
    objs = render_children(make_rljob(spec=SERVICE))
    # started with the job's other children, before the RayJob whose head calls it
    assert kinds(objs) == ["NetworkPolicy", "ServiceAccount", "Role", "RoleBinding",
                           "ConfigMap", "Secret", "Service", "Deployment", "RayJob"]
    svc, dep = of_kind(objs, "Service"), of_kind(objs, "Deployment")
    assert svc["metadata"]["name"] == dep["metadata"]["name"] == "demo-env"
    assert svc["spec"]["clusterIP"] == "None"  # headless: the head sees every replica
    selector = dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"] == selector == {names.LABEL_JOB: "demo",
                                                   names.LABEL_COMPONENT: "environment"}
    template = dep["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": protocol.PORT_NAME, "port": protocol.DEFAULT_PORT,
                                     "targetPort": protocol.PORT_NAME, "protocol": "TCP"}]
    assert dep["spec"]["replicas"] == 3
    pod = template["spec"]
    (box,) = pod["containers"]
    assert box["image"] == "registry.example/calc:1"
    assert box["command"] == ["python", "-m", "kuberl_env", "envs.calc:Calculator", "--port",
                              str(protocol.DEFAULT_PORT)]
    assert box["readinessProbe"]["httpGet"] == {"path": "/health", "port": protocol.PORT_NAME}
    assert box["ports"] == [{"name": protocol.PORT_NAME, "containerPort": protocol.DEFAULT_PORT,
                             "protocol": "TCP"}]
    assert box["env"] == [{"name": "A_FIRST", "value": "1"}, {"name": "LEVEL", "value": "2"}]
    assert box["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"},
                                "limits": {"cpu": "2", "memory": "4Gi"}}
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "cpu-only", "operator": "Exists"}]
    assert pod["automountServiceAccountToken"] is False
    assert head_env(objs)[runtime.ENV_ENVIRONMENT_URL] == "http://demo-env:8000"
    for obj in (svc, dep):
        schemas.validate(obj)


def test_the_smallest_environment_service_and_its_defaults(make_rljob: MakeJob) -> None:
    objs = render_children(make_rljob(spec={"environment": {"class": "envs:Calc",
                                                            "image": "calc:1"},
                                            "scheduling": {"priorityClassName": "batch"}}))
    dep = of_kind(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1
    assert "env" not in pod["containers"][0] and "resources" not in pod["containers"][0]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["priorityClassName"] == "batch"  # ordered and preempted with the job
    schemas.validate(dep)


@pytest.mark.parametrize("attempt", [1, 99])
def test_every_attempt_meets_the_same_environment_pods(make_rljob: MakeJob,
                                                       attempt: int) -> None:
    job = make_rljob(spec=SERVICE)
    first, later = render_children(job, 0), render_children(job, attempt)
    for kind in ("Service", "Deployment"):
        assert of_kind(first, kind) == of_kind(later, kind)


def test_the_names_fit_the_longest_job(make_rljob: MakeJob) -> None:
    job = make_rljob(spec=SERVICE, metadata={"name": names.longest_job_name()})
    name = of_kind(render_children(job), "Deployment")["metadata"]["name"]
    assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
