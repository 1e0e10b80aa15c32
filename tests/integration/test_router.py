"""SGLang's router (a real sglang-router process, kuberl_trainer.engines.router) in front of
two real reference engines, driven by the trainer's own client: a GRPO group's samples land on one
engine, groups spread over the engines, the samples are the ones the engines make without the
router (their seeds travel), and an engine taken out gets no more requests.
(The router in whole runs, with engines dying and hanging: test_local_run.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.engines.router import Router
from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.integration.test_reference_engine import Engine
from tests.integration.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration

GROUP = 4
PARAMS = {"temperature": 1.0, "max_new_tokens": 6}


@pytest.fixture(scope="module", autouse=True)
def api_key() -> Iterator[str]:
    """The engines and the client share a key through the environment, as a job's do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENGINE_API_KEY_ENV, "router-module-key")
        yield "router-module-key"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory, api_key: str) -> Iterator[list[str]]:
    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    logs = tmp_path_factory.mktemp("engine-logs")
    engines = [Engine(model, logs / f"engine{i}.log", "--enable-metrics") for i in range(2)]
    try:
        for engine in engines:
            engine.wait_ready()
        yield [e.url for e in engines]
    finally:
        for engine in engines:
            engine.stop()


@pytest_asyncio.fixture
async def routed(urls: list[str], tmp_path: Path) -> AsyncIterator[tuple[EngineClient, Router]]:
    client = EngineClient(urls, request_timeout_s=60)
    await client.wait_healthy(timeout_s=60)
    router = Router(client, log=tmp_path / "router.log")
    try:
        await router.start()
        client.router_url = router.url
        yield client, router
    finally:
        router.stop()
        await client.close()


def groups(n: int, first: int = 0) -> tuple[list[list[int]], list[dict[str, object]]]:
    """n GRPO groups of GROUP samples: a prompt each, a seed per sample."""
    prompts = [[4, 5, 6 + g] for g in range(first, first + n) for _ in range(GROUP)]
    params: list[dict[str, object]] = [{**PARAMS, "sampling_seed": 100 + i}
                                       for i in range(len(prompts))]
    return prompts, params


async def served(client: EngineClient) -> dict[str, int]:
    """Requests each engine has served so far (its own count: sglang:num_requests_total)."""
    out = {}
    for url in client.urls:
        text = await client.request(url, "GET", "/metrics")
        out[url] = int(sum(float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("sglang:num_requests_total")))
    return out


async def delta(client: EngineClient, before: dict[str, int]) -> dict[str, int]:
    now = await served(client)
    return {u: now[u] - before[u] for u in now}


async def test_a_groups_samples_go_to_one_engine_and_groups_spread(
        routed: tuple[EngineClient, Router]) -> None:
    client, _ = routed
    landed = []
    for g in range(6):  # one group at a time: where each one went
        before = await served(client)
        results = await client.generate_spread(*groups(1, g), group=GROUP)
        assert len(results) == GROUP
        landed.append(await delta(client, before))
    assert all(sorted(d.values()) == [0, GROUP] for d in landed), landed
    # (Which engine a lone group goes to is not asserted: with both engines idle, min_load
    # breaks the tie at random, so six groups in a row all land on one engine 1 time in 32.)
    before = await served(client)  # many groups at once: spread over both engines, none split
    await client.generate_spread(*groups(8), group=GROUP)
    counts = await delta(client, before)
    assert sum(counts.values()) == 8 * GROUP
    assert all(c % GROUP == 0 and c > 0 for c in counts.values()), counts


async def test_the_router_changes_which_engine_not_which_samples(
        routed: tuple[EngineClient, Router]) -> None:
    client, _ = routed
    prompts, params = groups(4)
    through = await client.generate_spread(prompts, params, group=GROUP)
    client.router_url = None  # the client's own balancing, same seeds
    direct = await client.generate_spread(prompts, params, group=GROUP)
    assert [r.output_ids for r in through] == [r.output_ids for r in direct]
    assert len({tuple(r.output_ids) for r in through}) > 1  # (sampled: the seeds differ)
    assert all(r.engine_url == "" for r in through)  # (the router does not say which)


async def test_an_engine_taken_out_gets_no_more_requests(
        routed: tuple[EngineClient, Router]) -> None:
    client, router = routed
    out, kept = client.urls
    await router.remove(out)
    before = await served(client)
    await client.generate_spread(*groups(6), group=GROUP)
    assert await delta(client, before) == {out: 0, kept: 6 * GROUP}
    await router.add(out)
    before = await served(client)
    await client.generate_spread(*groups(6), group=GROUP)
    assert (await delta(client, before))[out] > 0
