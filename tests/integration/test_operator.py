"""The real operator process against the API emulator: RLJob in, children and status out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

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
    condition,
    create,
    delete,
    events,
    eventually,
    get,
    heartbeat,
    history,
    kuberay,
    make_cluster,
    manifest,
    patch,
    phases,
    rayjobs,
    status,
    wait_phase,
)

pytestmark = pytest.mark.integration

def reasons(emu: Emulator, name: str) -> list[str]:
    return [e["reason"] for e in events(emu, name)]


async def passes_are(op: Operator, n: int) -> bool:
    """Whether exactly `n` reconcile passes have ended well (more fails the test)."""
    done = await op.reconciles()
    assert done <= n, f"{done} passes, expected {n}"
    return done == n


CHILDREN = [("v1/serviceaccounts", "{}-head"), ("rbac.authorization.k8s.io/v1/roles", "{}-status"),
            ("rbac.authorization.k8s.io/v1/rolebindings", "{}-status"),
            ("v1/configmaps", "{}-config"), ("v1/secrets", "{}-r0-engine-key"),
            ("networking.k8s.io/v1/networkpolicies", "{}-netpol"), (RAYJOBS, "{}-r0")]


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
    # The operator sets its gauges once the status patch has returned, so they may lag the
    # status the test has just read.
    gauges = ('kuberl_rljob_status_phase{name="j2",namespace="default",phase="Running"} 1.0',
              'kuberl_rljob_condition{name="j2",namespace="default",status="True",'
              'type="Training"} 1.0')

    async def gauges_set() -> str | None:
        text = await operator.metrics()
        return text if all(g in text for g in gauges) else None
    text = await eventually(gauges_set, what="the gauges show Running")
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


async def test_a_slow_start_up_that_beats_is_not_stalled(k8s: Emulator,
                                                          operator: Operator) -> None:
    """Issue 36: the Ray job has run for 100 s, past heartbeatTimeoutSeconds (30 s), with no
    step finished: the trainer's start-up heartbeat (the real thread and reporter, against
    the emulator) keeps it Running, with the phase in the Training condition's message.
    Without it this is test_stale_heartbeat_restarts_from_checkpoint: restarted as Stalled."""
    from kuberl_trainer.report.heartbeat import StartupHeartbeat
    from kuberl_trainer.report.status import StatusReporter

    await create(k8s, RLJOBS, manifest("j12", heartbeatTimeoutSeconds=30))
    await wait_phase(k8s, "j12", "Provisioning")
    reporter = StatusReporter(str(k8s.url).rstrip("/"), "tok", NS, "j12")
    beat = StartupHeartbeat(lambda phase: reporter.beat(phase, 100), interval_s=0.5)
    try:
        await asyncio.to_thread(beat.enter, "Loading")  # (the emulator answers on this loop)
        await kuberay(k8s, "j12-r0", "RUNNING", "Running", started=-100)
        first = (await wait_phase(k8s, "j12", "Running"))["progress"]["lastHeartbeatTime"]
        await asyncio.sleep(8 * RESYNC)  # passes go by; the phase blocks, the thread beats
        st = status(k8s, "j12")
        assert st["progress"]["lastHeartbeatTime"] > first, "the thread beats on its own"
        assert st["phase"] == "Running" and st["restarts"] == 0, st
        assert st["progress"]["trainerPhase"] == "Loading"
        assert "loading the models" in condition(k8s, "j12", "Training")["message"]
        assert condition(k8s, "j12", "Stalled")["status"] == "False"
        assert rayjobs(k8s) == ["j12-r0"]
    finally:
        await asyncio.to_thread(beat.stop)


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
    # Succeeded lasts 1-2 s before the TTL deletes the job: read it from the RLJob's stored
    # versions, so a poll that comes late finds it too, instead of the job already gone.
    await eventually(lambda: "Succeeded" in phases(k8s, "j10"),
                     what=lambda: f"j10 phase Succeeded (phases {phases(k8s, 'j10')})")
    await eventually(lambda: get(k8s, RLJOBS, NS, "j10") is None, timeout=10,
                     what=lambda: f"RLJob deleted by its TTL (phases {phases(k8s, 'j10')})")
    last = history(k8s, "j10")[-1]["status"]
    assert last["phase"] == "Succeeded" and last["completionTime"]
    await eventually(lambda: reasons(k8s, "j10") == ["Created", "Succeeded", "TTLExpired"],
                     what=lambda: reasons(k8s, "j10"))
    # kmock-side GC (owner references) removes the children, as the real GC would.
    await eventually(lambda: all(get(k8s, r, NS, p.format("j10")) is None for r, p in CHILDREN))


async def test_ttl_is_scheduled_by_the_pass_that_finishes(k8s: Emulator, tmp_path: Path) -> None:
    """Once the job has finished, nothing else is due to wake the operator for it: resync is an
    hour away and the RLJob's watch brings no changes (not even the echoes of the operator's own
    status patches). The TTL must fire from the wake-up that the finishing pass set."""
    k8s.mute(RLJOBS, "MODIFIED")
    op = Operator(k8s, tmp_path, ["--resync-seconds", "3600"])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("j12", ttlSecondsAfterFinished=1))
        # Exactly one pass, for the RLJob's ADDED: its new RayJob's ADDED only echoes the
        # operator's own create, which that pass already accounted for.
        await eventually(lambda: passes_are(op, 1), what="one pass")
        await asyncio.sleep(1.0)
        assert await passes_are(op, 1), "the RayJob's ADDED echo ran a pass"
        assert status(k8s, "j12")["phase"] == "Provisioning"
        await kuberay(k8s, "j12-r0", "SUCCEEDED", "Complete")  # the one event left: pass 3
        await eventually(lambda: "Succeeded" in phases(k8s, "j12"),
                         what=lambda: f"j12 phase Succeeded (phases {phases(k8s, 'j12')})")
        await eventually(lambda: get(k8s, RLJOBS, NS, "j12") is None, timeout=10,
                         what=lambda: f"RLJob deleted by its TTL (phases {phases(k8s, 'j12')})")
    finally:
        await op.stop()


async def series(op: Operator, name: str) -> bool:
    """Whether the operator's /metrics has series of the RLJob `name`."""
    return f'name="{name}"' in await op.metrics()


