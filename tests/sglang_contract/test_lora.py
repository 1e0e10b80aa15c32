"""LoRA against the pinned SGLang itself: the load/unload bodies kuberl sends construct its
request types, /generate's lora_path normalizes as kuberl sends it, the reference engine's
LoRA flags parse as SGLang's parser parses them, its answers serialize as SGLang's
LoRAUpdateOutput does, and its registry (lora_service) names, orders and refuses adapters as
SGLang's LoRARegistry does."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import orjson
import pytest

from kuberl_rollout.reference.__main__ import build_parser, parse_args
from kuberl_rollout.reference.lora import (
    SUPPORTED_TARGETS,
    engine_targets,
    normalized_targets,
    update_output,
)
from kuberl_rollout.reference.lora_service import LoraService
from kuberl_wire import protocol
from tests.sglang_contract.conftest import load_io_struct

io_struct = load_io_struct()
from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry  # noqa: E402  isort: skip
from sglang.srt.lora.utils import get_normalized_target_modules  # noqa: E402  isort: skip
from sglang.srt.server_args import ServerArgs  # noqa: E402  isort: skip
from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES  # noqa: E402  isort: skip

LORA_FLAGS = ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loaded_loras",
              "max_loras_per_batch")


def build(type_name: str, body: dict[str, Any]) -> Any:
    cls = getattr(io_struct, type_name)
    assert set(body) <= {f.name for f in dataclasses.fields(cls)}
    return cls(**body)


@pytest.mark.parametrize("type_name, body", [
    ("LoadLoRAAdapterReqInput", protocol.load_lora_adapter("step-3", "/adapters/3")),
    ("LoadLoRAAdapterReqInput", protocol.load_lora_adapter("base", "/a", pinned=True)),
    ("UnloadLoRAAdapterReqInput", protocol.unload_lora_adapter("step-2")),
])
def test_lora_bodies_build_sglang_types(type_name: str, body: dict[str, Any]) -> None:
    req = build(type_name, body)
    assert req.lora_name == body["lora_name"]
    assert getattr(req, "pinned", False) == body.get("pinned", False)


@pytest.mark.parametrize("body, rows", [
    ({"input_ids": [1, 2], "lora_path": "a"}, "a"),
    ({"input_ids": [[1], [2], [3]], "lora_path": "a"}, ["a", "a", "a"]),
    ({"input_ids": [[1], [2]], "lora_path": ["a", None]}, ["a", None]),
])
def test_generate_takes_lora_path_as_kuberl_sends_it(body: dict[str, Any], rows: Any) -> None:
    req = build("GenerateReqInput", body)
    req.normalize_batch_and_arguments()
    assert req.lora_path == rows


def sglang_lora_args(argv: list[str]) -> dict[str, Any]:
    """SGLang's parser, then its own LoRA checks (check_lora_server_args: 'all' expanded)."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", *argv])
    args = ServerArgs.__new__(ServerArgs)
    for field in dataclasses.fields(ServerArgs):
        setattr(args, field.name, getattr(ns, field.name, field.default))
    args.check_lora_server_args()
    return {k: getattr(args, k) for k in LORA_FLAGS}


@pytest.mark.parametrize("argv", [
    [],
    ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"],
    ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
     "--max-loaded-loras", "4", "--max-loras-per-batch", "2"],
])
def test_the_reference_engines_lora_flags_mean_what_sglangs_mean(argv: list[str]) -> None:
    want = sglang_lora_args(argv)
    got = vars(parse_args(["--model-path", "m", *argv]))
    ours = {k: got[k] for k in LORA_FLAGS}
    if ours["lora_target_modules"] is not None:
        ours["lora_target_modules"] = engine_targets(ours["lora_target_modules"])
    assert ours == {**want, "enable_lora": bool(want["enable_lora"])}


@pytest.mark.parametrize("argv", [
    ["--enable-lora", "--max-lora-rank", "8"],
    ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"],
    ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
     "--max-loaded-loras", "2"],
])
def test_lora_flag_combinations_sglang_refuses_are_refused(argv: list[str]) -> None:
    with pytest.raises(AssertionError) as sglang:
        sglang_lora_args(argv)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", *argv])
    assert str(sglang.value)  # (the reference engine's message is the same text)


def test_target_modules_are_sglangs() -> None:
    assert list(SUPPORTED_TARGETS) == SUPPORTED_LORA_TARGET_MODULES
    choices = next(a.choices for a in build_parser()._actions
                   if "--lora-target-modules" in a.option_strings)
    assert list(choices or []) == [*SUPPORTED_LORA_TARGET_MODULES, "all"]
    names = ["q_proj", "model.layers.1.mlp.up_proj", "down_proj", "k_proj", "gate_up_proj"]
    assert normalized_targets(names) == get_normalized_target_modules(names)


def test_answers_serialize_as_sglangs_lora_update_output() -> None:
    """SGLang's HTTP server returns the dataclass through ORJSONResponse: every field, BaseReq's
    first; the reference engine's dicts (lora.AdapterSet.answer) have the same keys, in order."""
    sglang = orjson.loads(orjson.dumps(io_struct.LoadLoRAAdapterReqOutput(
        success=True, error_message="", loaded_adapters={"a": "/p"})))
    ours = update_output(True, "", {"a": "/p"})
    assert list(ours.items()) == list(sglang.items())
    failed = orjson.loads(orjson.dumps(io_struct.UnloadLoRAAdapterReqOutput(
        success=False, error_message="x")))
    assert list(update_output(False, "x", None).items()) == list(failed.items())


async def test_the_registry_orders_and_refuses_as_sglangs() -> None:
    """The same loads and lookups on SGLang's LoRARegistry and on lora_service's: the same
    least recently used adapter, the same messages for unknown names."""
    async def on_worker(fn: Any, *args: Any) -> Any:
        return fn(*args)

    loaded: dict[str, str] = {}

    def load(ref: Any) -> dict[str, Any]:
        loaded[ref.lora_id] = ref.lora_name
        return {"success": True, "error_message": "", "loaded_adapters": {}}

    def unload(lora_id: str) -> dict[str, Any]:
        loaded.pop(lora_id)
        return {"success": True, "error_message": "", "loaded_adapters": {}}

    ours = LoraService(enabled=True, max_loaded_loras=None, load=load, unload=unload,
                       on_worker=on_worker)
    theirs = LoRARegistry()
    for name, pinned in (("a", True), ("b", False), ("c", False)):
        await theirs.register(LoRARef(lora_name=name, lora_path=f"/{name}", pinned=pinned))
        assert (await ours.load(name, f"/{name}", pinned))["success"]
    for names in (["b"], ["a", None, "c"], ["b", "a"]):
        await theirs.release(await theirs.acquire(names))
        await ours.release(await ours.acquire(names))
        assert list(ours.registry) == list(theirs.get_all_adapters())
        assert next(n for n, r in ours.registry.items() if not r.pinned) == \
            await theirs.lru_lora_name(exclude_pinned=True)
    with pytest.raises(ValueError) as sglang:
        await theirs.unregister("zz")
    assert (await ours.unload("zz"))["error_message"] == str(sglang.value)
    await theirs.unregister("b")
    with pytest.raises(ValueError) as sglang:
        await theirs.acquire("b")
    with pytest.raises(ValueError) as ref:
        ours.registry.pop("b")
        ours._lookup("b")
    assert str(ref.value) == str(sglang.value)
