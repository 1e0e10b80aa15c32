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
