"""Shared pytest options. `--update-goldens` rewrites tests/goldens/ from the renderers
(`make goldens`); review the diff like code."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberl_api import RLJob, parse

TESTS = Path(__file__).resolve().parent
# Helpers such as tests/schemas.py import as top-level modules from any test directory.
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers share the machine's cores: each test process, and the
    local runs and actors it starts, gets its share of them. Torch's OpenMP threads spin while
    they wait, so two runs of two threads per actor on two cores took 1.4x as long as two
    runs of one (tests/integration/test_algorithms.py, 209 s against 147 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        share = str(max(1, len(os.sched_getaffinity(0)) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        os.environ.setdefault("KUBERL_TORCH_THREADS", share)  # (actors.torch_threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/goldens/* from the current renderers instead of "
                          "comparing against them")


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


# A minimal valid RLJob (1 node x 8 GPUs, colocated); tests override what they are about.
BASE_RLJOB: dict[str, Any] = {
    "apiVersion": "kuberl.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {
        "model": {"path": "/models/qwen"},
        "data": {"prompts": "/data/prompts.jsonl"},
    },
}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, recursively for mappings; a None value deletes the key."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture
def make_rljob() -> Callable[..., RLJob]:
    """make_rljob(spec={...}, metadata={...}) -> a validated RLJob built on BASE_RLJOB."""

    def build(spec: dict[str, Any] | None = None,
              metadata: dict[str, Any] | None = None) -> RLJob:
        manifest = deep_merge(BASE_RLJOB, {"spec": spec or {}, "metadata": metadata or {}})
        return parse(manifest)

    return build
