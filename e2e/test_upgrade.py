"""An upgrade with a job running: an RLJob that an earlier kuberl release accepted, and that this
one's rules refuse, keeps being reconciled after the CRD and the operator are upgraded
(kuberl_operator/status/ratchet.py; the rules' ValidatingAdmissionPolicy ratchets likewise).

The earlier release is kuberl at EARLIER, the last commit before be39d6d made
`model.tokenizer` lie under `model.storage.mountPath`: its CRD (a fixture, from that commit)
and its operator, the code of that commit (`git archive`) run with this checkout's venv. So the
job's status, its digests and its RayJob are what that release really wrote, not a test's idea
of them. Then the upgrade as the README gives it: this checkout's CRD applied, this
checkout's operator started. KubeRay provisions the earlier operator's RayJob; the Ray
dashboard's job status is played as in test_lifecycle.py (stand_in.py).
"""

from __future__ import annotations

import copy
import io
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import Cluster
from polling import wait_for
from rljobs import (
    ROOT,
    JobWatch,
    Operator,
    condition,
    cpu_job,
    events_for,
    install_crds,
    kubectl_apply,
    namespace,
    provisioned,
    static_claims,
    wait_phase,
)
from stand_in import KUBERAY, dashboard_says

from kuberl_api import WAIVED_ANNOTATION
from kuberl_operator.render import names

pytestmark = pytest.mark.e2e

EARLIER = "df73a0d"
EARLIER_CRD = Path(__file__).resolve().parent / "fixtures" / f"rljob-crd-{EARLIER}.yaml"
# The operator's code is what a release's CRD was made from and runs with.
EARLIER_CODE = ("operator", "env_image", "wire")
TOKENIZER_RULE = "tokenizer must lie under storage.mountPath when a PVC holds the model"
JOB = "upgraded"


