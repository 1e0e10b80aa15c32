"""Children are written by server-side apply as the operator's own field manager, through the
`kubernetes` client (reconcile.kube), and the RayJob's spec.suspend is never re-asserted: Kueue
owns it once the RayJob exists. Against the API emulator, in process; the e2e tier checks the
same against a real kube-apiserver's field management."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from kuberl_operator.reconcile.children import ChildConflict, adopt, apply
from kuberl_operator.reconcile.kube import APPLY_PATCH, FIELD_MANAGER, Kube, NotFound
from tests.integration.emulator import Emulator, get
from tests.integration.helpers import MERGE, NS, RAYJOBS, RLJOBS, create, manifest, url

pytestmark = pytest.mark.integration

CONFIGMAPS = "v1/configmaps"


@pytest.fixture
async def kube(k8s: Emulator, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Kube]:
    """The operator's client, logged in to the emulator as the operator is (a kubeconfig)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": str(k8s.url).rstrip("/")}}],
        "users": [{"name": "emu", "user": {}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never the in-cluster login
    client = Kube.from_environment(logging.getLogger("test"), backoffs=[0.05])
    yield client
    client.close()


def rayjob(owner: dict[str, Any], suspend: bool) -> dict[str, Any]:
    return adopt({"apiVersion": "ray.io/v1", "kind": "RayJob",
                  "metadata": {"name": "sa-r0", "labels": {"kuberl.dev/rljob": "sa"}},
                  "spec": {"suspend": suspend, "entrypoint": "python -m loop"}}, owner)


def configmap(owner: dict[str, Any], value: str) -> dict[str, Any]:
    return adopt({"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "sa-job", "labels": {"kuberl.dev/rljob": "sa"}},
                  "data": {"job.yaml": value}}, owner)


def writes(emu: Emulator, resource: str, name: str) -> list[Any]:
    return [r for r in emu if r.resource == kmock.resource(resource)
            and r.method in ("POST", "PATCH")
            and (r.name == name or (r.data or {}).get("metadata", {}).get("name") == name)]


def managers(obj: dict[str, Any]) -> set[tuple[str, str]]:
    return {(e["manager"], e["operation"]) for e in obj["metadata"].get("managedFields") or []}


async def test_existing_rayjobs_suspend_is_left_to_kueue(k8s: Emulator, kube: Kube) -> None:
    owner = await create(k8s, RLJOBS, manifest("sa"))
    await apply(kube, rayjob(owner, suspend=True))  # new: created suspended, by a POST
    (post,) = writes(k8s, RAYJOBS, "sa-r0")
    assert post.method == "POST" and post.params["fieldManager"] == FIELD_MANAGER
    assert (get(k8s, RAYJOBS, NS, "sa-r0") or {})["spec"]["suspend"] is True

    # Kueue admits the workload: it unsuspends the RayJob, as its own manager.
    resp = await k8s.patch(url(RAYJOBS, "sa-r0"), json={"spec": {"suspend": False}},
                           headers=MERGE, params={"fieldManager": "kueue-admission"})
    assert resp.status == 200, await resp.text()

    # A later pass renders the RayJob again (still suspend: true) and applies it.
    await apply(kube, rayjob(owner, suspend=True))
    stored = get(k8s, RAYJOBS, NS, "sa-r0") or {}
    assert stored["spec"]["suspend"] is False, "the operator never fights Kueue over suspend"
    last = writes(k8s, RAYJOBS, "sa-r0")[-1]
    assert last.method == "PATCH" and last.headers["Content-Type"].startswith(APPLY_PATCH)
    assert last.params == {"fieldManager": FIELD_MANAGER, "force": "true"}
    sent = json.loads(last.text)
    assert "suspend" not in sent["spec"] and sent["spec"]["entrypoint"]
    assert {(FIELD_MANAGER, "Update"), (FIELD_MANAGER, "Apply"),
            ("kueue-admission", "Update")} <= managers(stored)


async def test_children_are_applied_and_keep_other_managers_fields(k8s: Emulator,
                                                                    kube: Kube) -> None:
    owner = await create(k8s, RLJOBS, manifest("sa"))
    await apply(kube, configmap(owner, "v1"))  # new: one POST, no read before it
    (first,) = writes(k8s, CONFIGMAPS, "sa-job")
    assert first.method == "POST" and first.params["fieldManager"] == FIELD_MANAGER
    assert not [r for r in k8s if r.method == "GET" and r.name == "sa-job"]
    stored = get(k8s, CONFIGMAPS, NS, "sa-job") or {}
    assert stored["data"] == {"job.yaml": "v1"}
    assert managers(stored) == {(FIELD_MANAGER, "Update")}
    assert stored["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

    # Another controller labels it; someone edits our field. A re-apply restores ours (force)
    # and leaves theirs.
    resp = await k8s.patch(url(CONFIGMAPS, "sa-job"), headers=MERGE,
                           json={"metadata": {"labels": {"team": "a"}},
                                 "data": {"job.yaml": "edited"}})
    assert resp.status == 200, await resp.text()
    await apply(kube, configmap(owner, "v2"))  # exists: server-side apply, forced
    stored = get(k8s, CONFIGMAPS, NS, "sa-job") or {}
    assert stored["data"] == {"job.yaml": "v2"}
    assert stored["metadata"]["labels"] == {"kuberl.dev/rljob": "sa", "team": "a"}
    last = writes(k8s, CONFIGMAPS, "sa-job")[-1]
    assert last.method == "PATCH" and last.headers["Content-Type"].startswith(APPLY_PATCH)
    assert (FIELD_MANAGER, "Apply") in managers(stored)
    sent = json.loads(last.text)  # as sent, not as stored
    assert sorted(sent["metadata"]) == ["labels", "name", "namespace", "ownerReferences"]


async def test_a_child_of_another_owner_is_never_taken_over(k8s: Emulator, kube: Kube) -> None:
    owner = await create(k8s, RLJOBS, manifest("sa"))
    other = await create(k8s, RLJOBS, manifest("other"))
    await create(k8s, CONFIGMAPS, configmap(other, "theirs"))
    with pytest.raises(ChildConflict, match="another owner"):
        await apply(kube, configmap(owner, "ours"))
    await create(k8s, RAYJOBS, adopt(rayjob(owner, True), other) | {
        "metadata": {**rayjob(owner, True)["metadata"],
                     "ownerReferences": adopt({}, other)["metadata"]["ownerReferences"]}})
    with pytest.raises(ChildConflict, match="another owner"):
        await apply(kube, rayjob(owner, suspend=True))
    assert (get(k8s, CONFIGMAPS, NS, "sa-job") or {})["data"] == {"job.yaml": "theirs"}


async def test_verbs_map_statuses(k8s: Emulator, kube: Kube) -> None:
    """404 reads as None / False, and the client's errors carry the HTTP status."""
    assert await kube.get(url(RLJOBS, "absent")) is None
    assert await kube.delete(url(RLJOBS, "absent")) is False
    assert await kube.patch(url(RLJOBS, "absent", "status"), {"status": {}}) is None
    with pytest.raises(NotFound) as gone:
        await kube.list(url("example.com/v1/nothings"))
    assert gone.value.status == 404
