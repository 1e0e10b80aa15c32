"""Killing the operator at any point, then starting it again, neither duplicates nor orphans
children: every pass recomputes the state from the objects."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kmock
import pytest

from kuberl_operator.render import names
from tests.integration.emulator import Emulator
from tests.integration.helpers import (
    NS,
    RAYJOBS,
    RESYNC,
    RLJOBS,
    Operator,
    create,
    eventually,
    kuberay,
    manifest,
    objects,
    rayjobs,
    status,
    wait_phase,
)

pytestmark = pytest.mark.integration

KINDS = ["v1/serviceaccounts", "rbac.authorization.k8s.io/v1/roles",
         "rbac.authorization.k8s.io/v1/rolebindings", "v1/configmaps", RAYJOBS]


def posts(emu: Emulator, resource: str) -> int:
    return sum(1 for r in emu if r.action == kmock.action.CREATE
               and r.resource == kmock.resource(resource))


def owned(emu: Emulator, resource: str, job: str) -> list[str]:
    return [o["metadata"]["name"] for o in objects(emu, resource, NS)
            if (o["metadata"].get("labels") or {}).get(names.LABEL_JOB) == job]


@pytest.mark.parametrize("when", ["before", "after"],
                         ids=["killed-before-rayjob-create", "killed-before-create-response"])
async def test_killed_mid_create_then_restarted(k8s: Emulator, tmp_path: Path,
                                                when: str) -> None:
    hold = k8s.hold(lambda r: r.action == kmock.action.CREATE
                    and r.resource == kmock.resource(RAYJOBS), when)
    op = Operator(k8s, tmp_path, [])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("jk"))
        await eventually(lambda: hold.hits, what="the RayJob create is in flight")
        await op.kill()  # SIGKILL: no cleanup, no status patch
        assert status(k8s, "jk") == {}, "killed before its status patch"
        assert len(owned(k8s, "v1/configmaps", "jk")) == 1
        hold.release(apply=(when == "after"))
        assert rayjobs(k8s) == (["jk-r0"] if when == "after" else [])

        await op.start()
        st = await wait_phase(k8s, "jk", "Provisioning")
        assert st["rayJobName"] == "jk-r0" and st["restarts"] == 0
        await asyncio.sleep(3 * RESYNC)  # several more passes change nothing
        assert rayjobs(k8s) == ["jk-r0"]
        for resource in KINDS:
            assert len(owned(k8s, resource, "jk")) == 1, resource
        # "before": the restarted operator creates it; "after": it finds and adopts it.
        assert posts(k8s, RAYJOBS) == (2 if when == "before" else 1)
    finally:
        await op.stop()


async def test_restarted_operator_converges_on_running_job(k8s: Emulator,
                                                           tmp_path: Path) -> None:
    op = Operator(k8s, tmp_path, [])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("jr", backoffLimit=1))
        await wait_phase(k8s, "jr", "Provisioning")
        await op.kill()
        # While the operator is down, KubeRay reports the job failed.
        await kuberay(k8s, "jr-r0", "FAILED", "Failed")
        await op.start()
        st = await wait_phase(k8s, "jr", "Restarting")
        assert st["restarts"] == 1
        await eventually(lambda: rayjobs(k8s) == ["jr-r1"])
        await op.kill()
        await op.start()
        await asyncio.sleep(3 * RESYNC)
        assert rayjobs(k8s) == ["jr-r1"] and status(k8s, "jr")["restarts"] == 1
    finally:
        await op.stop()
