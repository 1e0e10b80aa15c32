"""Read what the decision needs: the RLJob's RayJobs and the current attempt's RayCluster.

Direct reads (not a watch cache): right after creating attempt N+1 a cache may not have it yet,
and "the current RayJob is missing" is a decision (a restart), so it must be authoritative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kuberl_operator.reconcile.children import owned_by
from kuberl_operator.reconcile.kube import RAYCLUSTER, RAYJOB, Kube
from kuberl_operator.render import names
from kuberl_operator.status import Observed, attempt_of


async def observe(kube: Kube, job: Mapping[str, Any]) -> Observed:
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rayjobs = tuple(rj for rj in await kube.list(RAYJOB.collection(namespace),
                                                  names.selector(name))
                    if owned_by(rj, uid))
    current = max(rayjobs, key=lambda rj: attempt_of(name, rj) or 0, default=None)
    cluster_name = ((current or {}).get("status") or {}).get("rayClusterName")
    cluster = await kube.get(RAYCLUSTER.url(namespace, cluster_name)) if cluster_name else None
    return Observed(rayjobs=rayjobs, raycluster=cluster)
