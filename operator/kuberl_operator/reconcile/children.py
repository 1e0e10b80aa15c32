"""Adopt and apply children: owner references, then server-side apply as the operator's field
manager (kube.FIELD_MANAGER).

Server-side apply, not create-then-merge-patch: we own exactly the fields we send, so the
fields another controller sets (KubeRay's defaults, Kueue's `spec.suspend`, its labels) are
never overwritten, a field we stop rendering is removed, and drift shows in managedFields.

Every child is created with a POST first, and applied only when it exists already (a 409):
an attempt's children are new nearly always, and a POST costs the API server less than an Apply
and needs no GET before it (at 1,000 RLJobs in a burst the API server's CPU is the limit, see
bench/RESULTS.md). The fields a POST sets belong to our Update entry, which a later Apply takes
over (force) but never removes.

The RayJob's `spec.suspend` needs that POST: with a queue it is created suspended and Kueue
then flips it. Applying it would fight Kueue; and an Apply that owned it and later left it out
would *remove* it (the RayJob would run unadmitted). So an existing RayJob is applied without
`spec.suspend`.

An object of that name that a different owner controls is never taken over, nor one being
deleted; the pass fails and is retried (this happens when an RLJob is deleted and recreated
under the same name before GC removed the old children). A restarted operator (or two racing
passes) converges on one object per name, never a duplicate.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

from kuberl_operator.reconcile.kube import Conflict, Kube, kind_of

# Metadata we set on a child; anything else there is the server's or another controller's.
_OUR_METADATA = ("name", "namespace", "labels", "annotations", "ownerReferences")


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
    """Create `obj`, or apply it onto the existing object of that name (when that one is ours);
    returns the object as the API server stored it."""
    kind, meta = kind_of(obj), obj["metadata"]
    try:
        return await kube.create(kind.collection(meta["namespace"]), applied(obj))
    except Conflict:
        pass
    if await _existing_ours(kube, obj) is None:  # deleted in between: one more create; a
        return await kube.create(kind.collection(meta["namespace"]), applied(obj))  # 409 escalates
    body = applied(obj)
    if obj.get("kind") == "RayJob":
        (body.get("spec") or {}).pop("suspend", None)  # Kueue's from now on
    return await kube.apply(_url(obj), body)


async def create_once(kube: Kube, obj: Mapping[str, Any]) -> None:
    """Create `obj` (an attempt's engine-key Secret); one that exists already is left as it
    is: an earlier pass of the same attempt made it, and its pods may hold its key. The
    operator may create Secrets but never read one (the chart's RBAC), so it does not look."""
    kind, meta = kind_of(obj), obj["metadata"]
    with contextlib.suppress(Conflict):
        await kube.create(kind.collection(meta["namespace"]), applied(obj))


async def _existing_ours(kube: Kube, obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The object of that name, None if there is none; ChildConflict unless it is ours (or
    no one's) and not being deleted."""
    meta = obj["metadata"]
    what = f"{obj['kind']} {meta['namespace']}/{meta['name']}"
    existing = await kube.get(_url(obj))
    if existing is None:
        return None
    if (existing.get("metadata") or {}).get("deletionTimestamp"):
        raise ChildConflict(f"{what} is being deleted; retrying later")
    ours = {r["uid"] for r in meta.get("ownerReferences") or []}
    controller = _controller_uid(existing)
    if controller is not None and controller not in ours:
        raise ChildConflict(f"{what} exists and is controlled by another owner (uid {controller})")
    return existing


def applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The apply configuration of `obj`: our fields only (never status, nor server metadata
    such as uid or resourceVersion, which would make the apply a precondition)."""
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("metadata", "status")}
    meta = obj["metadata"]
    out["metadata"] = {k: copy.deepcopy(meta[k]) for k in _OUR_METADATA if meta.get(k)}
    return out


def _url(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return kind_of(obj).url(meta["namespace"], meta["name"])