async def test_delete_leaves_gc_to_owner_references(k8s: Emulator, operator: Operator) -> None:
    await create(k8s, RLJOBS, manifest("j11"))
    await wait_phase(k8s, "j11", "Provisioning")
    # The gauges are set once the status patch has returned, so they may lag the status.
    await eventually(lambda: series(operator, "j11"), what="series of j11")
    await delete(k8s, RLJOBS, "j11")
    assert get(k8s, RLJOBS, NS, "j11") is None, "no finalizer holds the deletion"
    await eventually(lambda: all(get(k8s, r, NS, p.format("j11")) is None for r, p in CHILDREN))

    async def gone() -> bool:
        return not await series(operator, "j11")
    await eventually(gone, what="series of a deleted RLJob are removed")


async def test_deleted_during_a_pass_leaves_no_series(k8s: Emulator, operator: Operator) -> None:
    """A pass that read the RLJob before it was deleted ends after the operator heard of the
    deletion; the series it sets must not outlive the RLJob. (An invalid spec: no children, so
    no later event of theirs wakes the operator to clean up.)"""
    held = k8s.hold(lambda r: r.action == kmock.action.UPDATE and r.name == "j13"
                    and r.resource == kmock.resource(RLJOBS))
    await create(k8s, RLJOBS, manifest("j13", training={"nodes": 0}))
    await eventually(lambda: held.hits, what="the first pass patches the status")
    await delete(k8s, RLJOBS, "j13")
    await asyncio.sleep(2 * RESYNC)  # time to hear of the deletion while the pass is held
    held.release()  # the patch now finds the RLJob gone, and the pass goes on to its gauges
    await asyncio.sleep(2 * RESYNC)  # that pass, and any after it, are over
    assert not await series(operator, "j13"), "no series outlive the RLJob"


async def test_echoes_of_its_own_status_patches_cost_no_pass(k8s: Emulator,
                                                             tmp_path: Path) -> None:
    """The watch event of the operator's own status patch carries nothing it did not decide:
    it is skipped (a third of all passes at scale); anyone else's change still gets a pass."""
    op = Operator(k8s, tmp_path, ["--resync-seconds", "3600"])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("j20"))
        await wait_phase(k8s, "j20", "Provisioning")
        # RLJob ADDED (creates, patches the status); the echoes of that create (RayJob ADDED)
        # and of that patch (RLJob MODIFIED): nothing.
        await eventually(lambda: passes_are(op, 1), what="one pass")
        await asyncio.sleep(1.5)
        assert await passes_are(op, 1)
        await patch(k8s, RLJOBS, "j20", {"spec": {"backoffLimit": 5}})  # a user's edit
        await eventually(lambda: passes_are(op, 2), what="a pass for the edit")
        await eventually(lambda: status(k8s, "j20").get("observedGeneration") == 2)
        await asyncio.sleep(1.5)
        assert await passes_are(op, 2)  # (and none for the observedGeneration patch's echo)
        await kuberay(k8s, "j20-r0", "RUNNING", "Running")  # KubeRay's writes: a pass each
        await eventually(lambda: passes_are(op, 3), what="a pass for KubeRay's status")
    finally:
        await op.stop()


