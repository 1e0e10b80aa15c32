"""An RLJob's life on a real control plane: Training, Stalled, restart from checkpoint,
Succeeded, Failed, refused at start (no restart), suspend and resume, an operator killed
mid-reconcile - and what a user's Prometheus sees of it.

Fake (kwok) pods run no Ray, so the test plays the two parts Ray would:
- the Ray dashboard, whose job status KubeRay copies into the RayJob: with the KubeRay operator
  frozen (`Cluster.paused`) after it provisioned the cluster and started the submitter, the test
  writes the RayJob status that KubeRay would write from the dashboard's answer;
- the trainer on the head, which reports progress and heartbeats with the head ServiceAccount's
  token through the real `StatusReporter` (and, refusing to start, the real `run` reports it
  through that reporter).
Everything else is real: the API server, KubeRay provisioning each attempt's RayCluster, the
scheduler, the garbage collector, the operator with the chart's identity, and Prometheus
scraping the operator's /metrics.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster
from polling import wait_for
from prometheus import Prometheus
from rljobs import (
    CHILDREN,
    RAYCLUSTERS,
    RAYJOBS,
    JobWatch,
    Operator,
    condition,
    cpu_job,
    event_reasons,
    events_for,
    kubectl_apply,
    provisioned,
    table_row,
    wait_phase,
)
from stand_in import KUBERAY, dashboard_says, head_reporter

from kuberl_api import RLJob, runtime
from kuberl_api.load import load_rendered
from kuberl_operator.render import names
from kuberl_operator.status import ANNOTATION_RESTARTS
from kuberl_trainer.report.status import StatusReporter
from kuberl_trainer.run import run

pytestmark = [pytest.mark.e2e, pytest.mark.kuberay]

HEARTBEAT_TIMEOUT = 30  # the CRD's minimum heartbeatTimeoutSeconds


@pytest.fixture(scope="module")
def prometheus(operator: Operator,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    with Prometheus.start(tmp_path_factory.mktemp("prometheus"),
                          {"kuberl-operator": [f"127.0.0.1:{operator.metrics_port}"]}) as prom:
        prom.wait_target_up("kuberl-operator")
        yield prom


def phase_in_prometheus(prom: Prometheus, ns: str, job: str) -> str | None:
    """The phase whose kuberl_rljob_status_phase series is 1, as a dashboard would query it."""
    found = prom.query(f'kuberl_rljob_status_phase{{namespace="{ns}",name="{job}"}} == 1')
    phases = {r["metric"]["phase"] for r in found}
    assert len(phases) <= 1, f"more than one phase is 1: {found}"
    return phases.pop() if phases else None


def wait_prometheus_phase(prom: Prometheus, w: JobWatch, phase: str) -> None:
    wait_for(f"Prometheus: RLJob {w.job} phase {phase}",
             lambda: phase_in_prometheus(prom, w.ns, w.job) == phase, timeout=30,
             detail=prom.tail)


# ------------------------------------------------------------------ training to the end


def test_trains_stalls_restarts_from_checkpoint_and_succeeds(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str,
        prometheus: Prometheus) -> None:
    """Running -> Training with progress in `kubectl get rljobs` and Prometheus -> the trainer
    falls silent -> Stalled, restarted from its last checkpoint as attempt 1 (within
    backoffLimit) -> attempt 1 trains -> its Ray job succeeds -> Succeeded."""
    c, ns, job = k8s_cluster, operator_ns, "lifecycle"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, backoffLimit=1, heartbeatTimeoutSeconds=HEARTBEAT_TIMEOUT),
                  check=True)
    try:
        provisioned(w, 0)
        reporter = head_reporter(c, ns, job)
        r0, r1 = names.rayjob(job, 0), names.rayjob(job, 1)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r0, "RUNNING")
            training = w.wait_condition("Training", "True")
            assert training["reason"] == "Running", training
            assert wait_phase(w, "Running")["restarts"] == 0
            wait_prometheus_phase(prometheus, w, "Running")

            reporter.report(step=40, total_steps=100, reward_mean=0.5,
                            checkpoint=(40, "/checkpoints/step-40"))
            # (an engine replaced on the way: the trainer goes on, and says so)
            reporter.report(step=41, total_steps=100, reward_mean=0.53125, engine_restarts=1)
            reporter.event("EngineReplaced", "engine at http://10.0.0.7:30000 exited with code "
                           "-9: replaced by http://10.0.0.7:30011 (restart 1 of 3)")
            replaced = wait_for("an EngineReplaced Event", lambda: [
                e for e in events_for(c.api(), ns, job) if e["reason"] == "EngineReplaced"])
            assert replaced[0]["type"] == "Warning", replaced
            described = c.kubectl("describe", "rljob", job, "-n", ns).stdout
            assert "EngineReplaced" in described and "exited with code -9" in described
            row = table_row(c.kubectl("get", "rljob", job, "-n", ns).stdout.splitlines())
            assert (row["PHASE"], row["STEP"], row["REWARD"]) == ("Running", "41", "0.53125"), row
            wide = table_row(c.kubectl("get", "rljob", job, "-n", ns, "-o", "wide"
                                       ).stdout.splitlines())
            assert (wide["RESTARTS"], wide["RAYJOB"], wide["ENGINE-RESTARTS"]) == (
                "0", r0, "1"), wide
            wait_for("Training's message at step 41", lambda: "at step 41" in condition(
                w.get(), "Training").get("message", ""), timeout=10, detail=w.detail)

            # The trainer falls silent: heartbeatTimeoutSeconds after its last report the
            # attempt counts as stalled and is replaced from the checkpoint it reported.
            silent_since = time.monotonic()
            st = wait_for("the restart as attempt 1", lambda: (s := w.status()).get(
                "rayJobName") == r1 and s, timeout=HEARTBEAT_TIMEOUT + 30, detail=w.detail)
            waited = time.monotonic() - silent_since
            assert waited > HEARTBEAT_TIMEOUT - 5, f"restarted after only {waited:.0f}s"
            assert st["restarts"] == 1 and st["phase"] == "Restarting", st
            stalled = condition(w.get(), "Stalled")
            assert (stalled["status"], stalled["reason"]) == ("True", "HeartbeatTimeout"), stalled
            assert "trainer silent for" in stalled["message"], stalled
            restarting = wait_for("a Restarting Event", lambda: [
                e for e in events_for(c.api(), ns, job) if e["reason"] == "Restarting"])
            message = restarting[0]["message"]
            assert "restarting from checkpoint step 40" in message, message
            assert f"as RayJob {r1} (restart 1 of 1)" in message, message
            # r0 was still RUNNING, so the operator deletes it (its GPUs are freed); KubeRay's
            # finalizer holds it until KubeRay runs again.
            wait_for(f"RayJob {r0} deleting", lambda: (w.rayjob(0) or {}).get(
                "metadata", {}).get("deletionTimestamp"), timeout=30, detail=w.detail)
            rayjob1 = w.rayjob(1)
            assert rayjob1 is not None
            assert rayjob1["metadata"]["annotations"][ANNOTATION_RESTARTS] == "1", \
                rayjob1["metadata"]
            wait_prometheus_phase(prometheus, w, "Restarting")

        # KubeRay goes on: it finishes deleting attempt 0 and provisions attempt 1.
        wait_for(f"RayJob {r0} gone", lambda: w.rayjob(0) is None, timeout=60)
        provisioned(w, 1)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r1, "RUNNING")
            wait_phase(w, "Running")
            assert condition(w.get(), "Stalled")["status"] == "False"
            reporter.report(step=42, total_steps=100, reward_mean=0.6)
            dashboard_says(c, ns, r1, "SUCCEEDED")
            st = wait_phase(w, "Succeeded")
            assert st["completionTime"] and st["restarts"] == 1, st
            assert condition(w.get(), "Succeeded")["status"] == "True"
            assert condition(w.get(), "Training")["reason"] == "Completed"
            wait_prometheus_phase(prometheus, w, "Succeeded")
            assert prometheus.query(
                f'kuberl_rljob_condition{{namespace="{ns}",name="{job}",type="Succeeded",'
                f'status="True"}} == 1'), "Succeeded condition not in Prometheus"
        reasons = event_reasons(c, ns, job)
        assert reasons.count("Running") == 2 and "Succeeded" in reasons, reasons
        # A finished RayJob stays for inspection (its logs); nothing is restarted any more.
        time.sleep(3)
        assert w.rayjob(1) is not None and w.rayjob(2) is None
        assert w.status()["phase"] == "Succeeded"
    finally:
        w.delete_and_wait_gc()
    # A deleted RLJob's series go (no ghost jobs on dashboards).
    wait_for("the deleted RLJob's series gone from /metrics",
             lambda: f'name="{job}"' not in operator.metrics(), timeout=30)


@pytest.mark.parametrize(("job_status", "reason"), [("FAILED", "BackoffLimitExceeded"),
                                                    ("STOPPED", "RayJobStopped")])
def test_ray_job_that_ends_badly_fails_the_rljob(k8s_cluster: Cluster, operator: Operator,
                                                 operator_ns: str, prometheus: Prometheus,
                                                 job_status: str, reason: str) -> None:
    """A failed Ray job with no restarts left, or one stopped by `ray job stop`, is Failed:
    the reason says which, a Warning Event carries the dashboard's message, Prometheus shows
    the phase, and nothing is restarted."""
    c, ns = k8s_cluster, operator_ns
    job = f"ends-{job_status.lower()}"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, backoffLimit=0), check=True)
    try:
        provisioned(w, 0)
        with c.paused(KUBERAY):
            dashboard_says(c, ns, names.rayjob(job, 0), "RUNNING")
            wait_phase(w, "Running")
            dashboard_says(c, ns, names.rayjob(job, 0), job_status,
                           message="Job entrypoint command failed with exit code 3")
            st = wait_phase(w, "Failed")
            failed = condition(w.get(), "Failed")
            assert (failed["status"], failed["reason"]) == ("True", reason), failed
            assert st["restarts"] == 0 and st["completionTime"], st
            if job_status == "FAILED":
                assert "exit code 3" in failed["message"], failed
                assert "backoffLimit (0) reached" in failed["message"], failed
            warnings = wait_for(f"a {reason} Event", lambda: [
                e for e in events_for(c.api(), ns, job) if e["reason"] == reason])
            assert warnings[0]["type"] == "Warning", warnings
            wait_prometheus_phase(prometheus, w, "Failed")
            time.sleep(3)
            assert w.rayjob(1) is None, "a job out of restarts was restarted"
    finally:
        w.delete_and_wait_gc()


# ------------------------------------------------------------ refused at start: no restart


def head_env(rayjob: dict[str, Any]) -> dict[str, str]:
    """The plain env values of the head's Ray container, as the operator rendered them."""
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    return {e["name"]: e["value"] for e in head["containers"][0].get("env", []) if "value" in e}


