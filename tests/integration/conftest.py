"""Fixtures: a fresh API emulator per test, and the real operator (`python -m kuberl_operator`)
as a subprocess logged in to it through a KUBECONFIG file (see helpers.Operator)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from tests.integration.emulator import Emulator, declare_resources
from tests.integration.helpers import Operator


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
def teacher() -> Path:
    """The tiny job's model trained longer (its data is the same): a distillation teacher."""
    from tests.integration.local_run import TEACHER_SFT_STEPS, tiny_job

    return tiny_job(TEACHER_SFT_STEPS)
