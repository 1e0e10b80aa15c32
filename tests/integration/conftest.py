"""Fixtures: a fresh API emulator per test, and the real operator (`python -m kuberl_operator`)
as a subprocess logged in to it through a KUBECONFIG file (see helpers.Operator)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from kuberl_trainer import ray_auth
from tests.integration.emulator import Emulator, declare_resources
from tests.integration.helpers import Operator

# Ray's token authentication, as kuberl's own Rays have it (kuberl_trainer.ray_auth): one token
# for the test session, in this process's environment before anything imports Ray (Ray reads
# it once, then), so the shared Ray's host, the Sessions tests drive here and every `kuberl run`
# (local_run.run_env copies this environment) carry it.
ray_auth.enable_for_local_ray()


@pytest.fixture
async def k8s() -> AsyncIterator[Emulator]:
    async with Emulator() as emu, kmock.Server(emu):
        declare_resources(emu)
        yield emu


@pytest.fixture
async def operator(k8s: Emulator, tmp_path: Path,
                   request: pytest.FixtureRequest) -> AsyncIterator[Operator]:
    op = Operator(k8s, tmp_path, [])
    await op.start()
    yield op
    await op.stop()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        sys.stderr.write(f"----- operator log -----\n{op.output()[-20000:]}\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep




def pytest_configure(config: pytest.Config) -> None:
    # kmock 0.8 reads its bundled resources with a deprecated importlib call.
    config.addinivalue_line("filterwarnings", "ignore:read_binary:DeprecationWarning")


@pytest.fixture(scope="session")
def tiny() -> Path:
    """The tiny job's model and data (tests.integration.local_run.tiny_job)."""
    from tests.integration.local_run import tiny_job

    return tiny_job()


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """The tiny job on a mixture-of-experts policy (tests.integration.local_run.tiny_moe_job)."""
    from tests.integration.local_run import tiny_moe_job

    return tiny_moe_job()


@pytest.fixture(scope="session")
def teacher() -> Path:
    """The tiny job's model trained longer (its data is the same): a distillation teacher."""
    from tests.integration.local_run import TEACHER_SFT_STEPS, tiny_job

    return tiny_job(TEACHER_SFT_STEPS)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str
               ) -> Callable[[str, Path], Path]:
    """shared_run(key, job) -> the output directory of `kuberl run job`, run once per session
    for each key by whichever test needs it first (xdist workers share the session's base
    directory, and take turns under a lock). For runs that several tests compare with (the
    fault tests' undisturbed runs, the resume tests' uninterrupted one): same key, same job."""
    from kuberl_trainer.tiny.build import exclusive
    from tests.integration.local_run import failed, kuberl_run

    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(key: str, job: Path) -> Path:
        out = root / key
        with exclusive(root / f"{key}.lock"):
            if not (out / "done").exists():
                shutil.rmtree(out, ignore_errors=True)
                res = kuberl_run(job, out, timeout=600)
                assert res.returncode == 0, failed(res)
                (out / "done").touch()
        return out

    return get


@pytest.fixture(scope="session", autouse=True)
def shared_ray() -> Iterator[str]:
    """One Ray per test process that its local runs join (`kuberl run --address`, and the
    Sessions tests drive themselves) instead of each starting and stopping its own: 2.3 s of
    every run on 2 cores. A Ray whose nodes are all this machine makes `kuberl run` behave as
    a local run (log files, cores shared, free ports: options.Options.one_machine). The runs that
    test what only a run's own Ray does (its process tree, `make demo`) start theirs. It checks
    the session's Ray token (set above), which the runs that join it pass on."""
    from tests.integration.local_run import ENV, SHARED_RAY, ray_host_script

    env = {**ENV, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    host = subprocess.Popen([sys.executable, "-c", ray_host_script()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert host.stdout is not None and host.stdin is not None
    address = host.stdout.readline().strip()
    assert address, "the shared Ray did not start"
    os.environ[SHARED_RAY] = address
    try:
        yield address
    finally:
        os.environ.pop(SHARED_RAY, None)
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()