async def test_a_create_echo_that_beats_the_creates_response_costs_no_pass(
        k8s: Emulator, tmp_path: Path) -> None:
    """The watch may deliver the new RayJob's ADDED before the create's own response reaches
    the pass that made it: that event is still only the echo of the create (one pass); an
    edit of the RayJob while the create is in flight still gets a pass of its own."""
    op = Operator(k8s, tmp_path, ["--resync-seconds", "3600"])
    await op.start()
    try:
        held = k8s.hold(lambda r: r.action == kmock.action.CREATE
                        and r.resource == kmock.resource(RAYJOBS), "after")
        await create(k8s, RLJOBS, manifest("j23"))
        await eventually(lambda: held.hits, what="the RayJob created, its response held")
        await asyncio.sleep(1.0)  # its ADDED event reaches the operator meanwhile
        held.release()
        await eventually(lambda: passes_are(op, 1), what="one pass")
        await asyncio.sleep(1.0)
        assert await passes_are(op, 1), "the early echo ran a pass"
        assert status_patches(k8s, "j23") == 1

        held = k8s.hold(lambda r: r.action == kmock.action.CREATE
                        and r.resource == kmock.resource(RAYJOBS), "after")
        await create(k8s, RLJOBS, manifest("j24"))
        await eventually(lambda: held.hits, what="j24's RayJob created, its response held")
        await kuberay(k8s, "j24-r0", "PENDING", "Initializing")  # KubeRay is quicker still
        await asyncio.sleep(1.0)
        held.release()
        await eventually(lambda: passes_are(op, 3),
                         what="j24: its pass, then one for KubeRay's write")
    finally:
        await op.stop()


def status_patches(k8s: Emulator, name: str) -> int:
    return len([r for r in k8s if r.method == "PATCH" and r.name == name
                and r.subresource == "status"])


async def test_a_new_attempt_gets_its_status_in_one_patch(k8s: Emulator, tmp_path: Path) -> None:
    """The pass that creates an attempt writes the status a pass that sees the new RayJob would
    write: later passes (a resync every second here) find nothing to change."""
    op = Operator(k8s, tmp_path, ["--resync-seconds", "1"])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("j21"))
        await wait_phase(k8s, "j21", "Provisioning")
        async def resynced() -> bool:
            return await op.reconciles() >= 3
        await eventually(resynced, what="three passes (resyncs)")
        assert status_patches(k8s, "j21") == 1, status(k8s, "j21")
        assert status(k8s, "j21")["rayJobName"] == "j21-r0"
    finally:
        await op.stop()


WORKLOADS = "kueue.x-k8s.io/v1beta2/workloads"


def workload_of(rayjob: dict[str, Any]) -> dict[str, Any]:
    """Kueue's Workload of a queued RayJob (found by the job-uid label, owned by the RayJob)."""
    meta = rayjob["metadata"]
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"rayjob-{meta['name']}-1a2b3", "namespace": NS,
                         "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                         "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayJob",
                                              "name": meta["name"], "uid": meta["uid"],
                                              "controller": True}]},
            "spec": {"queueName": "team-a"}}


def not_reserved(reason: str, message: str) -> dict[str, Any]:
    """The Workload status Kueue writes while the quota is not reserved."""
    return {"status": {"conditions": [{"type": "QuotaReserved", "status": "False",
                                       "reason": reason, "message": message,
                                       "lastTransitionTime": "2026-11-28T00:00:00Z"}]}}


async def test_kueues_verdict_alone_updates_a_queued_job(k8s: Emulator, tmp_path: Path) -> None:
    """Kueue rewrites its Workload's verdict without touching the RayJob: the operator watches
    Workloads, so the RLJob's Queued condition follows at once (resync is an hour away)."""
    op = Operator(k8s, tmp_path, ["--resync-seconds", "3600"])
    await op.start()
    try:
        await create(k8s, RLJOBS, manifest("j22", scheduling={"queueName": "team-a"}))
        rayjob = await eventually(lambda: get(k8s, RAYJOBS, NS, "j22-r0"), what="RayJob j22-r0")
        assert rayjob["spec"]["suspend"] is True
        await eventually(lambda: condition(k8s, "j22", "Queued").get("reason")
                         == "WaitingForWorkload", what="Queued: no Workload yet")
        workload = await create(k8s, WORKLOADS, workload_of(rayjob))
        name = workload["metadata"]["name"]
        await patch(k8s, WORKLOADS, name, not_reserved("Pending", "insufficient quota"), "status")
        await eventually(lambda: "insufficient quota" in condition(
            k8s, "j22", "Queued").get("message", ""), what="Kueue's first verdict")
        await patch(k8s, WORKLOADS, name, not_reserved(
            "Inadmissible", "ClusterQueue team-a is inactive"), "status")
        queued = await eventually(lambda: (q := condition(k8s, "j22", "Queued")).get(
            "reason") == "Inadmissible" and q, what="Kueue's second verdict")
        assert "ClusterQueue team-a is inactive" in queued["message"], queued
    finally:
        await op.stop()
