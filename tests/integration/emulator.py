"""The in-memory Kubernetes API the operator runs against: kmock's emulator, made realistic
enough for kopf and for our assertions.

kmock 0.8 stores request bodies verbatim. On top of it this adds what a real API server does
and the operator relies on: uid/resourceVersion/generation/creationTimestamp on create,
generateName (Events use it), `/status` subresource semantics (status only through /status;
a spec change bumps generation), garbage collection of objects whose owners are gone, and
server-side apply, simplified: an apply patch (`application/apply-patch+yaml`) creates the
object if missing, else merges the applied fields in (a real server also removes the fields
the manager applied before and omits now, and detects conflicts; the e2e tier has one). Writes
naming a `fieldManager` leave a minimal `metadata.managedFields` entry (manager, operation,
the top-level field paths it sent), so tests can tell who wrote what.
Plus two test hooks: `hold(predicate)` parks matching requests until released, to kill the
operator at an exact point of a create sequence; `mute(resource, *types)` silences watch events
of a resource, as a watch that goes idle without closing does, so that a test controls exactly
what wakes the operator.

Built on the notes of the kmock lab (kmock internals: objects, buses and requests are matched
by identity, so a rewritten request must be swapped into `_requests`).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import random
import string
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import kmock
from kmock._internal import enums

Predicate = Callable[[Any], bool]


class Hold:
    """Parks the first request matching `predicate`. "before": not applied until released
    (and dropped with a 503 when released with apply=False, as if it never arrived);
    "after": applied, but the response is withheld until released."""

    def __init__(self, predicate: Predicate, when: str) -> None:
        self.predicate = predicate
        self.when = when
        self.gate = asyncio.Event()
        self.apply = True
        self.hits: list[str] = []

    def release(self, apply: bool = True) -> None:
        self.apply = apply
        self.gate.set()


APPLY_PATCH = "application/apply-patch+yaml"
# Metadata the server owns; never part of a manager's fields.
_SERVER_METADATA = ("uid", "resourceVersion", "generation", "creationTimestamp",
                    "managedFields", "deletionTimestamp")


def _is_apply(request: Any) -> bool:
    return str((request.headers or {}).get("Content-Type", "")).startswith(APPLY_PATCH)


def _field_set(value: Any) -> Any:
    """FieldsV1, roughly: nested {"f:key": ...}; lists and scalars are leaves."""
    if isinstance(value, dict):
        return {f"f:{k}": _field_set(v) for k, v in value.items()}
    return {}


def _managed(request: Any, existing: list[dict[str, Any]], sent: dict[str, Any],
             api_version: str) -> list[dict[str, Any]] | None:
    """managedFields after this write: its manager's entry (one per manager, operation and
    subresource) replaced by what this request sent; None if it names no manager."""
    manager = (request.params or {}).get("fieldManager")
    if not manager:
        return None
    operation = "Apply" if _is_apply(request) else "Update"
    sent = copy.deepcopy(sent)
    meta = sent.get("metadata")
    if isinstance(meta, dict):
        for key in ("name", "namespace", *_SERVER_METADATA):
            meta.pop(key, None)
        if not meta:
            sent.pop("metadata")
    for key in ("apiVersion", "kind"):
        sent.pop(key, None)
    entry = {"manager": manager, "operation": operation, "apiVersion": api_version,
             "time": _now(), "fieldsType": "FieldsV1", "fieldsV1": _field_set(sent)}
    if request.subresource:
        entry["subresource"] = request.subresource
    same = (manager, operation, request.subresource)
    kept = [e for e in existing
            if (e.get("manager"), e.get("operation"), e.get("subresource")) != same]
    return [*kept, entry]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _holds: list[Hold] = attrs.field(factory=list, init=False)
    _muted: dict[Any, frozenset[str]] = attrs.field(factory=dict, init=False)

    # ---------------------------------------------------------------- test hooks
    def hold(self, predicate: Predicate, when: str = "before") -> Hold:
        hold = Hold(predicate, when)
        self._holds.append(hold)
        return hold

    def mute(self, resource: str, *types: str) -> None:
        """Watch streams of `resource`, open or new, deliver no more events of these types
        (ADDED, MODIFIED, DELETED; all when none is named). Lists still show everything."""
        self._muted[kmock.resource(resource)] = frozenset(types)

    def _mutes(self, resource: Any, event: dict[str, Any]) -> bool:
        types = self._muted.get(resource)
        return types is not None and (not types or event.get("type") in types)

    # ---------------------------------------------------------------- enrichment
    def _current(self, request: Any) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key in self._objects and not self._objects[key].deleted:
            return self._objects[key]
        return None

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _enrich(self, request: Any) -> Any:
        if (request.action == enums.action.UPDATE and _is_apply(request)
                and self._current(request) is None):
            request = attrs.evolve(request, action=enums.action.CREATE)  # apply creates
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            data = copy.deepcopy(request.data)
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(
                    random.choices(string.ascii_lowercase + string.digits, k=5))
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = str(next(self._rv))
            managed = _managed(request, [], request.data, str(data.get("apiVersion", "")))
            if managed is not None:
                meta["managedFields"] = managed
            if self._has_status(request.resource):
                data.pop("status", None)
            return attrs.evolve(request, data=data)
        if (request.action == enums.action.UPDATE and request.name is not None
                and isinstance(request.data, dict)):
            obj = self._current(request)
            if obj is None:
                return request
            data = copy.deepcopy(request.data)
            if self._has_status(request.resource):
                if request.subresource == "status":
                    data = {"status": data["status"]} if "status" in data else {}
                elif request.subresource is None:
                    data.pop("status", None)
            meta = data.get("metadata") or {}
            current = obj.raw.get("metadata", {})
            if request.subresource is None and "spec" in data and not (
                    _is_apply(request) and _merged(obj.raw.get("spec"), data["spec"])
                    == obj.raw.get("spec")):  # an apply that changes nothing is no new spec
                meta["generation"] = current.get("generation", 1) + 1
            meta["resourceVersion"] = str(next(self._rv))
            managed = _managed(request, list(current.get("managedFields") or []),
                               request.data, str(obj.raw.get("apiVersion", "")))
            if managed is not None:
                meta["managedFields"] = managed
            data["metadata"] = meta
            return attrs.evolve(request, data=data)
        return request

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None:
            async with self._lock:
                enriched = self._enrich(request)
            if enriched is not request:
                idx = next(i for i, r in enumerate(self._requests) if r is request)
                self._requests[idx] = request = enriched
        hold = next((h for h in self._holds if h.predicate(request)), None)
        if hold is not None:
            self._holds.remove(hold)  # one-shot
            hold.hits.append(f"{request.method} {request.url}")
            if hold.when == "before":
                await hold.gate.wait()
                if not hold.apply:
                    raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                                message="dropped by the test")
        try:
            response = await super()._handle(request)
        finally:
            if request.resource is not None and request.action in (
                    enums.action.DELETE, enums.action.UPDATE):
                await self.collect_garbage()
        if hold is not None and hold.when == "after":
            await hold.gate.wait()
        return response

    # ---------------------------------------------------------------- garbage collection
    async def collect_garbage(self) -> None:
        """Delete objects whose owners (by uid) are all gone, cascading; as kube-controller-
        manager's garbage collector does in the background."""
        changed = True
        while changed:
            changed = False
            async with self._lock:
                live = {o.raw.get("metadata", {}).get("uid")
                        for o in self._objects.values() if not o.deleted}
                for (resource, _, _), obj in list(self._objects.items()):
                    if obj.deleted:
                        continue
                    refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                    if not refs or any(r.get("uid") in live for r in refs):
                        continue
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
                    changed = True

    # ---------------------------------------------------------------- race-free watches
    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        yield b""
        bus = self._buses[request.resource]

        def matches(raw: dict[str, Any]) -> bool:
            meta = raw.get("metadata", {})
            return ((request.namespace is None or meta.get("namespace") == request.namespace)
                    and (request.name is None or meta.get("name") == request.name))

        async with self._lock:
            mark = await bus.mark()
            initial = [{"type": "ADDED", "object": o.raw}
                       for (res, _, _), o in self._objects.items()
                       if res == request.resource and not o.deleted and matches(o.raw)]
        try:
            for event in initial:
                if not self._mutes(request.resource, event):
                    yield event
            async for event in bus.stream(since=mark):
                if matches(event.get("object", {})) and not self._mutes(request.resource, event):
                    yield event
        finally:
            await bus.unmark(mark)


