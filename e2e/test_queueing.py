"""RLJobs through a Kueue queue on a real control plane: queued, admitted, preempted, resumed.

Everything Kueue and KubeRay do is real (Kueue's RayJob integration admitting the operator's
suspended RayJobs against a ClusterQueue's quota, suspending one again to preempt it, KubeRay
deleting and recreating its cluster); the operator runs with the chart's identity and a real
Prometheus scrapes it. As in test_lifecycle.py, the test plays the Ray dashboard (with KubeRay
frozen) and the trainer's heartbeat; a preempted head's checkpoint save is the trainer's
(tests/integration: SIGTERM saves at a safe point; kwok pods run no preStop hooks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from prometheus import Prometheus
from queues import (
    QUEUE_LABEL,
    Queues,
    create,
    delete,
    local_queue,
    make_queues,
    workload_of,
)
from rljobs import (
    JobWatch,
    Operator,
    condition,
    cpu_job,
    event_reasons,
    kubectl_apply,
    provisioned,
    table_row,
    unique,
    wait_phase,
)
from stand_in import KUBERAY, dashboard_says, head_reporter

from kuberl_api import parse
from kuberl_operator.render import names, render_children

pytestmark = [pytest.mark.e2e, pytest.mark.kuberay]

# KubeRay's default submitter pod (common/job.go) requests half a CPU: Kueue counts it too.
SUBMITTER_CPU = 1


@pytest.fixture(scope="module")
def operator(k8s_cluster: Cluster, operator_ns: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator with an hour between resyncs (the other modules' is 1 s): what a queued
    job shows must come from its watches (RLJobs, RayJobs, RayClusters, Kueue's Workloads:
    Kueue's pending message changes no RayJob), as it does with the chart's 30 s."""
    op = Operator(k8s_cluster, operator_ns,
                  tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=3600)
    try:
        op.start()
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="module")
def prometheus(operator: Operator, kueue: Cluster,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    with Prometheus.start(tmp_path_factory.mktemp("prometheus"),
                          {"kuberl-operator": [f"127.0.0.1:{operator.metrics_port}"]}) as prom:
        prom.wait_target_up("kuberl-operator")
        yield prom


def job_cpu(manifest: dict[str, Any]) -> float:
    """The CPUs one attempt's pods request, as Kueue adds them up (head + workers)."""
    rj = next(o for o in render_children(parse(manifest), 0) if o["kind"] == "RayJob")
    cluster = rj["spec"]["rayClusterSpec"]
    groups = [(1, cluster["headGroupSpec"])] + [(g["replicas"], g)
                                                for g in cluster["workerGroupSpecs"]]
    return float(sum(n * float(c["resources"].get("requests", {}).get("cpu", 0))
                     for n, g in groups for c in g["template"]["spec"]["containers"]))


def queued_job(name: str, ns: str, queue: str, **scheduling: Any) -> dict[str, Any]:
    job: dict[str, Any] = cpu_job(name, ns, backoffLimit=0,
                                  scheduling={"queueName": queue, **scheduling})
    return job


def in_prometheus(prom: Prometheus, query: str) -> bool:
    return bool(prom.query(query))


def phase_column(c: Cluster, ns: str, job: str) -> str:
    return str(table_row(c.kubectl("get", "rljob", job, "-n", ns).stdout.splitlines())["PHASE"])


def delete_queues(c: Cluster, queues: Queues) -> None:
    delete(c, {"kind": "LocalQueue", "metadata": {"name": queues.local_queue,
                                                  "namespace": queues.namespace}})
    delete(c, {"kind": "ClusterQueue", "metadata": {"name": queues.cluster_queue}})


def managers(c: Cluster, kind: str, ns: str, name: str) -> list[dict[str, Any]]:
    obj = json.loads(c.kubectl("get", kind, name, "-n", ns, "-o", "json",
                               "--show-managed-fields").stdout)
    found: list[dict[str, Any]] = obj["metadata"].get("managedFields") or []
    return found


def assert_kueue_owns_suspend(c: Cluster, ns: str, rayjob: str) -> None:
    """Server-side apply as kuberl-operator: Kueue unsuspended the operator's RayJob and owns
    `spec.suspend` now; no Apply of the operator's claims it (a re-apply would fight Kueue),
    and the operator's other children's fields are its own (created by its POST)."""
    # (Kueue's false is the field's zero value: Go's JSON leaves it out)
    wait_for(f"RayJob {rayjob} unsuspended", lambda: not json.loads(c.kubectl(
        "get", "rayjob", rayjob, "-n", ns, "-o", "json").stdout)["spec"].get("suspend"))
    entries = managers(c, "rayjob", ns, rayjob)
    ours = [e for e in entries if e["manager"] == "kuberl-operator"]
    assert ours, [e["manager"] for e in entries]
    for e in ours:
        if e["operation"] == "Apply":
            assert "f:suspend" not in e.get("fieldsV1", {}).get("f:spec", {}), e
    owners = [e["manager"] for e in entries if "f:suspend" in e.get("fieldsV1", {}).get(
        "f:spec", {})]
    assert "kuberl-operator" not in owners, owners
    config = managers(c, "configmap", ns, names.configmap(rayjob.rsplit("-r", 1)[0]))
    assert any(e["manager"] == "kuberl-operator" and "f:data" in e.get("fieldsV1", {})
               for e in config), config


def test_a_job_waits_in_the_queue_until_the_quota_frees(
        kueue: Cluster, operator: Operator, operator_ns: str, prometheus: Prometheus) -> None:
    """The ClusterQueue fits one job: the second waits Pending with Queued=True and Kueue's
    reason, and starts once the first has finished; an unknown LocalQueue is named,
    and once created, Kueue's next reason shows."""
    c, ns = kueue, operator_ns
    queue = unique("one-job")
    first, second, lost = "q-first", "q-second", "q-lost"
    late_queue = unique("late")  # named by q-lost before it exists
    cpu = job_cpu(queued_job(first, ns, queue)) + SUBMITTER_CPU
    queues = make_queues(c, ns, queue, gpu=0, cpu=cpu, memory="1Ti")
    w1, w2 = JobWatch(c, operator, ns, first), JobWatch(c, operator, ns, second)
    w3 = JobWatch(c, operator, ns, lost)
    try:
        kubectl_apply(c, queued_job(first, ns, queue), check=True)
        admitted = w1.wait_condition("Queued", "False")
        assert admitted["reason"] == "Admitted", admitted
        rayjob = w1.rayjob(0)
        assert rayjob is not None and rayjob["metadata"]["labels"][QUEUE_LABEL] == queue
        assert_kueue_owns_suspend(c, ns, names.rayjob(first, 0))

        kubectl_apply(c, queued_job(second, ns, queue), check=True)
        # Kueue's first Pending words are "waiting in LocalQueue"; its verdict on the quota
        # ("insufficient ...") follows once it has tried to admit the Workload
        waiting = wait_for("the second job waiting for quota, in Kueue's words", lambda: (
            q := condition(w2.get(), "Queued")).get("reason") == "Pending"
            and "insufficient" in q.get("message", "") and q,
            timeout=60, detail=w2.detail)
        assert waiting["status"] == "True" and "insufficient" in waiting["message"], waiting
        assert w2.status()["phase"] == "Pending" and phase_column(c, ns, second) == "Pending"
        assert (w2.rayjob(0) or {}).get("spec", {}).get("suspend") is True
        wait_for("Prometheus: the second job Queued", lambda: in_prometheus(
            prometheus, f'kuberl_rljob_condition{{namespace="{ns}",name="{second}",'
            'type="Queued",status="True"} == 1'), timeout=30, detail=prometheus.tail)

        kubectl_apply(c, queued_job(lost, ns, late_queue), check=True)
        nowhere = wait_for("the unknown LocalQueue named", lambda: late_queue in (
            q := condition(w3.get(), "Queued")).get("message", "") and q, timeout=60,
            detail=w3.detail)
        assert nowhere["status"] == "True", nowhere
        # The user creates the queue: Kueue's verdict on the Workload changes (now the quota
        # is what is missing); the operator's resync is an hour away here, so its watches
        # (Workloads; RayJobs, which Kueue may touch too) must bring Kueue's new words.
        create(c, local_queue(ns, late_queue, queues.cluster_queue))
        wait_for("Kueue's new reason once the queue exists", lambda: "insufficient" in (
            condition(w3.get(), "Queued")).get("message", ""), timeout=60, detail=w3.detail)

        provisioned(w1, 0)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, names.rayjob(first, 0), "SUCCEEDED")
            wait_phase(w1, "Succeeded")
        # KubeRay frees the first job's cluster, Kueue its quota: the second is admitted.
        admitted = w2.wait_condition("Queued", "False", timeout=90)
        assert admitted["reason"] == "Admitted", admitted
        st = wait_phase(w2, "Provisioning")
        assert st["restarts"] == 0 and st["startTime"], st
        assert "Admitted" in event_reasons(c, ns, second)
    finally:
        for w in (w1, w2, w3):
            w.delete_and_wait_gc()
        delete(c, local_queue(ns, late_queue, queues.cluster_queue))
        delete_queues(c, queues)