def rendered_job(c: Cluster, ns: str, job: str, tmp: Path) -> RLJob:
    """The RLJob the head's `kuberl run --in-cluster` reads: its ConfigMap's rljob.yaml."""
    cm = c.api().get(f"/api/v1/namespaces/{ns}/configmaps/{names.configmap(job)}")
    assert cm is not None, f"no ConfigMap {ns}/{names.configmap(job)}"
    path = tmp / names.CONFIG_KEY
    path.write_text(cm["data"][names.CONFIG_KEY])
    return load_rendered(path)[0]


def test_a_trainer_that_refuses_to_start_fails_the_rljob_without_a_restart(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's `kuberl run --in-cluster` refuses to start (its checks before Ray: the model
    the spec names is not there) and reports it with the head ServiceAccount's token, naming
    the attempt the operator put in the head's environment; its Ray job fails. The RLJob is
    Failed at once, InvalidAtStart, the trainer's message in Failed and Accepted and in a
    Warning Event; no second attempt, though backoffLimit allows two restarts."""
    c, ns, job = k8s_cluster, operator_ns, "refused"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns, backoffLimit=2), check=True)
    try:
        provisioned(w, 0)
        r0 = names.rayjob(job, 0)
        rayjob0 = w.rayjob(0)
        assert rayjob0 is not None
        # The real run on the head's inputs: its config, its attempt, its ServiceAccount (the
        # pod's in-cluster login is the one thing played: no pod runs here).
        rendered = rendered_job(c, ns, job, tmp_path)
        monkeypatch.setenv(runtime.ENV_ATTEMPT, head_env(rayjob0)[runtime.ENV_ATTEMPT])
        reporter = head_reporter(c, ns, job)
        monkeypatch.setattr(StatusReporter, "in_cluster", staticmethod(lambda: reporter))
        args = argparse.Namespace(address="auto", in_cluster=True,
                                  output_dir=str(tmp_path / "out"))
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r0, "RUNNING")
            wait_phase(w, "Running")
            assert run(rendered, args) == 1
            dashboard_says(c, ns, r0, "FAILED")  # the entrypoint exited 1
            st = wait_phase(w, "Failed")
            assert st["trainerRefusal"]["attempt"] == 0, st
            assert st["restarts"] == 0 and st["rayJobName"] == r0 and st["completionTime"], st
            failed, accepted = condition(w.get(), "Failed"), condition(w.get(), "Accepted")
            assert (failed["status"], failed["reason"]) == ("True", "InvalidAtStart"), failed
            assert (accepted["status"], accepted["reason"]) == ("False", "InvalidAtStart")
            for said in (failed["message"], accepted["message"]):
                assert f"refused to start RayJob {r0}: spec.model.path: /models/tiny" in said
                assert "delete and re-create the RLJob" in said, said
            warning = wait_for("an InvalidAtStart Event", lambda: [
                e for e in events_for(c.api(), ns, job) if e["reason"] == "InvalidAtStart"])
            assert warning[0]["type"] == "Warning" and "spec.model.path" in warning[0]["message"]
            described = c.kubectl("describe", "rljob", job, "-n", ns).stdout
            assert "InvalidAtStart" in described and "spec.model.path" in described
            assert "Restarting" not in event_reasons(c, ns, job)
            assert w.rayjob(1) is None, "an attempt refused at start was restarted"
    finally:
        w.delete_and_wait_gc()


# ------------------------------------------------------------------------ suspend, resume


def test_suspend_frees_the_cluster_and_resume_starts_the_next_attempt(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str) -> None:
    """spec.suspend: true deletes the RayJob, its RayCluster and pods (the GPUs go back) and
    holds; false starts the next attempt, which resumes from the last checkpoint."""
    c, ns, job = k8s_cluster, operator_ns, "pausable"
    w = JobWatch(c, operator, ns, job)
    kubectl_apply(c, cpu_job(job, ns), check=True)
    try:
        provisioned(w, 0)
        c.kubectl("patch", "rljob", job, "-n", ns, "--type=merge", "-p",
                  '{"spec":{"suspend":true}}')
        st = wait_phase(w, "Suspended")
        assert condition(w.get(), "Suspended")["status"] == "True", st
        wait_for("RayJob r0, its RayCluster and pods gone", lambda: w.rayjob(0) is None
                 and not c.api().get(RAYCLUSTERS.format(ns=ns))["items"]
                 and not w.pods_by_group(), timeout=60, detail=w.pod_detail)
        time.sleep(3)  # held: nothing is recreated while suspended
        assert w.rayjob(0) is None and w.rayjob(1) is None and w.status()["phase"] == "Suspended"

        c.kubectl("patch", "rljob", job, "-n", ns, "--type=merge", "-p",
                  '{"spec":{"suspend":false}}')
        resumed = w.wait_condition("Suspended", "False")
        assert resumed["reason"] == "Resumed", resumed
        provisioned(w, 1)
        st = w.status()
        assert st["restarts"] == 0, "a resume is not a restart"
        reasons = event_reasons(c, ns, job)
        assert "Suspended" in reasons and "Resumed" in reasons, reasons
    finally:
        w.delete_and_wait_gc()


# ------------------------------------------------------------- operator killed mid-reconcile


def children_by_job(c: Cluster, ns: str) -> dict[str, dict[str, list[str]]]:
    """job -> kind -> names of every object the operator creates, found by the job label (not
    by name, so a duplicate under another name would show); one list call per kind."""
    out: dict[str, dict[str, list[str]]] = {}
    kinds = [template.rsplit("/", 1)[1] for template, _ in CHILDREN]
    for (template, _), kind in zip(CHILDREN, kinds, strict=True):
        for o in c.api().get(template.format(ns=ns) + "?labelSelector=" + names.LABEL_JOB)[
                "items"]:
            job = o["metadata"]["labels"][names.LABEL_JOB]
            out.setdefault(job, {k: [] for k in kinds})[kind].append(o["metadata"]["name"])
    return out


def half_done(children: dict[str, dict[str, list[str]]]) -> list[str]:
    """The jobs that have some of their children but not all."""
    return [job for job, kids in children.items()
            if any(kids.values()) and not all(kids.values())]


def test_operator_killed_mid_reconcile_converges_without_duplicates(
        k8s_cluster: Cluster, operator: Operator, operator_ns: str, tmp_path: Path) -> None:
    """SIGKILL the operator while it creates the children of several new RLJobs; a restarted
    operator finishes each job with exactly one of every child and attempt 0 only."""
    c, ns = k8s_cluster, operator_ns
    jobs = [f"crash-{i}" for i in range(8)]
    kubectl_apply(c, "\n---\n".join(json.dumps(cpu_job(job, ns)) for job in jobs), check=True)
    try:
        # Kill it the moment some job has part of its children: caught mid-reconcile.
        wait_for("a job with only part of its children", lambda: half_done(
            children_by_job(c, ns)), timeout=60, interval=0.02, detail=operator.tail)
        assert operator.proc is not None
        operator.proc.send_signal(signal.SIGKILL)
        operator.proc.wait(timeout=10)
        at_kill = children_by_job(c, ns)
        (tmp_path / "at-kill.json").write_text(json.dumps(at_kill, indent=1))
        assert half_done(at_kill), at_kill
        operator.start()
        for job in jobs:
            w = JobWatch(c, operator, ns, job)
            w.wait_condition("Accepted", "True")
            wait_for(f"RayCluster of {job}", lambda w=w: (w.rayjob(0) or {}).get(
                "status", {}).get("rayClusterName"), timeout=90, detail=w.detail)
            kids = children_by_job(c, ns)[job]
            expected = {template.rsplit("/", 1)[1]: [name_of(job)] for template, name_of
                        in CHILDREN}
            assert kids == expected, f"{job}: {kids} (at the kill: {at_kill[job]})"
            st = w.status()
            assert st["rayJobName"] == names.rayjob(job, 0) and st["restarts"] == 0, st
            # KubeRay names the cluster in the RayJob's status before the RayCluster exists
            # (a busy machine shows the gap): wait for it, then there must be exactly one.
            clusters = wait_for(f"the RayCluster of {job}", lambda job=job: [
                o["metadata"]["name"] for o in c.api().get(RAYCLUSTERS.format(ns=ns))["items"]
                if o["metadata"]["name"].startswith(f"{job}-r")], timeout=60)
            assert len(clusters) == 1, clusters
            created = [r for r in event_reasons(c, ns, job) if r == "Created"]
            assert len(created) <= 1, f"{job}: {created}"
        rayjobs = c.api().get(RAYJOBS.format(ns=ns))["items"]
        assert sorted(o["metadata"]["name"] for o in rayjobs if o["metadata"]["name"].startswith(
            "crash-")) == sorted(names.rayjob(job, 0) for job in jobs)
    finally:
        for job in jobs:
            JobWatch(c, operator, ns, job).delete_and_wait_gc()
