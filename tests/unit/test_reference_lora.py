"""LoRA in the reference engine: every row of a batch runs under its own adapter and its
log-probs are HF + PEFT's (PeftModel.from_pretrained) for that adapter, also when requests
join and leave a running batch; adapters load and unload with SGLang 0.5.6's checks and
messages (lora.AdapterSet); the tokenizer side's rules (lora_service.LoraService): names,
re-loading an unloaded name, the --max-loaded-loras bound and its eviction, and an unload
waiting for the requests that use the adapter. In-process on the tiny model."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from kuberl_rollout.reference.engine import GenRequest, ReferenceEngine
from kuberl_rollout.reference.lora import SUPPORTED_TARGETS, LoraRef, normalized_targets
from kuberl_rollout.reference.lora_service import NOT_ENABLED, LoraService
from kuberl_rollout.reference.sampling import parse_sampling
from tests.integration.tiny_lora import build_tiny_lora
from tests.integration.tiny_model import build_tiny_model

SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[8, 9, 10], [4, 5, 40, 6, 44, 7, 11], [7], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_model(root / "model")
    rslora = build_tiny_lora(model, root / "rslora", rank=4, alpha=4, seed=3)
    config = json.loads((rslora / "adapter_config.json").read_text())
    (rslora / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    return {
        "model": model,
        "a1": build_tiny_lora(model, root / "a1", rank=4, alpha=8, seed=1),
        "a2": build_tiny_lora(model, root / "a2", rank=2, alpha=3, seed=2,
                              targets=("k_proj", "gate_proj", "up_proj")),
        "rslora": rslora,
        "rank16": build_tiny_lora(model, root / "rank16", rank=16, seed=4),
    }


def new_engine(dirs: dict[str, Path], targets: tuple[str, ...] = SUPPORTED_TARGETS,
               max_loras_per_batch: int = 8) -> ReferenceEngine:
    return ReferenceEngine(str(dirs["model"]), lora={
        "max_lora_rank": 8, "targets": set(targets),
        "max_loras_per_batch": max_loras_per_batch})


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]) -> ReferenceEngine:
    engine = new_engine(dirs)
    for name in ("a1", "a2", "rslora"):
        assert engine.load_adapter(LoraRef(name, name, str(dirs[name])))["success"]
    return engine


def request(engine: ReferenceEngine, prompt: list[int], lora: str | None, seed: int
            ) -> GenRequest:
    return engine.make_request(prompt, parse_sampling({**SAMPLED, "sampling_seed": seed}),
                               rid=f"r{seed}", seq=seed, return_logprob=True, lora_id=lora)


def peft_logprobs(dirs: dict[str, Path], adapter: str | None, prompt: list[int],
                  output: list[int], flip_rslora: bool = False) -> list[float]:
    """The output tokens' log-probs, teacher-forced through HF (+ PEFT's adapter)."""
    model: Any = AutoModelForCausalLM.from_pretrained(dirs["model"], dtype=torch.float32)
    if adapter is not None:
        path = dirs[adapter]
        if flip_rslora:  # the same weights, PEFT told to scale by alpha / r
            path = path.parent / f"{adapter}-plain"
            shutil.copytree(dirs[adapter], path, dirs_exist_ok=True)
            config = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**config,
                                                                  "use_rslora": False}))
        model = PeftModel.from_pretrained(model, path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def logprobs(result: dict[str, Any] | None) -> list[float]:
    assert result is not None
    return [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]


def test_each_row_of_a_batch_gets_its_adapters_peft_logprobs(
        engine: ReferenceEngine, dirs: dict[str, Path]) -> None:
    loras = [None, "a1", "a2", "a1"]
    reqs = [request(engine, p, lora, i)
            for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))]
    results = engine.run_alone(reqs)
    for prompt, lora, result in zip(PROMPTS, loras, results, strict=True):
        assert result is not None
        want = peft_logprobs(dirs, lora, prompt, result["output_ids"])
        assert logprobs(result) == pytest.approx(want, abs=1e-5), lora
    # The adapters change the numbers (else the comparison above proves nothing).
    adapted = results[1]
    assert adapted is not None
    base = peft_logprobs(dirs, None, PROMPTS[1], adapted["output_ids"])
    assert max(abs(a - b) for a, b in zip(base, logprobs(adapted), strict=True)) > 1e-2


def test_rows_joining_and_leaving_a_running_batch_keep_their_adapters(
        engine: ReferenceEngine, dirs: dict[str, Path]) -> None:
    """Continuous batching: the KV cache's rows are merged and selected (kv_batch.py); each
    row's adapter follows it."""
    first = [request(engine, PROMPTS[0], "a1", 10), request(engine, PROMPTS[2], None, 11)]
    late = [request(engine, PROMPTS[1], "a2", 12), request(engine, PROMPTS[3], "a1", 13)]
    first[1].sampling = parse_sampling({**SAMPLED, "max_new_tokens": 2, "sampling_seed": 11})
    results: dict[str, dict[str, Any]] = {}
    out = engine.step(join=first)
    out = engine.step()
    results.update({r.rid: res for r, res in out.finished})
    out = engine.step(join=late)
    while True:
        results.update({r.rid: res for r, res in out.finished})
        if engine._batch is None:
            break
        out = engine.step()
    for req in [*first, *late]:
        got = results[req.rid]
        want = peft_logprobs(dirs, req.lora_id, req.input_ids, got["output_ids"])
        assert logprobs(got) == pytest.approx(want, abs=1e-5), req.rid


