"""The real operator process against the API emulator: RLJob in, children and status out."""

from __future__ import annotations

import asyncio

import pytest

from kuberl_operator.render import names
from tests.integration.emulator import Emulator
from tests.integration.helpers import (
    NS,
    RAYJOBS,
    RESYNC,
    RLJOBS,
    Operator,
    condition,
    create,
    delete,
    events,
    eventually,
    get,
    heartbeat,
    kuberay,
    make_cluster,
    manifest,
    patch,
    rayjobs,
    status,
    wait_phase,
)

pytestmark = pytest.mark.integration

def reasons(emu: Emulator, name: str) -> list[str]:
    return [e["reason"] for e in events(emu, name)]


CHILDREN = [("v1/serviceaccounts", "{}-head"), ("rbac.authorization.k8s.io/v1/roles", "{}-status"),
            ("rbac.authorization.k8s.io/v1/rolebindings", "{}-status"),
            ("v1/configmaps", "{}-config"), (RAYJOBS, "{}-r0")]


async def test_create_makes_owned_children_and_status(k8s: Emulator, operator: Operator) -> None:
    job = await create(k8s, RLJOBS, manifest("j1"))
    uid = job["metadata"]["uid"]
    st = await wait_phase(k8s, "j1", "Provisioning")
    assert st["rayJobName"] == names.rayjob("j1", 0)
    assert condition(k8s, "j1", "Accepted")["status"] == "True"
    for resource, pattern in CHILDREN:
        child = get(k8s, resource, NS, pattern.format("j1"))
        assert child is not None, (resource, pattern)
        refs = child["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "name": "j1",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    assert not (get(k8s, RLJOBS, NS, "j1") or {})["metadata"].get("finalizers")
    await eventually(lambda: [e for e in events(k8s, "j1") if e["reason"] == "Created"])


async def test_status_follows_kuberay_to_success(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j2"))
    await wait_phase(k8s, "j2", "Provisioning")
    await kuberay(k8s, "j2-r0", "", "Initializing")
    await make_cluster(k8s, "j2-r0-abcde", head_ready=True)
    await kuberay(k8s, "j2-r0", "PENDING", "Running", cluster="j2-r0-abcde")
    await eventually(lambda: condition(k8s, "j2", "ClusterReady").get("status") == "True")
    assert status(k8s, "j2")["phase"] == "Provisioning"
    await kuberay(k8s, "j2-r0", "RUNNING", "Running", cluster="j2-r0-abcde", started=0)
    await heartbeat(k8s, "j2", step=3)
    await wait_phase(k8s, "j2", "Running")
    assert condition(k8s, "j2", "Training")["status"] == "True"
    text = await operator.metrics()
    assert 'kuberl_rljob_status_phase{name="j2",namespace="default",phase="Running"} 1.0' in text
    assert ('kuberl_rljob_condition{name="j2",namespace="default",status="True",'
            'type="Training"} 1.0') in text
    assert 'kuberl_operator_reconcile_total{result="success"}' in text
    assert "kuberl_operator_reconcile_duration_seconds_bucket" in text
    assert await operator.health() == 200

    await kuberay(k8s, "j2-r0", "SUCCEEDED", "Complete", cluster="j2-r0-abcde")
    st = await wait_phase(k8s, "j2", "Succeeded")
    assert st["completionTime"] and st["progress"]["step"] == 3, "progress left to the trainer"
    assert condition(k8s, "j2", "Succeeded")["status"] == "True"
    assert rayjobs(k8s) == ["j2-r0"], "a finished RayJob stays for inspection"
    await eventually(lambda: reasons(k8s, "j2") == ["Created", "Running", "Succeeded"],
                     what=lambda: reasons(k8s, "j2"))


async def test_failed_rayjob_restarts_then_fails(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j3", backoffLimit=1))
    await wait_phase(k8s, "j3", "Provisioning")
    await kuberay(k8s, "j3-r0", "FAILED", "Failed")
    st = await wait_phase(k8s, "j3", "Restarting")
    assert st["restarts"] == 1 and st["rayJobName"] == "j3-r1"
    await eventually(lambda: rayjobs(k8s) == ["j3-r1"], what="r0 replaced by r1")
    r1 = get(k8s, RAYJOBS, NS, "j3-r1") or {}
    assert r1["metadata"]["labels"][names.LABEL_ATTEMPT] == "1"
    await kuberay(k8s, "j3-r1", "FAILED", "Failed")
    await wait_phase(k8s, "j3", "Failed")
    failed = condition(k8s, "j3", "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "BackoffLimitExceeded")
    assert status(k8s, "j3")["restarts"] == 1
    expected = ["Created", "Restarting", "BackoffLimitExceeded"]
    await eventually(lambda: reasons(k8s, "j3") == expected, what=lambda: reasons(k8s, "j3"))


async def test_stale_heartbeat_restarts_from_checkpoint(k8s: Emulator,
                                                        operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j4", heartbeatTimeoutSeconds=30))
    await wait_phase(k8s, "j4", "Provisioning")
    # The Ray job has run for 100 s and the trainer last reported 40 s ago (timeout: 30 s).
    await heartbeat(k8s, "j4", offset=-40)
    await kuberay(k8s, "j4-r0", "RUNNING", "Running", started=-100)
    st = await wait_phase(k8s, "j4", "Restarting")
    assert st["restarts"] == 1 and st["rayJobName"] == "j4-r1"
    stalled = condition(k8s, "j4", "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "HeartbeatTimeout")
    await eventually(lambda: rayjobs(k8s) == ["j4-r1"])
    # The new attempt starts its own clock: an old heartbeat does not fail it again.
    await kuberay(k8s, "j4-r1", "RUNNING", "Running", started=0)
    await wait_phase(k8s, "j4", "Running")
    assert condition(k8s, "j4", "Stalled")["status"] == "False"
    assert status(k8s, "j4")["restarts"] == 1


async def test_lost_head_restarts(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j5"))
    await wait_phase(k8s, "j5", "Provisioning")
    await make_cluster(k8s, "c5", head_ready=True)
    await kuberay(k8s, "j5-r0", "RUNNING", "Running", cluster="c5", started=0)
    await wait_phase(k8s, "j5", "Running")
    # KubeRay keeps the RayJob RUNNING after the head pod died (the known trap).
    await make_cluster(k8s, "c5", head_ready=False)
    st = await wait_phase(k8s, "j5", "Restarting", timeout=10)
    assert st["rayJobName"] == "j5-r1"
    assert condition(k8s, "j5", "Stalled")["reason"] == "HeadLost"


async def test_suspend_and_resume(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j6", backoffLimit=0))
    await wait_phase(k8s, "j6", "Provisioning")
    await patch(k8s, RLJOBS, "j6", {"spec": {"suspend": True}})
    await wait_phase(k8s, "j6", "Suspended")
    await eventually(lambda: rayjobs(k8s) == [], what="RayJob deleted")
    assert condition(k8s, "j6", "Suspended")["status"] == "True"
    await patch(k8s, RLJOBS, "j6", {"spec": {"suspend": False}})
    st = await wait_phase(k8s, "j6", "Provisioning")
    assert st["rayJobName"] == "j6-r1" and st["restarts"] == 0, "resume is not a restart"
    assert rayjobs(k8s) == ["j6-r1"]
    assert condition(k8s, "j6", "Suspended")["reason"] == "Resumed"
    await eventually(lambda: reasons(k8s, "j6") == ["Created", "Suspended", "Resumed"],
                     what=lambda: reasons(k8s, "j6"))


async def test_immutable_change_refused(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j7"))
    await wait_phase(k8s, "j7", "Provisioning")
    await kuberay(k8s, "j7-r0", "RUNNING", "Running", started=0)
    await wait_phase(k8s, "j7", "Running")
    before = get(k8s, RAYJOBS, NS, "j7-r0")
    await patch(k8s, RLJOBS, "j7", {"spec": {"algorithm": {"lr": 0.5}}})
    accepted = await eventually(lambda: condition(k8s, "j7", "Accepted").get("status") == "False"
                                and condition(k8s, "j7", "Accepted"))
    assert accepted["reason"] == "ImmutableFieldChanged"
    assert "spec.algorithm" in accepted["message"]
    assert status(k8s, "j7")["observedGeneration"] == 2
    warning = await eventually(lambda: [e for e in events(k8s, "j7")
                                        if e["reason"] == "ImmutableFieldChanged"])
    assert warning[0]["type"] == "Warning"
    assert get(k8s, RAYJOBS, NS, "j7-r0") == before, "the running job is untouched"
    assert status(k8s, "j7")["phase"] == "Running"


async def test_invalid_spec_creates_nothing(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j8", training={"nodes": 0}))
    accepted = await eventually(lambda: condition(k8s, "j8", "Accepted").get("status") == "False"
                                and condition(k8s, "j8", "Accepted"))
    assert accepted["reason"] == "InvalidSpec"
    assert "spec.training.nodes" in accepted["message"]
    assert status(k8s, "j8")["phase"] == "Pending"
    warning = await eventually(lambda: [e for e in events(k8s, "j8")
                                        if e["reason"] == "InvalidSpec"])
    assert warning[0]["type"] == "Warning"
    await asyncio.sleep(2 * RESYNC)
    for resource, pattern in CHILDREN:
        assert get(k8s, resource, NS, pattern.format("j8")) is None, resource
    assert len(events(k8s, "j8")) == 1, "reported once, not on every resync"


async def test_deadline_exceeded(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j9", activeDeadlineSeconds=2))
    await wait_phase(k8s, "j9", "Provisioning")
    await kuberay(k8s, "j9-r0", "RUNNING", "Running", started=0)
    await wait_phase(k8s, "j9", "Failed", timeout=10)
    assert condition(k8s, "j9", "Failed")["reason"] == "DeadlineExceeded"
    await eventually(lambda: rayjobs(k8s) == [], what="RayJob deleted on the deadline")


async def test_ttl_deletes_the_finished_job(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j10", ttlSecondsAfterFinished=1))
    await wait_phase(k8s, "j10", "Provisioning")
    await kuberay(k8s, "j10-r0", "SUCCEEDED", "Complete")
    await wait_phase(k8s, "j10", "Succeeded")
    await eventually(lambda: get(k8s, RLJOBS, NS, "j10") is None, timeout=10,
                     what="RLJob deleted by its TTL")
    # kmock-side GC (owner references) removes the children, as the real GC would.
    await eventually(lambda: all(get(k8s, r, NS, p.format("j10")) is None for r, p in CHILDREN))


async def test_delete_leaves_gc_to_owner_references(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j11"))
    await wait_phase(k8s, "j11", "Provisioning")
    assert 'name="j11"' in await operator.metrics()
    await delete(k8s, RLJOBS, "j11")
    assert get(k8s, RLJOBS, NS, "j11") is None, "no finalizer holds the deletion"
    await eventually(lambda: all(get(k8s, r, NS, p.format("j11")) is None for r, p in CHILDREN))

    async def gone() -> bool:
        return 'name="j11"' not in await operator.metrics()
    for _ in range(100):
        if await gone():
            break
        await asyncio.sleep(0.05)
    assert await gone(), "series of a deleted RLJob are removed"
