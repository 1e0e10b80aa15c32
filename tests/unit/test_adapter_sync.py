"""LoRA's sync: adapter, the trainer's side (weight_sync/adapter.py, the engine client's
adapter naming, the engines' launch flags, the colocated handoff that keeps the base resident).

Small aiohttp servers stand in for engines here, keeping SGLang's adapter registry as its
answers show it (a name loaded twice or unloaded unknown is a 400); the real reference engine
serves the same requests in tests/integration/test_lora_run.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.engines.command import lora_flags
from kuberl_trainer.memory_handoff import CACHE_AND_GRAPHS, MemoryHandoff
from kuberl_trainer.weight_sync.adapter import AdapterPublisher, adapter_name, write_atomically


class FakeEngine:
    """An engine's adapter registry and /generate, as SGLang answers them."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, Any]] = []
        self.most = 0

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body))
        if body["lora_name"] in self.loaded:
            return web.json_response({"success": False, "error_message": "already loaded"},
                                     status=400)
        if not Path(body["lora_path"]).is_dir():
            return web.json_response({"success": False, "error_message": "no such path"},
                                     status=400)
        self.loaded[body["lora_name"]] = body["lora_path"]
        self.most = max(self.most, len(self.loaded))
        return web.json_response({"success": True, "error_message": None,
                                  "loaded_adapters": dict(self.loaded)})

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body))
        if self.loaded.pop(body["lora_name"], None) is None:
            return web.json_response({"success": False, "error_message": "not loaded"},
                                     status=400)
        return web.json_response({"success": True, "error_message": None,
                                  "loaded_adapters": dict(self.loaded)})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("generate", body))
        paths = body.get("lora_path")
        batched = isinstance(body["input_ids"][0], list)
        rows = len(body["input_ids"]) if batched else 1
        names = paths if isinstance(paths, list) else [paths] * rows
        if any(n is not None and n not in self.loaded for n in names):
            return web.json_response({"error": {"message": f"not loaded: {names}"}},
                                     status=400)
        answer = [{"text": "x", "output_ids": [7],
                   "meta_info": {"prompt_tokens": 1, "completion_tokens": 1,
                                 "finish_reason": {"type": "length"},
                                 "output_token_logprobs": [[-0.5, 7, None]],
                                 "weight_version": "default"}} for _ in range(rows)]
        return web.json_response(answer if batched else answer[0])

    async def memory(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, await request.json()))
        return web.json_response({"success": True})


@pytest.fixture
async def engines() -> AsyncIterator[list[tuple[str, FakeEngine]]]:
    servers, out = [], []
    for _ in range(2):
        fake = FakeEngine()
        app = web.Application()
        app.router.add_post("/load_lora_adapter", fake.load)
        app.router.add_post("/unload_lora_adapter", fake.unload)
        app.router.add_post("/generate", fake.generate)
        app.router.add_post("/release_memory_occupation", fake.memory)
        app.router.add_post("/resume_memory_occupation", fake.memory)
        srv = TestServer(app)
        await srv.start_server()
        servers.append(srv)
        out.append((str(srv.make_url("")).rstrip("/"), fake))
    yield out
    for srv in servers:
        await srv.close()


def write_version(root: Path, version: int) -> Path:
    def write(d: Path) -> None:
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(f'{{"v": {version}}}')
    return write_atomically(root, version, write)


async def test_the_engines_hold_at_most_the_newest_slots_versions_over_many_steps(
        engines: list[tuple[str, FakeEngine]], tmp_path: Path) -> None:
    urls = [u for u, _ in engines]
    publisher = AdapterPublisher(EngineClient(urls), tmp_path, slots=2)
    try:
        for version in range(8):
            write_version(tmp_path, version)
            await publisher.publish(urls, version)
            want = {adapter_name(v) for v in range(max(0, version - 1), version + 1)}
            for _, fake in engines:
                assert set(fake.loaded) == want
            assert publisher.reported == len(want)
            # the directories of the versions unloaded are gone: a request naming one again
            # cannot bring it back from its path (SGLang re-loads a known name from there)
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(want)
    finally:
        await publisher.client.close()
    for _, fake in engines:
        assert fake.most == 2
        # each version loaded once, from its own directory, and unloaded once
        loads = [b["lora_name"] for kind, b in fake.calls if kind == "load"]
        assert loads == [adapter_name(v) for v in range(8)]
        assert {b["lora_path"] for kind, b in fake.calls if kind == "load"} == {
            str(tmp_path / adapter_name(v)) for v in range(8)}
        assert [b["lora_name"] for kind, b in fake.calls if kind == "unload"] == [
            adapter_name(v) for v in range(6)]


