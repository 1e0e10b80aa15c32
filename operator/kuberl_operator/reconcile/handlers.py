"""kopf handlers: thin triggers into the Controller (all decisions live in `status.decide`).

Only `on.event` handlers watch resources: kopf then adds no finalizer (it does for on.delete,
timers and daemons) and writes no progress or diff-base annotations. Cleanup is by owner
references and Kubernetes' garbage collector, so deleting an RLJob never waits on the operator.
Time-based work (heartbeat age, head grace, deadlines, TTL, resync) is the Controller's own
wake-ups instead of `kopf.timer`, for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kuberl_api.rljob import GROUP, PLURAL, VERSION
from kuberl_operator.metrics import Metrics
from kuberl_operator.reconcile.controller import Controller
from kuberl_operator.reconcile.kube import Kube
from kuberl_operator.reconcile.observe import WORKLOAD
from kuberl_operator.render import names
from kuberl_operator.settings import Config

LOGGER = logging.getLogger("kuberl.operator")
WORKLOAD_GROUP, WORKLOAD_VERSION = WORKLOAD.api_version.split("/")


def register(registry: kopf.OperatorRegistry, config: Config, metrics: Metrics) -> None:
    """Register the operator's handlers into `registry` (one registry per operator run)."""
    state: dict[str, Any] = {}

    def controller() -> Controller:
        ctl: Controller = state["controller"]
        return ctl

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own credentials, for its watches only; the Controller's reads and writes go
        # through the `kubernetes` client (Kube), which finds the same ones the same way.
        # In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        net = settings.networking
        backoffs = ([float(net.error_backoffs)] if isinstance(net.error_backoffs, int | float)
                    else [float(b) for b in net.error_backoffs])  # kopf's retries, reused
        timeout = (float(net.connect_timeout or 5), float(net.request_timeout or 30))
        # Loading credentials reads files (and may run a kubeconfig's exec plugin): off the loop.
        kube = await asyncio.to_thread(Kube.from_environment, LOGGER,
                                       backoffs=backoffs, timeout=timeout)
        state["kube"] = kube
        ctl = Controller(kube, config, metrics, LOGGER)
        state["controller"] = ctl
        state["resync"] = asyncio.create_task(ctl.resync_forever(), name="kuberl resync")
        LOGGER.info("kuberl operator started: namespaces %s, resync %ss, head grace %ss",
                    list(config.namespaces) or "all", config.resync_seconds,
                    config.head_lost_grace_seconds)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        resync = state.pop("resync", None)
        if resync is not None:
            resync.cancel()
        if "controller" in state:
            await controller().close()
        if "kube" in state:
            state.pop("kube").close()

    @kopf.on.probe(id="rljobs", registry=registry)
    def probe(**_: Any) -> int:
        return len(controller().known) if "controller" in state else 0

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def rljob_event(type: str | None, body: kopf.Body, **_: Any) -> None:
        key = (str(body.metadata.namespace), str(body.metadata.name))
        if type == "MODIFIED" and controller().echoes_own_write(
                key, body.metadata.get("resourceVersion")):
            return
        if type != "DELETED":
            controller().known.add(key)
        # A deleted RLJob is forgotten (wake-up, metrics) by the pass that finds it gone, which
        # runs after any pass still in flight; forgotten here, that pass would set its metrics
        # again as it ends, and nothing would remove them.
        controller().trigger(key)

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={names.LABEL_JOB: kopf.PRESENT},
                   registry=registry)
    async def rayjob_event(body: kopf.Body, **_: Any) -> None:
        if controller().echoes_own_child(str(body.metadata.namespace), str(body.metadata.name),
                                         body.metadata.get("resourceVersion")):
            return
        child_changed(body)

    # KubeRay copies the RayJob's labels onto the RayCluster it makes: ClusterReady follows the
    # cluster's own changes (head ready, workers ready) at once, not at the next RayJob update
    # or resync (up to 20 s late at 300 jobs without this).
    @kopf.on.event("ray.io", "v1", "rayclusters", labels={names.LABEL_JOB: kopf.PRESENT},
                   registry=registry)
    async def raycluster_event(body: kopf.Body, **_: Any) -> None:
        child_changed(body)

    # Kueue's Workload of a queued RayJob changes (its pending reason and message, admission,
    # eviction) with no RayJob event: the RLJob shows it at once, not at the next resync.
    # Without Kueue installed, kopf says once at startup that it cannot serve this resource
    # (and, when scanning, starts the watch if Kueue's CRDs come later).
    @kopf.on.event(WORKLOAD_GROUP, WORKLOAD_VERSION, WORKLOAD.plural, registry=registry)
    async def workload_event(body: kopf.Body, **_: Any) -> None:
        namespace = str(body.metadata.namespace)
        for ref in body.metadata.get("ownerReferences") or []:
            if ref.get("kind") != "RayJob" or not str(ref.get("apiVersion")).startswith("ray.io/"):
                continue
            job = names.job_of_rayjob(str(ref.get("name")))
            if job is not None and (namespace, job) in controller().known:
                controller().trigger((namespace, job))

    def child_changed(body: kopf.Body) -> None:
        job = body.metadata.labels.get(names.LABEL_JOB)
        if job:
            controller().trigger((str(body.metadata.namespace), job))