def test_the_update_is_scaled_by_alpha_over_r_even_for_rslora_adapters(
        engine: ReferenceEngine, dirs: dict[str, Path]) -> None:
    """SGLang 0.5.6's LoRAAdapter.scaling is lora_alpha / r and never reads use_rslora."""
    [result] = engine.run_alone([request(engine, PROMPTS[1], "rslora", 20)])
    assert result is not None
    want = peft_logprobs(dirs, "rslora", PROMPTS[1], result["output_ids"], flip_rslora=True)
    assert logprobs(result) == pytest.approx(want, abs=1e-5)


def test_loads_are_checked_as_sglang_checks_them(dirs: dict[str, Path],
                                                 tmp_path: Path) -> None:
    engine = new_engine(dirs, targets=("q_proj", "o_proj", "down_proj"), max_loras_per_batch=2)
    ok = engine.load_adapter(LoraRef("i1", "a1", str(dirs["a1"])))  # q, v (qkv_proj), o, down
    assert ok == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                  "loaded_adapters": {"a1": str(dirs["a1"])}}
    again = engine.load_adapter(LoraRef("i2", "a1", str(dirs["a2"])))
    assert again["error_message"] == ("Failed to load LoRA adapter a1 because it is already "
                                      "loaded")
    assert again["loaded_adapters"] == {"a1": str(dirs["a1"])} and not again["success"]
    for name in ("a2", "rank16"):  # gate/up_proj not targeted; rank 16 > 8
        bad = engine.load_adapter(LoraRef(name, name, str(dirs[name])))
        assert bad["error_message"].startswith(f"LoRA adapter {name} with rank ")
        assert "incompatible with the current LoRA memory pool" in bad["error_message"]
    missing = engine.load_adapter(LoraRef("m", "m", str(tmp_path)))
    assert missing["error_message"] == (f"[Errno 2] No such file or directory: "
                                        f"'{tmp_path / 'adapter_config.json'}'")
    pinned = engine.load_adapter(LoraRef("p", "p", str(dirs["rslora"]), pinned=True))
    assert pinned["success"]  # one pinned of 2 slots; a second would pin them all
    assert "not allowed to pin all slots" in engine.load_adapter(
        LoraRef("p2", "p2", str(dirs["rslora"]), pinned=True))["error_message"]
    assert engine.unload_adapter("i1")["loaded_adapters"] == {"p": str(dirs["rslora"])}
    assert normalized_targets(["model.layers.0.self_attn.k_proj", "up_proj"]) == {
        "qkv_proj", "gate_up_proj"}