async def test_a_replaced_engine_gets_every_retained_version_and_a_repeated_sync_loads_nothing(
        engines: list[tuple[str, FakeEngine]], tmp_path: Path) -> None:
    (first, one), (second, other) = engines
    publisher = AdapterPublisher(EngineClient([first]), tmp_path, slots=3)
    try:
        for version in (4, 5):
            write_version(tmp_path, version)
            await publisher.publish([first], version)
        publisher.client = EngineClient([first, second])  # (as rank 0 does on a replacement)
        write_version(tmp_path, 6)
        await publisher.publish([first, second], 6)
        assert set(other.loaded) == set(one.loaded) == {"v4", "v5", "v6"}
        calls = len(one.calls)
        await publisher.publish([first, second], 6)  # made again (another engine died)
        assert len(one.calls) == calls
    finally:
        await publisher.client.close()


def test_a_version_is_replaced_whole(tmp_path: Path) -> None:
    write_version(tmp_path, 3)
    (tmp_path / ".v3.partial").mkdir()  # an attempt cut short
    path = write_version(tmp_path, 3)
    assert path == tmp_path / "v3" and sorted(p.name for p in tmp_path.iterdir()) == ["v3"]

    def fails(d: Path) -> None:
        d.mkdir()
        raise OSError("disk full")
    with pytest.raises(OSError):
        write_atomically(tmp_path, 4, fails)
    assert not (tmp_path / "v4").exists()  # (never half a version under its name)


async def test_requests_name_the_adapter_and_carry_its_version(
        engines: list[tuple[str, FakeEngine]], tmp_path: Path) -> None:
    (url, fake), _ = engines
    fake.loaded["v7"] = str(tmp_path)
    client = EngineClient([url])
    try:
        base = await client.generate_one([1, 2], {"max_new_tokens": 1})
        assert base.weight_version == "default"  # (the engine's own: no adapter named)
        client.use_adapter("v7", 7)
        one = await client.generate_one([1, 2], {"max_new_tokens": 1})
        batch = await client.generate_spread([[1], [2], [3], [4]],
                                             [{"max_new_tokens": 1}] * 4, group=2)
    finally:
        await client.close()
    generates = [b for kind, b in fake.calls if kind == "generate"]
    assert "lora_path" not in generates[0]
    assert generates[1]["lora_path"] == "v7"
    assert generates[2]["lora_path"] == ["v7"] * 4  # (SGLang's batched form: one per prompt)
    assert one.weight_version == "7" and {r.weight_version for r in batch} == {"7"}


async def test_a_request_naming_an_unloaded_version_fails(
        engines: list[tuple[str, FakeEngine]]) -> None:
    (url, _), _ = engines
    client = EngineClient([url])
    client.use_adapter("v9", 9)
    try:
        with pytest.raises(Exception, match="not loaded"):
            await client.generate_one([1], {"max_new_tokens": 1})
    finally:
        await client.close()


def spec_with(lora: dict[str, Any], **extra: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": "/models/m"}, "data": {"prompts": "/data/p.jsonl"},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "lora": lora},
        "rollout": {"engine": "reference", **extra.pop("rollout", {})}, **extra})


def test_engines_are_launched_to_serve_the_adapter_versions_the_trainer_keeps() -> None:
    assert lora_flags(spec_with({"rank": 8})) == []  # (sync: merged: nothing of LoRA's)
    sync = spec_with({"rank": 8, "sync": "adapter"})
    assert sync.adapter_slots == 1
    assert lora_flags(sync) == ["--enable-lora", "--max-lora-rank", "8",
                                "--lora-target-modules", "all",
                                "--max-loaded-loras", "1", "--max-loras-per-batch", "1"]
    fast = spec_with({"rank": 16, "sync": "adapter", "targetModules": ["q_proj", "v_proj"]},
                     mode="async", placement="disaggregated", rollout={"gpus": 0},
                     **{"async": {"maxStaleness": 3}})
    assert fast.adapter_slots == 4
    assert lora_flags(fast) == ["--enable-lora", "--max-lora-rank", "16",
                                "--lora-target-modules", "q_proj", "v_proj",
                                "--max-loaded-loras", "4", "--max-loras-per-batch", "4"]


async def test_colocated_engines_keep_their_base_weights_through_the_handoff(
        engines: list[tuple[str, FakeEngine]]) -> None:
    from kuberl_api.spec import OffloadSpec

    (url, fake), _ = engines
    loop = asyncio.new_event_loop()  # (the session's: driven from a thread of its own here,
    client = EngineClient([url])     # while this test's loop serves the engines)
    memory = MemoryHandoff(client, loop, [], OffloadSpec(), keep_weights=True)
    try:
        await asyncio.to_thread(memory.release_engines)
        await asyncio.to_thread(loop.run_until_complete, memory.to_trainers())
        await asyncio.to_thread(memory.before_sync)
        await asyncio.to_thread(memory.to_engines)
    finally:
        await asyncio.to_thread(loop.run_until_complete, client.close())
        loop.close()
    tags = list(CACHE_AND_GRAPHS)
    assert fake.calls == [("/release_memory_occupation", {"tags": tags}),
                          ("/release_memory_occupation", {"tags": tags}),
                          ("/resume_memory_occupation", {"tags": tags})]