@pytest.fixture(scope="module")
def earlier_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kuberl's packages as of EARLIER, from this repository's history."""
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{EARLIER}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.fail(f"commit {EARLIER} (the earlier release this test upgrades from) is not in "
                    f"this clone's history: a shallow clone? `git fetch --unshallow`")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", EARLIER,
                              *EARLIER_CODE], capture_output=True, check=True).stdout
    root = tmp_path_factory.mktemp(f"kuberl-{EARLIER}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return root


@pytest.fixture
def upgrade_ns(k8s_cluster: Cluster) -> Iterator[str]:
    with namespace(k8s_cluster, "e2e-upgrade") as ns, static_claims(k8s_cluster, ns, ["models"]):
        yield ns


def manifest(ns: str) -> dict[str, Any]:
    """A CPU job (the cpu pool takes its pods) whose tokenizer lies outside the model's PVC:
    accepted before be39d6d, refused since."""
    job: dict[str, Any] = cpu_job(JOB, ns, backoffLimit=1)
    job["spec"]["model"] = {"path": "/models/tiny", "tokenizer": "/mnt/tokenizers/tiny",
                            "storage": {"pvc": "models", "mountPath": "/models"}}
    return job


def test_job_of_an_earlier_release_runs_on_after_the_upgrade(
        k8s_cluster: Cluster, upgrade_ns: str, earlier_release: Path, tmp_path: Path) -> None:
    """Applied and started under the earlier release; after the upgrade, this operator tracks
    its RayJob (Running), with SpecWarning=True naming the field and the rule and one Warning
    Event; an edit of an editable field is admitted (the policy ratchets the unchanged section)
    and one of the offending field is refused, by this release's rule; a failed attempt is
    restarted from the spec as accepted, which then runs to Succeeded."""
    c, ns = k8s_cluster, upgrade_ns
    job = manifest(ns)
    refused = kubectl_apply(c, job)  # today's CRD, as the session installed it
    assert refused.returncode != 0 and TOKENIZER_RULE in refused.stderr, refused.stderr

    op = Operator(c, ns, tmp_path / "operator-earlier.log", code=earlier_release)
    w = JobWatch(c, op, ns, JOB)
    r0 = names.rayjob(JOB, 0)
    try:
        install_crds(c, [EARLIER_CRD])
        wait_for("the earlier CRD to admit the job", lambda: kubectl_apply(c, job).returncode
                 == 0, timeout=30, interval=0.5)
        op.start()
        provisioned(w, 0)  # the earlier operator created attempt 0; KubeRay brought it up
        earlier = w.status()
        assert condition(w.get(), "Accepted")["status"] == "True", earlier
        assert earlier["specDigests"] and earlier["rayJobName"] == r0, earlier
        op.stop()

        # The upgrade: this release's CRD, then its operator.
        install_crds(c)
        op.code, op.log = None, tmp_path / "operator.log"
        op.start()
        with c.paused(KUBERAY):
            dashboard_says(c, ns, r0, "RUNNING")
            st = wait_phase(w, "Running")
            warning = w.wait_condition("SpecWarning", "True")
            assert warning["reason"] == "AcceptedByEarlierRelease", warning
            assert f"spec.model.tokenizer: {TOKENIZER_RULE}" in warning["message"], warning
            assert "/mnt/tokenizers/tiny" in warning["message"], warning
            assert condition(w.get(), "Accepted")["status"] == "True"
            # This release computes the digests the earlier one recorded: nothing "changed".
            assert st["specDigests"] == earlier["specDigests"], (st, earlier)
            assert st["rayJobName"] == r0 and st["restarts"] == 0, st

            # The API server ratchets too: an editable field may change (the model section,
            # unchanged, is not checked again) ...
            edited = copy.deepcopy(job)
            edited["spec"]["backoffLimit"] = 2
            admitted = kubectl_apply(c, edited)
            assert admitted.returncode == 0, admitted.stderr
            # ... the offending field may not, by this release's rule (the job has started,
            # so the immutability rule refuses it too).
            edited["spec"]["model"]["tokenizer"] = "/mnt/tokenizers/other"
            changed = kubectl_apply(c, edited)
            assert changed.returncode != 0 and TOKENIZER_RULE in changed.stderr, changed.stderr

            # Its Ray job fails: restarted as attempt 1, rendered by this operator from the
            # spec as accepted; the config names the waived field for this release's trainer.
            dashboard_says(c, ns, r0, "FAILED")
            r1 = names.rayjob(JOB, 1)
            wait_for(f"the restart as {r1}", lambda: w.status().get("rayJobName") == r1
                     and w.rayjob(1), timeout=30, detail=w.detail)
            config = c.api().get(f"/api/v1/namespaces/{ns}/configmaps/{names.configmap(JOB)}")
            rendered = yaml.safe_load(config["data"][names.CONFIG_KEY])
            assert rendered["spec"]["model"]["tokenizer"] == "/mnt/tokenizers/tiny", rendered
            assert rendered["metadata"]["annotations"] == {
                WAIVED_ANNOTATION: '["spec.model.tokenizer"]'}, rendered["metadata"]
            dashboard_says(c, ns, r1, "RUNNING")
            wait_phase(w, "Running")
            dashboard_says(c, ns, r1, "SUCCEEDED")
            done = wait_phase(w, "Succeeded")
            assert done["restarts"] == 1 and done["completionTime"], done
        warnings = [e for e in events_for(c.api(), ns, JOB)
                    if e["reason"] == "AcceptedByEarlierRelease"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings
        assert "spec.model.tokenizer" in warnings[0]["message"], warnings
        errors = [line for line in op.log.read_text(errors="replace").splitlines()
                  if "reconcile of" in line and "failed" in line]
        assert not errors, "\n".join(errors[:20])
    finally:
        w.delete_and_wait_gc()
        op.stop()
        install_crds(c)  # today's CRD for the tests after this one, whatever happened
