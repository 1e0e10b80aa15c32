"""ObjectMeta of the top-level children (no ownerReferences: the reconciler adopts them)."""

from __future__ import annotations

from typing import Any

from kuberl_api.rljob import RLJob
from kuberl_operator.render import names


def object_meta(job: RLJob, name: str, component: str,
                attempt: int | None = None) -> dict[str, Any]:
    """name, namespace and labels: the operator's labels plus the RLJob's own, so that users
    (and tools such as Kueue or cost reports that select on labels) see them on every child;
    operator-owned keys can't be overridden (see names.merged_labels)."""
    owned = names.labels(job.name, component, attempt)
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": names.merged_labels(owned, job.metadata.labels),
    }
