"""Ray's token authentication on the Rays kuberl runs on (issue 36; kuberl_trainer.ray_auth).

The test session's shared Ray runs as `kuberl run` runs its own: RAY_AUTH_MODE=token with a
random token (conftest), which every other run of this tier passes on, so those runs working is
the "with the token" half. Here: a `kuberl run --address` without the token is refused by that
Ray and says what to set, and a plain Ray client with it gets in. In a cluster KubeRay does the
same from the RayJob's authOptions (tests/unit/test_render.py; e2e/test_rljob.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl_trainer import ray_auth
from tests.integration.local_run import KUBERL, SHARED_RAY, failed, manifest, run_env

pytestmark = pytest.mark.integration

JOIN = """
import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR")
except BaseException as exc:
    print("REFUSED", type(exc).__name__, exc)
    sys.exit(3)
print("JOINED", int(ray.cluster_resources().get("kuberl_train", 0)))
ray.shutdown()
"""


def without_token() -> dict[str, str]:
    return {k: v for k, v in run_env().items()
            if k not in (ray_auth.MODE_ENV, ray_auth.TOKEN_ENV, ray_auth.TOKEN_PATH_ENV)}


def test_the_shared_ray_refuses_a_run_without_its_token(tiny: Path, tmp_path: Path) -> None:
    address = os.environ[SHARED_RAY]
    assert os.environ[ray_auth.MODE_ENV] == "token" and os.environ[ray_auth.TOKEN_ENV]
    # no ~/.ray/auth_token to fall back on (Ray writes one only when it makes a token itself)
    home = tmp_path / "home"
    home.mkdir()
    env = {**without_token(), "HOME": str(home)}

    job = manifest(tiny, tmp_path, "no-token")
    refused = subprocess.run([*KUBERL, "run", str(job), "--output-dir", str(tmp_path / "out"),
                              "--address", address],
                             capture_output=True, text=True, timeout=300, cwd=job.parent,
                             env=env)
    assert refused.returncode == 1, failed(refused)
    assert f"could not join the Ray at {address}" in refused.stderr, failed(refused)
    assert "RAY_AUTH_TOKEN" in refused.stderr and "RAY_AUTH_MODE=token" in refused.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()

    # a wrong token is refused too; the right one gets in
    wrong = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True,
                           text=True, timeout=300, env={**env, ray_auth.MODE_ENV: "token",
                                                        ray_auth.TOKEN_ENV: "not-the-token"})
    assert wrong.returncode == 3 and "REFUSED" in wrong.stdout, failed(wrong)
    ok = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True,
                        timeout=300, env=run_env())
    assert ok.returncode == 0 and "JOINED 16" in ok.stdout, failed(ok)


SUBMIT = """
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
deadline = time.monotonic() + 120
while True:  # the head's agent registers a moment after the dashboard answers
    try:
        job = client.submit_job(entrypoint="python -c 'print(6 * 7)'")
        break
    except RuntimeError as exc:
        if "No available agent" not in str(exc) or time.monotonic() > deadline:
            raise
        time.sleep(0.5)
while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
    assert time.monotonic() < deadline, "the job did not finish"
    time.sleep(0.2)
print(client.get_job_status(job).value, client.get_job_logs(job).split())
"""


def test_the_heads_dashboard_refuses_a_client_without_the_token(tiny: Path,
                                                                  tmp_path: Path) -> None:
    """A cluster job's head, as KubeRay starts it from the rendered RayJob (its rayStartParams,
    and the RAY_AUTH_MODE / RAY_AUTH_TOKEN that `authOptions: {mode: token}` gives it): its
    dashboard / Jobs API (8265 in a cluster, what the submitter pod calls) answers 401 without a
    token and 403 with a wrong one, while a client with the token (the submitter: `ray job
    submit` with KubeRay's env) submits and runs a job."""
    import shutil
    import socket
    import tempfile
    import time
    import urllib.error
    import urllib.request

    from kuberl_api import load
    from kuberl_operator.render.rayjob import rayjob

    rendered = rayjob(load(manifest(tiny, tmp_path, "dash")))
    cluster = rendered["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    params = dict(cluster["headGroupSpec"]["rayStartParams"])

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    dashboard = free_port()
    # Ports of its own: every local Ray (the shared one, other tests' runs) binds Ray's default
    # ports, and a head whose agent cannot bind its HTTP port (52365) never takes a job.
    params.update({"port": str(free_port()), "dashboard-port": str(dashboard),
                   "ray-client-server-port": str(free_port()),
                   "dashboard-agent-listen-port": str(free_port()), "num-cpus": "1"})
    token = "t0ken-" + os.urandom(16).hex()
    env = {**without_token(), ray_auth.MODE_ENV: "token", ray_auth.TOKEN_ENV: token}
    ray = Path(sys.executable).with_name("ray")
    # its own temp dir: `ray start` records its address there (/tmp/ray by default), which a
    # later plain ray.init() on this machine would join
    temp = tempfile.mkdtemp(prefix="kr-head-", dir="/tmp")  # short: Ray's socket paths
    head = subprocess.Popen([str(ray), "start", "--head", "--block", "--include-dashboard=true",
                             "--disable-usage-stats", f"--temp-dir={temp}",
                             *(f"--{k}={v}" for k, v in params.items())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: stopped below, not `ray stop`
    url = f"http://127.0.0.1:{dashboard}"

    def status_of(headers: dict[str, str]) -> int:
        request = urllib.request.Request(f"{url}/api/jobs/", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    try:
        deadline = time.monotonic() + 120
        while True:  # the dashboard comes up a few seconds after the GCS
            try:
                first = status_of({})
                break
            except OSError:
                assert head.poll() is None, head.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the head's dashboard never answered"
                time.sleep(0.3)
        assert first == 401
        assert status_of({"Authorization": "Bearer not-the-token"}) == 403
        assert status_of({"Authorization": f"Bearer {token}"}) == 200
        submitted = subprocess.run([sys.executable, "-c", SUBMIT, url], capture_output=True,
                                   text=True, timeout=180, env=env)
        assert submitted.returncode == 0, failed(submitted)
        assert "SUCCEEDED" in submitted.stdout and "'42'" in submitted.stdout, failed(submitted)
    finally:
        os.killpg(head.pid, 15)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)