def _merged(old: Any, new: Any) -> Any:
    """`new` merged into `old` as the emulator stores an update (dicts merge, the rest is
    replaced; None deletes)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = dict(old)
    for key, value in new.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(old.get(key), value)
    return out


_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def declare_resources(emu: kmock.KubernetesEmulator) -> None:
    """Builtins (incl. kopf's backbone: namespaces, CRDs, events), our custom resources, and
    the ones we watch: KubeRay's, Kueue's Workloads."""
    emu.resources.load_bundled()
    for key, kind in (("kuberl.dev/v1alpha1/rljobs", "RLJob"), ("ray.io/v1/rayjobs", "RayJob"),
                      ("ray.io/v1/rayclusters", "RayCluster"),
                      ("kueue.x-k8s.io/v1beta2/workloads", "Workload")):
        emu.resources[key] = kmock.ResourceInfo(kind=kind, singular=kind.lower(),
                                                namespaced=True, subresources={"status"},
                                                verbs=_VERBS)


def objects(emu: kmock.KubernetesEmulator, resource: str,
            namespace: str | None = None) -> list[dict[str, Any]]:
    res = kmock.resource(resource)
    return [o.raw for (r, ns, _), o in list(emu.objects.items())
            if r == res and not o.deleted and (namespace is None or ns == namespace)]


def get(emu: kmock.KubernetesEmulator, resource: str, namespace: str,
        name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), namespace, name)
    if key in emu.objects and not emu.objects[key].deleted:
        raw: dict[str, Any] = emu.objects[key].raw
        return raw
    return None
