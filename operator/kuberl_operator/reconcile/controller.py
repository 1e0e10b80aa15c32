"""One reconcile pass per RLJob, serialized per object, and the timers that re-run it.

Shape of a pass (every trigger runs the same one): read the RLJob -> observe its children ->
`status.decide` (validate, compare, decide; pure) -> execute the actions (render + adopt +
create or apply, or delete; after creating an attempt, decide again with its RayJob in view)
-> one status patch -> Events -> metrics.

Triggers: RLJob and RayJob/RayCluster watch events (by the kuberl.dev/rljob label; not the
echoes of our own status patch or RayJob create), a wake-up
at the time the decision says something will expire (heartbeat, head grace, deadline, TTL), a
retry after an error, and a periodic resync of every known RLJob. Passes for one RLJob never
overlap (a lock per object), a burst of triggers collapses into one extra pass, and at most
PASSES_IN_FLIGHT passes run at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kuberl_operator.metrics import Metrics
from kuberl_operator.reconcile.children import adopt, apply, create_once
from kuberl_operator.reconcile.kube import CONCURRENCY, EVENT, KINDS, RAYJOB, RLJOB, Kube
from kuberl_operator.reconcile.observe import observe
from kuberl_operator.render import names, render_children
from kuberl_operator.settings import Config
from kuberl_operator.status import (
    ANNOTATION_RESTARTS,
    Action,
    CreateAttempt,
    Decision,
    DeleteEnvironment,
    DeleteRayJob,
    DeleteRLJob,
    Event,
    Observed,
    decide,
    fmt_time,
)

Key = tuple[str, str]  # (namespace, name)
# Passes in flight at once: as many as the API client has threads. With more, each pass's calls
# queue behind every other pass's in the client's FIFO, so in a burst of N new RLJobs every one
# finishes about as late as the last (and all N passes hold their state at once); with this
# many, they finish in the order they came.
PASSES_IN_FLIGHT = CONCURRENCY
COMPONENT = names.MANAGER
MAX_EVENT_MESSAGE = 1024


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace")), str(meta.get("name"))


def utcnow() -> datetime:
    return datetime.now(UTC)


class Controller:
    def __init__(self, kube: Kube, config: Config, metrics: Metrics,
                 logger: logging.Logger | None = None) -> None:
        self.kube = kube
        self.config = config
        self.metrics = metrics
        self.logger = logger or logging.getLogger("kuberl.operator")
        self.known: set[Key] = set()
        self._locks: dict[Key, asyncio.Lock] = {}
        self._waiting: set[Key] = set()
        self._wakeups: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The resourceVersion each RLJob got from our own last status patch: its watch event
        # only echoes what this operator just decided (a third of all passes at 300 jobs).
        self._written: dict[Key, str] = {}
        # (namespace, RayJob name) -> the resourceVersion our create returned (see _after_create).
        self._created: dict[Key, str] = {}
        # (namespace, RayJob name) -> resourceVersions of its watch events that arrived while
        # our create of it was still in flight.
        self._creating: dict[Key, list[str]] = {}
        # RLJob -> resourceVersions of its watch events that arrived while our status patch
        # of it was still in flight.
        self._patching: dict[Key, list[str]] = {}
        self._instance = socket.gethostname()
        self._slots = asyncio.Semaphore(PASSES_IN_FLIGHT)

    # ---------------------------------------------------------------- triggers

    def trigger(self, key: Key) -> None:
        """Reconcile soon, in the background (for watch handlers: never block the watch)."""
        task = asyncio.get_running_loop().create_task(self.reconcile(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reconcile(self, key: Key) -> None:
        if key in self._waiting:  # a pass is already queued and will read the newest state
            return
        self._waiting.add(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock, self._slots:
            self._waiting.discard(key)  # (only now: a trigger while it waited for a slot
            # is served by this pass, which has not read anything yet)
            started = time.monotonic()
            try:
                await self._pass(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.reconcile_total.labels("error").inc()
                self.logger.exception("reconcile of %s/%s failed: %s", *key, exc)
                self.wake_at(key, time.time() + self.config.error_backoff_seconds)
            else:
                self.metrics.reconcile_total.labels("success").inc()
            finally:
                self.metrics.reconcile_duration.observe(time.monotonic() - started)

    def wake_at(self, key: Key, when: float) -> None:
        """Reconcile `key` at wall-clock time `when` (keeps only the earliest pending wake-up)."""
        loop = asyncio.get_running_loop()
        pending = self._wakeups.get(key)
        if pending is not None:
            if pending[0] <= when and not pending[1].cancelled():
                return
            pending[1].cancel()
        delay = max(0.0, when - time.time()) + 0.05  # land just after the expiry
        handle = loop.call_later(delay, self._wake, key)
        self._wakeups[key] = (when, handle)

    def _wake(self, key: Key) -> None:
        self._wakeups.pop(key, None)
        self.trigger(key)

    async def resync_forever(self) -> None:
        """Level-triggered safety net: every known RLJob, every resync interval."""
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            for key in sorted(self.known):
                self.trigger(key)

    def echoes_own_write(self, key: Key, resource_version: object) -> bool:
        """An RLJob watch event that carries exactly the state our last status patch wrote
        (nothing else changed it since): no pass needed."""
        if resource_version is None:
            return False
        early = self._patching.get(key)
        if early is not None:  # the watch beat the patch's response: judged when it returns
            early.append(str(resource_version))
            return True
        return self._written.get(key) == resource_version

    def forget(self, key: Key) -> None:
        self.known.discard(key)
        self._written.pop(key, None)
        pending = self._wakeups.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self.metrics.forget(*key)

    async def close(self) -> None:
        for _, handle in self._wakeups.values():
            handle.cancel()
        self._wakeups.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---------------------------------------------------------------- one pass

    async def _pass(self, key: Key) -> None:
        namespace, name = key
        body = await self.kube.get(RLJOB.url(namespace, name))
        if body is None:
            self.forget(key)
            return
        if body.get("metadata", {}).get("deletionTimestamp"):
            return  # going away; owner references let GC take the children
        self.known.add(key)
        observed = await observe(self.kube, body)
        decision = decide(body, observed, utcnow(), self.config.tunables)
        created: list[Mapping[str, Any]] = []
        try:
            for action in decision.actions:
                rayjob = await self._execute(body, decision, action)
                if rayjob is not None:
                    created.append(rayjob)
                if isinstance(action, DeleteRLJob):
                    await self._post_events(body, decision.events)
                    self.forget(key)
                    return
            if created:
                decision = self._after_create(key, body, observed, decision, created)
        finally:
            for rayjob in created:  # a later action failed: nothing may stay held back
                if self._creating.pop(object_key(rayjob), None):
                    self.trigger(key)
        patch = decision.status_patch(body.get("status"))
        if patch is not None:
            self._patching[key] = []  # in flight: see echoes_own_write
            try:
                patched = await self.kube.patch(RLJOB.url(namespace, name, "status"),
                                                {"status": patch})
            finally:
                early = self._patching.pop(key, [])
            rv = ((patched or {}).get("metadata") or {}).get("resourceVersion")
            if rv:
                self._written[key] = str(rv)
            if any(r != str(rv) for r in early):  # someone else's change came meanwhile
                self.trigger(key)
        await self._post_events(body, decision.events)
        self.metrics.observe_status(namespace, name, decision.status,
                                    (body.get("status") or {}).get("progress"))
        if decision.requeue_at is not None:
            self.wake_at(key, decision.requeue_at.timestamp())
        if decision.actions or patch:
            self.logger.info("%s/%s: phase %s, actions %s", namespace, name, decision.phase,
                             [type(a).__name__ for a in decision.actions] or "none")

    def _after_create(self, key: Key, body: Mapping[str, Any], observed: Observed,
                      decision: Decision, created: list[Mapping[str, Any]]) -> Decision:
        """The decision the RayJob's own ADDED event would lead to, made now: the status then
        says what the next pass would say (one status patch per new attempt, not two), and that
        event, an echo of our create, is skipped (`echoes_own_child`). Kept only when it asks
        for nothing more; otherwise that event runs a pass as usual."""
        status = {**(body.get("status") or {}), **decision.status}
        seen = dataclasses.replace(observed, rayjobs=(*observed.rayjobs, *created), pods=())
        again = decide({**body, "status": status}, seen, utcnow(), self.config.tunables)
        absorbed = not again.actions
        for rayjob in created:
            child = object_key(rayjob)
            rv = str((rayjob.get("metadata") or {}).get("resourceVersion") or "")
            # Events of it that came while its create was in flight were held back (the watch
            # can beat the create's own response): only our create's echo is accounted for.
            early = self._creating.pop(child, [])
            if absorbed and not early and rv:
                self._created[child] = rv  # its echo is still to come
            elif (early and not absorbed) or any(r != rv for r in early):
                self.trigger(key)  # (runs after this pass)
        if not absorbed:
            return decision
        return dataclasses.replace(again, events=(*decision.events, *again.events))

    def echoes_own_child(self, namespace: str, name: str, resource_version: object) -> bool:
        """A RayJob watch event that only reports the RayJob this operator just created, as it
        created it (its `_after_create` decision has accounted for it already). One that comes
        while that create is still in flight is held for `_after_create` to judge."""
        early = self._creating.get((namespace, name))
        if early is not None:
            early.append(str(resource_version))
            return True
        written = self._created.pop((namespace, name), None)
        return written is not None and written == resource_version

    async def _execute(self, body: Mapping[str, Any], decision: Decision,
                       action: Action) -> Mapping[str, Any] | None:
        """Carry out one action; a CreateAttempt returns the RayJob it created."""
        namespace = body["metadata"]["namespace"]
        if isinstance(action, CreateAttempt):
            return await self._create_attempt(body, decision, action)
        if isinstance(action, DeleteRayJob):
            await self.kube.delete(RAYJOB.url(namespace, action.name))
        elif isinstance(action, DeleteRLJob):
            await self.kube.delete(RLJOB.url(namespace, body["metadata"]["name"]))
        elif isinstance(action, DeleteEnvironment):
            for kind in (("apps/v1", "Deployment"), ("v1", "Service")):
                await self.kube.delete(KINDS[kind].url(namespace, action.name))
        return None

    async def _create_attempt(self, body: Mapping[str, Any], decision: Decision,
                              action: CreateAttempt) -> Mapping[str, Any] | None:
        """Render every child, adopt it, apply it (server-side); the RayJob comes last and is
        returned as stored."""
        job = decision.job
        assert job is not None, "a create needs a valid spec"
        rayjob = None
        key = secrets.token_urlsafe(32)  # the attempt's engine API key (render/secret.py)
        for child in render_children(job, action.attempt, self.config.ingress,
                                     engine_api_key=key, waived=decision.waived):
            obj = adopt(child, body)
            if obj.get("kind") == "Secret":
                await create_once(self.kube, obj)
            elif obj.get("kind") == "RayJob":
                expected = names.rayjob(job.name, action.attempt)
                if obj["metadata"].get("name") != expected:
                    raise RuntimeError(f"renderer named the RayJob {obj['metadata'].get('name')}"
                                       f", expected {expected}")
                annotations = obj["metadata"].setdefault("annotations", {})
                annotations[ANNOTATION_RESTARTS] = str(action.restarts)
                child_key = object_key(obj)
                self._creating[child_key] = []  # in flight: see echoes_own_child
                try:
                    rayjob = await apply(self.kube, obj)
                except BaseException:
                    self._creating.pop(child_key, None)  # the pass fails and is retried
                    raise
            else:
                await apply(self.kube, obj)
        return rayjob

    async def _post_events(self, body: Mapping[str, Any], events: tuple[Event, ...]) -> None:
        """Post core/v1 Events about the RLJob. Best effort: a lost Event never fails a pass."""
        meta = body["metadata"]
        for event in events:
            now = fmt_time(utcnow())
            message = event.message
            if len(message) > MAX_EVENT_MESSAGE:
                message = message[:MAX_EVENT_MESSAGE - 3] + "..."
            payload = {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": body["apiVersion"], "kind": body["kind"],
                                   "name": meta["name"], "namespace": meta["namespace"],
                                   "uid": meta["uid"]},
                "type": event.type, "reason": event.reason, "message": message,
                "source": {"component": COMPONENT},
                "reportingComponent": COMPONENT, "reportingInstance": self._instance,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            }
            try:
                await self.kube.create(EVENT.collection(meta["namespace"]), payload)
            except Exception as exc:
                self.logger.warning("could not post Event %s on %s/%s: %s", event.reason,
                                    meta["namespace"], meta["name"], exc)
            level = logging.WARNING if event.type == "Warning" else logging.INFO
            self.logger.log(level, "%s/%s: %s: %s", meta["namespace"], meta["name"],
                            event.reason, message)
