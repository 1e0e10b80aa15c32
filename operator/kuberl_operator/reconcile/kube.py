"""A small facade over the official Kubernetes client: get / list / create / patch / apply /
delete by URL path, as plain dicts, awaitable from kopf's event loop.

Why the `kubernetes` package and not kopf's HTTP session: that lives in kopf's private
`_cogs` module, which any kopf release may move; the maintained client is public API, refreshes
bound ServiceAccount tokens (they rotate, and a token read once expires), and is what the
trainer uses too. kopf keeps its own login for its watches; this is a second, independent
connection pool.

Why URL paths (`ApiClient.param_serialize` + `call_api`) and not the generated typed APIs or
DynamicClient: the controller speaks in paths (`Kind.url`), children are plain dicts from the
renderers, and some kinds (RayJob, Kueue's Workload) have no typed API anyway; DynamicClient
would add a discovery round trip per kind for nothing.

The client is synchronous. Every call runs on a dedicated thread pool, sized together with
urllib3's connection pool, so a burst of passes (1,000 RLJobs created at once) neither blocks
the event loop nor queues behind a handful of sockets. 429 and 5xx answers, and lost
connections, are retried with the operator's backoffs, as kopf did.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config

# Every write the operator makes is recorded under this manager in metadata.managedFields, so
# `kubectl get -o yaml --show-managed-fields` tells our fields from Kueue's and KubeRay's.
FIELD_MANAGER = "kuberl-operator"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # the body is JSON, which is valid YAML
# Concurrent API calls (threads and pooled connections alike). Passes are serialized per RLJob,
# so this bounds how many RLJobs progress at once, not correctness.
CONCURRENCY = 32
BACKOFFS = (0.5, 1.0, 2.0, 5.0)  # kopf's settings.networking.error_backoffs default here
TIMEOUT = (5.0, 30.0)  # (connect, read) seconds
_RETRIED = frozenset({429, 500, 502, 503, 504})


class APIError(Exception):
    """The API server refused a request (`status` is its HTTP status, 0 if it never answered)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body


class NotFound(APIError):
    """404."""


class Conflict(APIError):
    """409: exists already, or a stale resourceVersion."""


def _error(status: int, text: str) -> APIError:
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message = (body or {}).get("message") if isinstance(body, dict) else None
    cls = NotFound if status == 404 else Conflict if status == 409 else APIError
    return cls(status, str(message or text or "no message"), body)


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1" or "group/version"
    plural: str

    def collection(self, namespace: str) -> str:
        root = "/api" if "/" not in self.api_version else "/apis"
        return f"{root}/{self.api_version}/namespaces/{namespace}/{self.plural}"

    def url(self, namespace: str, name: str, subresource: str | None = None) -> str:
        tail = f"/{subresource}" if subresource else ""
        return f"{self.collection(namespace)}/{urllib.parse.quote(name)}{tail}"


RLJOB = Kind("kuberl.dev/v1alpha1", "rljobs")
RAYJOB = Kind("ray.io/v1", "rayjobs")
RAYCLUSTER = Kind("ray.io/v1", "rayclusters")
EVENT = Kind("v1", "events")

