"""Where `kuberl run` finds environment.image's service (agents/service.py): the class served
as a local subprocess (started on a free port, waited on, stopped at the end), a URL
(--environment-url, or what the operator sets on the head), and the clear errors before
anything starts when none of it can work."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberl_api import RLJob, runtime
from kuberl_trainer.agents import service as service_module
from kuberl_trainer.agents.remote import EnvironmentService, EnvironmentUnavailable
from kuberl_trainer.agents.service import environment_service
from kuberl_trainer.options import Options, options

MakeJob = Callable[..., RLJob]
CHECKER = "tests.integration.agent_tasks:Checker"


def run_options(job: RLJob, tmp_path: Path, **flags: Any) -> Options:
    args = argparse.Namespace(address=None, in_cluster=False, output_dir=str(tmp_path),
                              **flags)
    return options(job, args)


def image_job(make_rljob: MakeJob, cls: str = CHECKER) -> RLJob:
    return make_rljob(spec={"environment": {"class": cls, "image": "checker:1",
                                            "timeoutSeconds": 7}})


def test_the_url_comes_from_the_flag_or_the_operator(
        make_rljob: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--environment-url wins over what the operator sets on the head; a job without an image
    ignores the variable (it is the operator's, for image jobs only)."""
    job, ready = image_job(make_rljob), []
    monkeypatch.setattr(EnvironmentService, "wait_ready",
                        lambda self, timeout_s: ready.append((self.url, timeout_s)))
    monkeypatch.setenv(runtime.ENV_ENVIRONMENT_URL, "http://demo-env:8000")
    opts = run_options(job, tmp_path)
    opts.in_cluster = True
    with environment_service(job.spec, opts) as svc:
        assert svc is not None and svc.url == "http://demo-env:8000" and svc.resolves
    flagged = run_options(job, tmp_path, environment_url="http://127.0.0.1:9000")
    with environment_service(job.spec, flagged) as svc:
        assert svc is not None and svc.url == "http://127.0.0.1:9000" and not svc.resolves
    assert ready == [("http://demo-env:8000", 600.0), ("http://127.0.0.1:9000", 30.0)]
    in_process = make_rljob(spec={"environment": {"class": CHECKER}})
    with environment_service(in_process.spec, run_options(in_process, tmp_path)) as svc:
        assert svc is None


def test_what_cannot_work_is_refused_before_anything_starts(
        make_rljob: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.ENV_ENVIRONMENT_URL, raising=False)
    in_process = make_rljob(spec={"environment": {"class": CHECKER}})
    opts = run_options(in_process, tmp_path, environment_url="http://127.0.0.1:9")
    with pytest.raises(EnvironmentUnavailable, match=r"--environment-url needs "
                       r"spec\.environment\.image"), environment_service(in_process.spec, opts):
        pass
    job = image_job(make_rljob)
    opts = run_options(job, tmp_path)
    opts.in_cluster = True
    with pytest.raises(EnvironmentUnavailable, match=r"\$KUBERL_ENVIRONMENT_URL is not set"), \
            environment_service(job.spec, opts):
        pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setitem(service_module.READY_TIMEOUT_S, False, 0.3)
    with pytest.raises(EnvironmentUnavailable, match=rf"{CHECKER} at {dead} is not ready "
                       r"after 0.3 s \(/health: "), \
            environment_service(job.spec, run_options(job, tmp_path, environment_url=dead)):
        pass


def test_without_an_image_there_is_no_service(make_rljob: MakeJob, tmp_path: Path) -> None:
    job = make_rljob(spec={"environment": {"class": CHECKER}})
    with environment_service(job.spec, run_options(job, tmp_path)) as svc:
        assert svc is None


def test_the_class_is_served_locally_for_the_run_and_stopped_after(
        make_rljob: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.ENV_ENVIRONMENT_URL, raising=False)
    job = image_job(make_rljob)
    with environment_service(job.spec, run_options(job, tmp_path)) as svc:
        assert svc is not None and svc.url.startswith("http://127.0.0.1:")
        assert svc.timeout_s == 7 and svc.name == CHECKER

        async def one_episode() -> list[Any]:
            env = svc()
            answers = [await env.reset({"prompt": "1+1=", "label": "2"}, mode="strict")]
            answers += [await env.step([5], "2"), await env.step([6], "3")]
            await env.close()
            return answers

        observation, first, second = asyncio.run(one_episode())
        assert observation == {}
        assert first["done"] is False and second["done"] is True
        assert second["metrics"] == {"steps": 2.0}
    with pytest.raises(EnvironmentUnavailable):
        svc.wait_ready(0.2)  # gone with the run
    assert "serving tests.integration.agent_tasks:Checker on" in (
        tmp_path / "logs" / "environment.log").read_text()  # beside the engines' logs


def test_a_class_the_local_server_cannot_serve_is_an_error_naming_it(
        make_rljob: MakeJob, tmp_path: Path) -> None:
    job = image_job(make_rljob, "tests.no_such_module:Env")
    with pytest.raises(EnvironmentUnavailable, match=r"^spec.environment.class: the local "
                       r"environment server for tests.no_such_module:Env exited with code 2: "
                       r".*cannot import module 'tests.no_such_module'"), \
            environment_service(job.spec, run_options(job, tmp_path)):
        pass