def test_a_preempted_job_resumes_without_counting_a_restart(
        kueue: Cluster, operator: Operator, operator_ns: str, prometheus: Prometheus) -> None:
    """A job of higher priority takes the quota of a running one: the running job shows
    Preempted (phase, condition, Event, Prometheus), its cluster goes; once the other job
    finishes, Kueue admits the same RayJob again and it trains on, restarts still 0."""
    c, ns = kueue, operator_ns
    queue = unique("preempt")
    low, high = "p-low", "p-high"
    classes = {"kuberl-e2e-low": 100, "kuberl-e2e-high": 1000}
    for name, value in classes.items():
        kubectl_apply(c, {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                          "metadata": {"name": name}, "value": value}, check=True)
    cpu = job_cpu(queued_job(low, ns, queue)) + SUBMITTER_CPU
    queues = make_queues(c, ns, queue, gpu=0, cpu=cpu, memory="1Ti", preemption="LowerPriority")
    wl, wh = JobWatch(c, operator, ns, low), JobWatch(c, operator, ns, high)
    r0 = names.rayjob(low, 0)
    try:
        kubectl_apply(c, queued_job(low, ns, queue, priorityClassName="kuberl-e2e-low"),
                      check=True)
        provisioned(wl, 0)
        reporter = head_reporter(c, ns, low)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r0, "RUNNING")
            wait_phase(wl, "Running")
            reporter.report(step=12, total_steps=100, reward_mean=0.4,
                            checkpoint=(12, "/checkpoints/step-12"))
            # The high-priority job arrives: Kueue evicts the running one (suspend: true).
            kubectl_apply(c, queued_job(high, ns, queue, priorityClassName="kuberl-e2e-high"),
                          check=True)
            st = wait_phase(wl, "Preempted", timeout=60)
            assert st["restarts"] == 0 and st["rayJobName"] == r0, st
            preempted = condition(wl.get(), "Preempted")
            assert preempted["status"] == "True", preempted
            assert "checkpoint" in preempted["message"], preempted
            assert phase_column(c, ns, low) == "Preempted"
            wait_for("Prometheus: phase Preempted", lambda: in_prometheus(
                prometheus, f'kuberl_rljob_status_phase{{namespace="{ns}",name="{low}",'
                'phase="Preempted"} == 1'), timeout=30, detail=prometheus.tail)
        events = wait_for("a Preempted Event", lambda: [
            e for e in [*event_reasons(c, ns, low)] if e == "Preempted"])
        assert events
        evicted = workload_of(c, ns, "RayJob", r0)
        assert evicted is not None and condition(evicted, "Evicted").get("status") == "True", \
            json.dumps((evicted or {}).get("status"), indent=1)

        # KubeRay deletes the preempted cluster; Kueue admits the high job into the quota.
        provisioned(wh, 0)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, names.rayjob(high, 0), "SUCCEEDED")
            wait_phase(wh, "Succeeded")
        # The quota frees: the same RayJob is admitted again and resumes.
        readmitted = wl.wait_condition("Queued", "False", timeout=90)
        assert readmitted["reason"] == "Admitted", readmitted
        assert condition(wl.get(), "Preempted")["reason"] == "Readmitted"
        provisioned(wl, 0)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r0, "RUNNING")
            st = wait_phase(wl, "Running")
        assert st["restarts"] == 0 and st["rayJobName"] == r0, st
        assert wl.rayjob(1) is None, "a preemption must not start a new attempt"
        reasons = event_reasons(c, ns, low)
        assert "Readmitted" in reasons and "Restarting" not in reasons, reasons
    finally:
        for w in (wl, wh):
            w.delete_and_wait_gc()
        delete_queues(c, queues)
        for name in classes:
            c.kubectl("delete", "priorityclass", name, "--ignore-not-found")