# Every kind the renderers produce, by (apiVersion, kind).
KINDS: dict[tuple[str, str], Kind] = {
    ("v1", "ServiceAccount"): Kind("v1", "serviceaccounts"),
    ("v1", "ConfigMap"): Kind("v1", "configmaps"),
    ("v1", "Secret"): Kind("v1", "secrets"),
    ("v1", "Service"): Kind("v1", "services"),
    ("apps/v1", "Deployment"): Kind("apps/v1", "deployments"),
    ("networking.k8s.io/v1", "NetworkPolicy"): Kind("networking.k8s.io/v1", "networkpolicies"),
    ("rbac.authorization.k8s.io/v1", "Role"): Kind("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("ray.io/v1", "RayJob"): RAYJOB,
    ("ray.io/v1", "RayCluster"): RAYCLUSTER,
    ("kuberl.dev/v1alpha1", "RLJob"): RLJOB,
    ("v1", "Event"): EVENT,
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    if key not in KINDS:
        raise ValueError(f"no API path known for {key[1]} ({key[0]})")
    return KINDS[key]


def load_configuration(concurrency: int = CONCURRENCY) -> client.Configuration:
    """Credentials as kopf finds them: the pod's ServiceAccount (its token re-read as it
    rotates), else $KUBECONFIG or ~/.kube/config."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        # Read $KUBECONFIG now: the client's default was fixed when it was imported.
        path = os.environ.get("KUBECONFIG") or None
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=cfg)
    cfg.connection_pool_maxsize = concurrency  # one socket per worker thread, none waiting
    return cfg


class Kube:
    """get / list / create / patch (JSON merge patch) / apply (server-side) / delete."""

    def __init__(self, api: client.ApiClient, logger: logging.Logger, *,
                 concurrency: int = CONCURRENCY, backoffs: Sequence[float] = BACKOFFS,
                 timeout: tuple[float, float] = TIMEOUT) -> None:
        self.api = api
        self.logger = logger
        self.backoffs = tuple(backoffs)
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="kuberl-kube")

    @classmethod
    def from_environment(cls, logger: logging.Logger, *, concurrency: int = CONCURRENCY,
                         backoffs: Sequence[float] = BACKOFFS,
                         timeout: tuple[float, float] = TIMEOUT) -> Kube:
        api = client.ApiClient(load_configuration(concurrency))
        api.user_agent = FIELD_MANAGER  # who did it, in the API server's audit log
        return cls(api, logger, concurrency=concurrency, backoffs=backoffs, timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.api.close()  # type: ignore[no-untyped-call]

    # ---------------------------------------------------------------- verbs

    async def get(self, url: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", url)
        except NotFound:
            return None

    async def list(self, url: str, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """List a collection. The label selector is also applied here, for API emulators that
        ignore it."""
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels \
            else None
        body = await self._call("GET", url, query=query)
        items = [i for i in (body or {}).get("items") or [] if isinstance(i, dict)]
        if not labels:
            return items
        return [i for i in items
                if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v
                       for k, v in labels.items())]

    async def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created = await self._call("POST", url, body=body, query={"fieldManager": FIELD_MANAGER})
        return created or {}

    async def patch(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch (the RLJob's status); None if the object is gone."""
        try:
            return await self._call("PATCH", url, body=patch, content_type=MERGE_PATCH,
                                    query={"fieldManager": FIELD_MANAGER})
        except NotFound:
            return None

    async def apply(self, url: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of `obj` (the fields we own, and only those) as FIELD_MANAGER.
        Creates the object if missing. force: fields we assert are ours, even if another
        manager last set them; fields we leave out stay with whoever owns them."""
        applied = await self._call("PATCH", url, body=obj, content_type=APPLY_PATCH,
                                   query={"fieldManager": FIELD_MANAGER, "force": "true"})
        return applied or {}

    async def delete(self, url: str) -> bool:
        """Delete with background propagation (dependents go by GC); False if already gone."""
        try:
            await self._call("DELETE", url, query={"propagationPolicy": "Background"})
        except NotFound:
            return False
        return True

    # ---------------------------------------------------------------- transport

    async def _call(self, method: str, url: str, *, body: Mapping[str, Any] | None = None,
                    query: Mapping[str, str] | None = None,
                    content_type: str = "application/json") -> dict[str, Any] | None:
        """One request, retried on 429/5xx and lost connections after each backoff."""
        loop = asyncio.get_running_loop()
        request = functools.partial(self._request, method, url, body, query, content_type)
        for delay in (*self.backoffs, None):
            try:
                return await loop.run_in_executor(self._pool, request)
            except APIError as exc:
                if delay is None or (exc.status not in _RETRIED and exc.status != 0):
                    raise
                self.logger.warning("%s %s: %s; retrying in %ss", method, url, exc, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _request(self, method: str, url: str, body: Mapping[str, Any] | None,
                 query: Mapping[str, str] | None, content_type: str) -> dict[str, Any] | None:
        """Blocking: runs on the pool. Auth goes through the client's BearerToken setting, whose
        refresh hook re-reads a rotated in-cluster token."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        req = self.api.param_serialize(method, url, query_params=list((query or {}).items()),
                                       header_params=headers,
                                       body=dict(body) if body is not None else None,
                                       auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(*req, _request_timeout=self.timeout)
            data = resp.read()  # type: ignore[no-untyped-call]
        except client.ApiException as exc:  # raised by the client before any answer (TLS)
            raise APIError(0, str(exc.reason)) from exc
        except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out
            raise APIError(0, f"{type(exc).__name__}: {exc}") from exc
        text = data.decode("utf-8", "replace") if data else ""
        if not 200 <= resp.status < 300:
            raise _error(resp.status, text)
        parsed = json.loads(text) if text else None
        return parsed if isinstance(parsed, dict) else None
