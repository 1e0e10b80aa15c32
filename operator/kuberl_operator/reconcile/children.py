"""Adopt and apply children: owner references, then an idempotent create-or-patch.

Create first, and on 409 (it exists) get + merge-patch it: a restarted operator (or two racing
passes) converges on one object per name, never a duplicate. An object of that name that a
different owner controls is never taken over; the pass fails and is retried (this happens when
an RLJob is deleted and recreated under the same name before GC removed the old children).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kuberl_operator.reconcile.kube import Conflict, Kube, kind_of

# Server-managed or never-ours top-level keys, left out of the patch.
_NOT_PATCHED = ("apiVersion", "kind", "metadata", "status")


class ChildConflict(RuntimeError):
    """A child's name is taken by an object we don't own (or that is being deleted)."""


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("uid") == owner_uid for r in refs)


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            uid = ref.get("uid")
            return str(uid) if uid else None
    return None


def adopt(child: Mapping[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `child` controlled by `owner` (GC deletes it with the owner)."""
    out = copy.deepcopy(dict(child))
    meta = out.setdefault("metadata", {})
    meta["namespace"] = owner["metadata"].get("namespace") or meta.get("namespace")
    ref = owner_reference(owner)
    refs = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != ref["uid"]]
    meta["ownerReferences"] = [*refs, ref]
    return out


async def apply(kube: Kube, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create `obj`, or patch the existing one of that name into shape."""
    kind = kind_of(obj)
    meta = obj["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        return await kube.create(kind.collection(namespace), obj)
    except Conflict:
        pass
    existing = await kube.get(kind.url(namespace, name))
    if existing is None:  # deleted in between: one more create; a second 409 escalates
        return await kube.create(kind.collection(namespace), obj)
    current = existing.get("metadata") or {}
    ours = {r["uid"] for r in meta.get("ownerReferences") or []}
    if current.get("deletionTimestamp"):
        raise ChildConflict(f"{obj['kind']} {namespace}/{name} is being deleted; retrying later")
    controller = _controller_uid(existing)
    if controller is not None and controller not in ours:
        raise ChildConflict(f"{obj['kind']} {namespace}/{name} exists and is controlled by "
                            f"another owner (uid {controller})")
    patch: dict[str, Any] = {k: v for k, v in obj.items() if k not in _NOT_PATCHED}
    patch["metadata"] = {
        "labels": meta.get("labels") or {},
        "annotations": meta.get("annotations") or {},
        "ownerReferences": meta.get("ownerReferences") or [],
    }
    patched = await kube.patch(kind.url(namespace, name), patch)
    if patched is None:
        raise ChildConflict(f"{obj['kind']} {namespace}/{name} vanished while patching")
    return patched
