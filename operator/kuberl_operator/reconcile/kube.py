"""A tiny Kubernetes API client on top of kopf's own authenticated HTTP session.

kopf already logs in (service account or kubeconfig), re-authenticates on 401, retries 5xx and
429 with the operator's backoffs, and shares one aiohttp session; `kopf._cogs.clients.api` is
where it does that. Going through it keeps one connection pool and one set of credentials, and
avoids a second client library (`kubernetes`/`kubernetes_asyncio`) just for six verbs. It is
kopf's internal module, pinned by the exact kopf version in pyproject.toml: this file is the
only place that touches it, so a kopf upgrade that moves it breaks here and nowhere else.
Calls must run inside the operator (handlers, or tasks started by them), where kopf has set up
its credentials vault.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kopf._cogs.clients import api, errors

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}

APIError = errors.APIError
Conflict = errors.APIConflictError
NotFound = errors.APINotFoundError


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


class Kube:
    """get / list / create / patch (JSON merge patch) / delete, as plain dicts."""

    def __init__(self, settings: kopf.OperatorSettings, logger: logging.Logger) -> None:
        self.settings = settings
        self.logger = logger

    async def get(self, url: str) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = await api.get(url, settings=self.settings, logger=self.logger)
        except NotFound:
            return None
        return body

    async def list(self, url: str, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """List a collection. The label selector is also applied here, for API emulators that
        ignore it."""
        if labels:
            selector = ",".join(f"{k}={v}" for k, v in labels.items())
            url = f"{url}?{urllib.parse.urlencode({'labelSelector': selector})}"
        body = await api.get(url, settings=self.settings, logger=self.logger)
        items = [i for i in (body or {}).get("items") or [] if isinstance(i, dict)]
        if not labels:
            return items
        return [i for i in items
                if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v
                       for k, v in labels.items())]

    async def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await api.post(url, payload=dict(body), settings=self.settings,
                                                 logger=self.logger)
        return created

    async def patch(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = await api.patch(url, payload=dict(patch),
                                                   headers=MERGE_PATCH, settings=self.settings,
                                                   logger=self.logger)
        except NotFound:
            return None
        return body

    async def delete(self, url: str) -> bool:
        """Delete with background propagation (dependents go by GC); False if already gone."""
        try:
            await api.delete(url, payload={"propagationPolicy": "Background"},
                             settings=self.settings, logger=self.logger)
        except NotFound:
            return False
        return True
