"""`kuberl run --in-cluster` refusing to start (its checks before Ray: preflight.py) says so on
its RLJob's status before it exits, naming its attempt, so the operator fails the job at once
instead of restarting it (kuberl_operator/status/refusal.py). The run is the real `run`, its
report the real reporter's PATCH to a real HTTP server; only the in-cluster login (the pod's
ServiceAccount files) is replaced by a reporter logged in to that server."""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberl_api import RLJob, runtime
from kuberl_api.status import RLJobStatus
from kuberl_trainer.report.status import StatusReporter
from kuberl_trainer.run import run
from tests.unit.status_api import patch_recorder

MakeJob = Callable[..., RLJob]


def broken_job(make_rljob: MakeJob, tmp_path: Path) -> RLJob:
    """Model, tokenizer and prompts that pass the checks; a reward function whose module has a
    typo (what a cluster would otherwise restart backoffLimit times)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
    return make_rljob(spec={
        "model": {"path": str(model)}, "data": {"prompts": str(prompts)},
        "training": {"backend": "fsdp"},
        "reward": {"type": "custom", "function": "kuberl_no_such_rewardz:score"}})


def run_args(tmp_path: Path, in_cluster: bool) -> argparse.Namespace:
    return argparse.Namespace(address="auto" if in_cluster else None, in_cluster=in_cluster,
                              output_dir=str(tmp_path / "out"))


def logged_in(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    reporter = StatusReporter(url, "tok", "team-a", "demo", timeout=2)
    monkeypatch.setattr(StatusReporter, "in_cluster", staticmethod(lambda: reporter))


def test_in_a_cluster_the_refusal_is_reported_for_its_attempt(
        make_rljob: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: Any) -> None:
    job = broken_job(make_rljob, tmp_path)
    monkeypatch.setenv(runtime.ENV_ATTEMPT, "2")
    with patch_recorder() as (url, seen):
        logged_in(monkeypatch, url)
        assert run(job, run_args(tmp_path, in_cluster=True)) == 1
    err = capsys.readouterr().err
    assert "error: spec.reward: " in err and "warning" not in err, err
    (body,) = seen
    assert list(body["status"]) == ["trainerRefusal"]
    refusal = RLJobStatus.model_validate(body["status"]).trainer_refusal
    assert refusal is not None and refusal.attempt == 2
    assert refusal.message.startswith("spec.reward: ") and "kuberl_no_such_rewardz" in \
        refusal.message, refusal


def test_locally_nothing_is_reported(make_rljob: MakeJob, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    job = broken_job(make_rljob, tmp_path)
    with patch_recorder() as (url, seen):
        logged_in(monkeypatch, url)
        assert run(job, run_args(tmp_path, in_cluster=False)) == 1
    assert seen == []


def test_a_refusal_it_cannot_report_still_ends_the_run(
        make_rljob: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: Any) -> None:
    """Best effort: the API server away, the run still exits 1 at once (the operator then
    restarts it as after a crash, and the next attempt reports)."""
    job = broken_job(make_rljob, tmp_path)
    monkeypatch.setenv(runtime.ENV_ATTEMPT, "0")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    logged_in(monkeypatch, dead)
    assert run(job, run_args(tmp_path, in_cluster=True)) == 1
    err = capsys.readouterr().err
    assert "error: spec.reward: " in err
    assert "could not report the refusal to the RLJob's status" in err, err
