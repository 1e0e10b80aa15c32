"""The make targets the README tells a user about, run as a user runs them (the e2e tier runs
`make cluster-up` and `make cluster-down`; `make test` is what CI runs; `make demo` is here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.integration.local_run import ENV, ROOT, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PHASES = ["checks", "ray", "placement", "engines ready", "trainers ready", "first weights"]


def test_make_demo_runs_the_tiny_job_and_says_where_its_start_up_went(
        tiny: Path, tmp_path: Path) -> None:
    """`make demo` with its manifest cut to two steps and the tiny build the tests share (the
    same recipe as the demo's own, so the target's build step reuses it): the venv's
    `kuberl run` from the repository root, a start-up line whose phases add up to its total,
    the step table and the reward summary."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny / "model")
    spec["data"]["prompts"] = str(tiny / "data" / "train.jsonl")
    spec["data"]["evalSets"][0]["path"] = str(tiny / "data" / "eval.jsonl")
    spec["schedule"]["numRollouts"] = 2
    job, out = tmp_path / "tiny-grpo.yaml", tmp_path / "out"
    job.write_text(yaml.safe_dump(doc))
    # A machine where `ray start` once ran and died: its address file stays in Ray's temp dir,
    # and a plain ray.init() would try to join it. The demo starts a Ray of its own anyway.
    ray_tmp = Path(tempfile.mkdtemp(prefix="kr-demo-", dir="/tmp"))  # short: Ray's sockets
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    try:
        res = subprocess.run(["make", "demo", f"DEMO_TINY={tiny}", f"DEMO_JOB={job}",
                              f"DEMO_OUT={out}"], cwd=ROOT, env={**ENV, "RAY_TMPDIR": str(ray_tmp)},
                             capture_output=True, text=True, timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert f"tiny: reusing {tiny}" in res.stdout
    assert f"logs: {out / 'logs'}/" in res.stdout
    line = next(t for t in res.stdout.splitlines() if t.startswith("start-up "))
    found = re.fullmatch(r"start-up ([0-9.]+) s: (.*)", line)
    assert found, line
    phases = [part.rsplit(" ", 1) for part in found.group(2).split(", ")]
    assert [name for name, _ in phases] == PHASES, line
    # each phase rounded to 0.1 s: their sum is the total within the rounding
    assert sum(float(s) for _, s in phases) == pytest.approx(float(found.group(1)), abs=0.4)
    assert res.stdout.index(line) < res.stdout.index("step  reward")  # before the first step
    assert "reward: first-1 mean" in res.stdout
    assert [r["step"] for r in metrics(out)] == [0, 1]
