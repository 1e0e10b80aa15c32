"""Pure renderers: an RLJob in, the plain-dict Kubernetes objects that run it out.

No kopf, no Kubernetes client, no ray, no network (an import-linter contract checks this), so
the goldens in tests/goldens are the whole truth about what the operator creates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kuberl_api import RuleFailure
from kuberl_api.rljob import RLJob
from kuberl_operator.render.config import configmap
from kuberl_operator.render.environment import environment_children
from kuberl_operator.render.network_policy import IngressPolicy, network_policy
from kuberl_operator.render.rayjob import rayjob
from kuberl_operator.render.rbac import role, role_binding, service_account
from kuberl_operator.render.secret import RENDERED_KEY, engine_key_secret

__all__ = ["IngressPolicy", "render_children"]

# The operator's default: a NetworkPolicy that admits only the job's own pods (the chart adds
# its peers through the operator's settings).
DEFAULT_INGRESS = IngressPolicy()


def render_children(job: RLJob, attempt: int = 0,
                    ingress: IngressPolicy = DEFAULT_INGRESS, *,
                    engine_api_key: str = RENDERED_KEY,
                    waived: Sequence[RuleFailure] = ()) -> list[dict[str, Any]]:
    """All children in apply order: the NetworkPolicy (unless `ingress` is off or the job is on
    the host network), ServiceAccount, Role, RoleBinding, ConfigMap, the attempt's engine-key
    Secret (holding `engine_api_key`: the operator passes a random one per attempt), with
    environment.image the environment's Service and Deployment, then the RayJob. Plain dicts,
    no ownerReferences (the reconciler adopts them), namespace = job.namespace.

    The order matters: the head pod needs its ServiceAccount, ConfigMap and Secret to start,
    so those exist before the RayJob that creates it; the environment's pods start while the
    Ray cluster does; the NetworkPolicy is there before any pod it protects.

    `waived`: the rules this job breaks that the operator waived for it (an earlier release
    accepted it; status/ratchet.py), named in the ConfigMap for the trainer."""
    policy = network_policy(job, ingress)
    return [
        *([policy] if policy is not None else []),
        service_account(job),
        role(job),
        role_binding(job),
        configmap(job, waived),
        engine_key_secret(job, attempt, engine_api_key),
        *environment_children(job),
        rayjob(job, attempt),
    ]
