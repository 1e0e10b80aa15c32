"""ServiceAccount, Role and RoleBinding for the Ray head: the trainer there reports progress (and
a refusal to start: status.trainerRefusal) by patching its own RLJob's status and posts Events
on it (an engine replaced), and may do nothing else with the API."""

from __future__ import annotations

from typing import Any

from kuberl_api.rljob import GROUP, PLURAL, RLJob
from kuberl_operator.render import names
from kuberl_operator.render.meta import object_meta

RBAC_API_GROUP = "rbac.authorization.k8s.io"


def service_account(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(job, names.service_account(job.name), names.COMPONENT_RBAC),
    }


def role(job: RLJob) -> dict[str, Any]:
    """Least privilege: `resourceNames` pins every rule to this one RLJob, so a compromised or
    buggy trainer can't touch other jobs; only the status subresource is writable, so it can't
    change its own spec either. (`get` on the object lets it read metadata.generation and the
    uid its Events name.) Creating Events can't be pinned to a name (Kubernetes checks
    resourceNames on no `create`): the trainer may create Events in its namespace, as any
    controller does."""
    return {
        "apiVersion": f"{RBAC_API_GROUP}/v1",
        "kind": "Role",
        "metadata": object_meta(job, names.role(job.name), names.COMPONENT_RBAC),
        "rules": [
            {"apiGroups": [GROUP], "resources": [PLURAL],
             "resourceNames": [job.name], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"],
             "resourceNames": [job.name], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ],
    }


def role_binding(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC_API_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(job, names.role_binding(job.name), names.COMPONENT_RBAC),
        "roleRef": {"apiGroup": RBAC_API_GROUP, "kind": "Role", "name": names.role(job.name)},
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account(job.name),
                      "namespace": job.namespace}],
    }
