"""rollout.function and environment.class are imported before Ray starts: a typo, a missing
dependency or code that does not fit the protocol fails `kuberl run` at once, naming the
field."""

from __future__ import annotations

from typing import Any

import pytest

from kuberl_api import parse
from kuberl_trainer.preflight import PreflightError, check_agent


def spec(**parts: Any) -> Any:
    body = {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"},
            "training": {"backend": "fsdp", "gpusPerNode": 0},
            "rollout": {"engine": "reference"}}
    for key, value in parts.items():
        body[key] = {**body.get(key, {}), **value}
    return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "x"}, "spec": body}).spec


def sync_run(ctx: Any) -> None:
    """Not async: refused."""


class NoClose:
    async def reset(self, sample: Any) -> None: ...
    async def step(self, ids: list[int], text: str) -> None: ...


def test_the_users_code_is_imported_and_returned() -> None:
    from tests.integration import agent_tasks

    function, env = check_agent(spec(rollout={"function":
                                              "tests.integration.agent_tasks:ask_twice"}))
    assert function is agent_tasks.ask_twice and env is None
    function, env = check_agent(spec(environment={"class":
                                                  "tests.integration.agent_tasks:Checker"}))
    assert function is None and env is agent_tasks.Checker
    assert check_agent(spec()) == (None, None)


@pytest.mark.parametrize("parts, why", [
    ({"rollout": {"function": "tests.no_such_module:run"}},
     r"^spec.rollout.function: cannot import module 'tests.no_such_module'"),
    ({"rollout": {"function": "tests.integration.agent_tasks:nothing"}},
     r"^spec.rollout.function: .* has no attribute 'nothing'"),
    ({"rollout": {"function": "tests.unit.test_preflight_agent:sync_run"}},
     r"^spec.rollout.function: .* must be `async def`"),
    ({"environment": {"class": "tests.unit.test_preflight_agent:NoClose"}},
     r"^spec.environment.class: .* needs `async def close`"),
])
def test_code_that_cannot_run_fails_before_ray_naming_the_field(parts: dict[str, Any],
                                                                 why: str) -> None:
    with pytest.raises(PreflightError, match=why):
        check_agent(spec(**parts))