# ---- the tokenizer side (lora_service) --------------------------------------------------------

def service(engine: ReferenceEngine, max_loaded: int | None = None,
            enabled: bool = True) -> LoraService:
    async def on_worker(fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    return LoraService(enabled=enabled, max_loaded_loras=max_loaded, load=engine.load_adapter,
                       unload=engine.unload_adapter, on_worker=on_worker)


async def test_names_unknown_unloaded_and_evicted(dirs: dict[str, Path]) -> None:
    engine = new_engine(dirs, max_loras_per_batch=2)
    lora = service(engine, max_loaded=2)
    assert (await lora.load("x", str(dirs["a1"])))["success"]
    assert (await lora.load("y", str(dirs["a2"])))["success"]
    with pytest.raises(ValueError) as never:
        await lora.acquire(["x", "nope"])
    assert str(never.value) == ("Got LoRA adapter that has never been loaded: nope\n"
                                "All loaded adapters: dict_keys(['x', 'y']).")
    with pytest.raises(ValueError, match="Received request with 3 unique loras requested but "
                                         "max loaded loras is 2"):
        await lora.acquire(["x", "y", None])  # the base (None) counts in a request
    ids = await lora.acquire(["x", None, "x"])
    assert isinstance(ids, list) and ids[0] == ids[2] and ids[1] is None
    await lora.release(ids)
    # x was used last: a third adapter evicts y (the base does not count toward the bound).
    third = await lora.load("z", str(dirs["rslora"]))
    assert third["success"] and third["loaded_adapters"] == {"x": str(dirs["a1"]),
                                                             "z": str(dirs["rslora"])}
    assert set(engine.adapters.loaded()) == {"x", "z"}  # type: ignore[union-attr]
    gone = await lora.unload("q")
    assert gone == {"rid": None, "http_worker_ipc": None, "success": False,
                    "error_message": "LoRA with name q does not exist. Loaded LoRAs: "
                                     "odict_keys(['x', 'z'])", "loaded_adapters": None}
    assert (await lora.unload("x"))["loaded_adapters"] == {"z": str(dirs["rslora"])}
    # Unloaded (x) and evicted (y) names load again from their paths when a request names them.
    y_id = await lora.acquire("y")
    assert isinstance(y_id, str) and set(lora.registry) == {"z", "y"}
    await lora.release(y_id)
    assert (await lora.load("z", str(dirs["a1"])))["error_message"] == (
        "Failed to load LoRA adapter z because it is already loaded")


async def test_an_unload_waits_for_the_requests_using_the_adapter(
        dirs: dict[str, Path]) -> None:
    engine = new_engine(dirs)
    lora = service(engine)
    assert (await lora.load("x", str(dirs["a1"])))["success"]
    held = await lora.acquire("x")
    unload = asyncio.ensure_future(lora.unload("x"))
    await asyncio.sleep(0.05)
    assert not unload.done() and "x" not in lora.registry  # no new request starts on it
    assert set(engine.adapters.loaded()) == {"x"}  # type: ignore[union-attr]
    await lora.release(held)
    assert (await asyncio.wait_for(unload, 5))["success"]
    assert engine.adapters.loaded() == {}  # type: ignore[union-attr]


async def test_without_enable_lora_the_endpoints_refuse_and_lora_path_is_ignored(
        dirs: dict[str, Path]) -> None:
    lora = service(new_engine(dirs), enabled=False)
    assert (await lora.load("x", str(dirs["a1"])))["error_message"] == NOT_ENABLED
    assert (await lora.unload("x"))["error_message"] == NOT_ENABLED
    assert await lora.acquire("x") is None
