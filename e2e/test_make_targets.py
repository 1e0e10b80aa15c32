"""`make cluster-up` and `make cluster-down` as the README tells a user to run them: a control
plane of its own (beside the session's), reached with the lines `cluster.py env` prints."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]


def make(target: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", target, f"STATE_DIR={state}"], cwd=ROOT, text=True,
                          capture_output=True, timeout=420)


def test_cluster_up_env_and_down(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = make("cluster-up", state)
    try:
        assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
        # `eval "$(.venv/bin/python e2e/cluster.py env)"`, as the README says
        printed = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "e2e/cluster.py",
                                  "env", "--state-dir", str(state)], cwd=ROOT, text=True,
                                 capture_output=True, check=True).stdout
        env = dict(os.environ)
        for line in printed.splitlines():
            key, value = shlex.split(line.removeprefix("export "))[0].split("=", 1)
            env[key] = value.replace("$PATH", os.environ["PATH"])
        assert env["KUBECONFIG"] == str(state / "admin.kubeconfig")
        nodes = subprocess.run(["kubectl", "get", "nodes", "-L", "pool", "--no-headers"],
                               env=env, text=True, capture_output=True, check=True).stdout
        assert {line.split()[-1] for line in nodes.splitlines()} == {"train", "rollout", "cpu"}
        crd = subprocess.run(["kubectl", "get", "crd", "rljobs.kuberl.dev", "-o", "name"],
                             env=env, text=True, capture_output=True)
        assert crd.returncode == 0, crd.stderr  # `up --crds crds`: the RLJob CRD is in
    finally:
        down = make("cluster-down", state)
    assert down.returncode == 0, (down.stdout[-3000:], down.stderr[-3000:])
    assert not state.exists()
    left = subprocess.run(["pgrep", "-af", str(state)], text=True, capture_output=True).stdout
    assert not left, left  # every process of that control plane stopped
