"""Why an attempt's pods do not come up, from the pods themselves (KubeRay only says "head pod
not ready"): unschedulable, images that cannot be pulled, container configs the kubelet
refuses, containers that keep crashing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kuberl_operator.status.builder import Builder, cond, dig
from kuberl_operator.status.model import Event

# Why a pod does not come up, as the kubelet or scheduler says it: (reason, condition reason).
_WAITING_REASONS = {
    "ErrImagePull": "ImagePullFailed", "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed", "CreateContainerConfigError": "PodConfigError",
    "CreateContainerError": "PodConfigError", "CrashLoopBackOff": "ContainerFailed",
    "RunContainerError": "ContainerFailed",
}
MAX_POD_CAUSES = 3


def pod_problems(pods: tuple[Mapping[str, Any], ...]) -> list[tuple[str, str]]:
    """(condition reason, "pod NAME: what is wrong") for pods that cannot come up: unschedulable
    (a missing PVC, no node that fits), an image that cannot be pulled, a container config the
    kubelet refuses (a missing Secret or ConfigMap), a container that keeps crashing. KubeRay
    reports only "head pod not ready"; the cause is on the pods."""
    out = []
    for pod in pods:
        name = dig(pod, "metadata", "name")
        scheduled = cond(dig(pod, "status", "conditions"), "PodScheduled")
        if scheduled is not None and scheduled.get("status") == "False" and \
                scheduled.get("reason") == "Unschedulable":
            out.append(("PodUnschedulable", f"pod {name}: unschedulable: "
                        f"{scheduled.get('message') or 'no reason given'}"))
            continue
        for cs in dig(pod, "status", "containerStatuses") or []:
            waiting = dig(cs, "state", "waiting") or {}
            reason = waiting.get("reason")
            if reason in _WAITING_REASONS:
                out.append((_WAITING_REASONS[reason], f"pod {name}: {reason}: "
                            f"{waiting.get('message') or cs.get('image') or ''}".rstrip(": ")))
                break
    return out


def causes(b: Builder, pods: tuple[Mapping[str, Any], ...]) -> None:
    """Put the pods' own reasons into ClusterReady while the cluster is not ready, with one
    Warning Event each time they change."""
    ready = b.conditions.get("ClusterReady", {})
    if ready.get("status") != "False":
        return
    problems = pod_problems(pods)
    if not problems:
        return
    shown = "; ".join(m for _, m in problems[:MAX_POD_CAUSES])
    more = len(problems) - MAX_POD_CAUSES
    message = shown + (f" (and {more} more)" if more > 0 else "")
    old = b.old_condition("ClusterReady")
    if old is None or old.get("message") != message:
        b.events.append(Event("Warning", problems[0][0], message))
    b.set("ClusterReady", False, problems[0][0], message)
