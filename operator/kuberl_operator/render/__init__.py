"""Pure renderers: an RLJob in, the plain-dict Kubernetes objects that run it out.

No kopf, no Kubernetes client, no ray, no network (an import-linter contract checks this), so
the goldens in tests/goldens are the whole truth about what the operator creates.
"""

from __future__ import annotations

from typing import Any

from kuberl_api.rljob import RLJob
from kuberl_operator.render.config import configmap
from kuberl_operator.render.environment import environment_children
from kuberl_operator.render.rayjob import rayjob
from kuberl_operator.render.rbac import role, role_binding, service_account
from kuberl_operator.render.secret import RENDERED_KEY, engine_key_secret

__all__ = ["render_children"]


def render_children(job: RLJob, attempt: int = 0, *,
                    engine_api_key: str = RENDERED_KEY) -> list[dict[str, Any]]:
    """All children in apply order: ServiceAccount, Role, RoleBinding, ConfigMap, the attempt's
    engine-key Secret (holding `engine_api_key`: the operator passes a random one per attempt),
    with environment.image the environment's Service and Deployment, then the RayJob. Plain
    dicts, no ownerReferences (the reconciler adopts them), namespace = job.namespace.

    The order matters: the head pod needs its ServiceAccount, ConfigMap and Secret to start,
    so those exist before the RayJob that creates it; the environment's pods start while the
    Ray cluster does."""
    return [
        service_account(job),
        role(job),
        role_binding(job),
        configmap(job),
        engine_key_secret(job, attempt, engine_api_key),
        *environment_children(job),
        rayjob(job, attempt),
    ]
