"""The environment service of an RLJob with environment.image: a Deployment of the image's
server (`python -m kuberl_env module:Class`) and a headless Service in front of it, whose name
the head resolves to every ready replica, pinning each episode to one (docs/agents.md).

One pair per RLJob, not per attempt (no attempt label): a restarted attempt meets the same
pods, and nothing about them changes between attempts. Ready means /health answers, so an
address the head resolves is one that serves; a replica that stops answering leaves the
Service's addresses and gets no new episode.
"""

from __future__ import annotations

from typing import Any

from kuberl_api.rljob import RLJob
from kuberl_env import protocol
from kuberl_operator.render import names
from kuberl_operator.render.meta import object_meta
from kuberl_operator.render.pod import quantities

CONTAINER = "environment"
# /health answers from the event loop, at once: a replica whose loop is blocked (a step that
# never yields) stops being ready after PROBE_FAILURES periods, and gets no new episode.
PROBE = {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}


def command(job: RLJob) -> list[str]:
    return ["python", "-m", "kuberl_env", str(job.spec.environment.class_),
            "--port", str(protocol.DEFAULT_PORT)]


def deployment(job: RLJob) -> dict[str, Any]:
    env = job.spec.environment
    resources = env.resources
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": env.image,
        "command": command(job),
        "ports": [{"name": protocol.PORT_NAME, "containerPort": protocol.DEFAULT_PORT,
                   "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": protocol.HEALTH, "port": protocol.PORT_NAME},
                           **PROBE},
    }
    if env.env:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(env.env.items())]
    if resources is not None and (resources.cpu or resources.memory):
        container["resources"] = quantities(resources.cpu, resources.memory, {})
    pod: dict[str, Any] = {
        # The environment never calls the Kubernetes API; don't hand it a token.
        "automountServiceAccountToken": False,
    }
    pool = env.node_pool
    if pool is not None and pool.node_selector:
        pod["nodeSelector"] = dict(sorted(pool.node_selector.items()))
    if pool is not None and pool.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                              for t in pool.tolerations]
    if job.spec.scheduling.priority_class_name:
        pod["priorityClassName"] = job.spec.scheduling.priority_class_name
    pod["containers"] = [container]
    name = names.environment(job.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(job, name, names.COMPONENT_ENVIRONMENT),
        "spec": {
            "replicas": env.replica_count,
            "selector": {"matchLabels": names.environment_selector(job.name)},
            "template": {
                "metadata": {"labels": names.labels(job.name, names.COMPONENT_ENVIRONMENT)},
                "spec": pod,
            },
        },
    }


def service(job: RLJob) -> dict[str, Any]:
    """Headless (clusterIP None): its name resolves to the ready pods' own addresses, so the
    head chooses the replica of each episode (a ClusterIP would spread one episode's calls
    over replicas that do not share its state)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, names.environment(job.name), names.COMPONENT_ENVIRONMENT),
        "spec": {
            "clusterIP": "None",
            "selector": names.environment_selector(job.name),
            "ports": [{"name": protocol.PORT_NAME, "port": protocol.DEFAULT_PORT,
                       "targetPort": protocol.PORT_NAME, "protocol": "TCP"}],
        },
    }


def environment_children(job: RLJob) -> list[dict[str, Any]]:
    """The Service and the Deployment, or nothing without environment.image."""
    if job.spec.environment.image is None:
        return []
    return [service(job), deployment(job)]
