"""The reference engine as a real server with --enable-lora, driven over HTTP with the bodies
the trainer sends (kuberl_wire.protocol.load_lora_adapter / unload_lora_adapter): adapters
load and unload, each prompt of a batch runs under the adapter its lora_path names with
HF + PEFT's log-probs, and names, bounds and errors are SGLang 0.5.6's (a name never loaded
is a 400; an unloaded one is loaded again from its path; --max-loaded-loras evicts the least
recently used). One engine, started once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from kuberl_wire import protocol
from tests.integration.test_reference_engine import Engine
from tests.integration.tiny_lora import build_tiny_lora
from tests.integration.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration

PROMPTS = [[8, 9, 10], [4, 5, 40, 6, 44], [7, 11]]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_model(root / "model")
    return {"model": model,
            "a1": build_tiny_lora(model, root / "a1", rank=4, alpha=8, seed=1),
            "a2": build_tiny_lora(model, root / "a2", rank=2, alpha=4, seed=2,
                                  targets=("k_proj", "gate_proj", "up_proj")),
            "a3": build_tiny_lora(model, root / "a3", rank=8, seed=3),
            "a4": build_tiny_lora(model, root / "a4", rank=2, seed=5),
            "big": build_tiny_lora(model, root / "big", rank=16, seed=4)}


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Engine]:
    started = Engine(dirs["model"], tmp_path_factory.mktemp("logs") / "engine.log",
                     "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
                     "--max-loaded-loras", "3", "--max-loras-per-batch", "2")
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as r:
        return r.status, await r.json()


def peft_logprobs(dirs: dict[str, Path], adapter: str | None, prompt: list[int],
                  output: list[int]) -> list[float]:
    model: Any = AutoModelForCausalLM.from_pretrained(dirs["model"], dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, dirs[adapter])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


async def test_adapters_load_serve_unload_as_sglang(engine: Engine,
                                                    dirs: dict[str, Path]) -> None:
    url = engine.url
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a1", str(dirs["a1"])))
    assert (status, body) == (200, {"rid": None, "http_worker_ipc": None, "success": True,
                                    "error_message": "", "loaded_adapters": {
                                        "a1": str(dirs["a1"])}})
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a2", str(dirs["a2"])))
    assert status == 200 and set(body["loaded_adapters"]) == {"a1", "a2"}

    # One batch, a different adapter per prompt (None: the base model; three distinct, more
    # than --max-loras-per-batch 2: the third waits for a free slot, as in SGLang).
    loras = [None, "a1", "a2"]
    status, out = await post(url, "/generate", {
        "input_ids": PROMPTS, "sampling_params": SAMPLED, "return_logprob": True,
        "lora_path": loras})
    assert status == 200, out
    for prompt, lora, result in zip(PROMPTS, loras, out, strict=True):
        got = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
        want = peft_logprobs(dirs, lora, prompt, result["output_ids"])
        assert got == pytest.approx(want, abs=1e-5), lora

    # SGLang's errors: a name already loaded, a rank above --max-lora-rank, a name never
    # loaded (/generate: 400 in its error shape), an unknown name to unload.
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a1", str(dirs["a3"])))
    assert (status, body["success"], body["error_message"]) == (
        400, False, "Failed to load LoRA adapter a1 because it is already loaded")
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("big", str(dirs["big"])))
    assert status == 400 and "with rank 16 is incompatible" in body["error_message"]
    status, body = await post(url, "/generate", {"input_ids": PROMPTS[0],
                                                 "sampling_params": SAMPLED,
                                                 "lora_path": "nope"})
    assert (status, body) == (400, {"error": {"message": (
        "Got LoRA adapter that has never been loaded: nope\n"
        "All loaded adapters: dict_keys(['a1', 'a2']).")}})
    status, body = await post(url, "/unload_lora_adapter", protocol.unload_lora_adapter("x"))
    assert status == 400 and body["loaded_adapters"] is None
    assert body["error_message"] == ("LoRA with name x does not exist. Loaded LoRAs: "
                                     "odict_keys(['a1', 'a2'])")
    status, body = await post(url, "/load_lora_adapter", {"lora_path": str(dirs["a1"])})
    assert status == 422  # (FastAPI's answer to a body SGLang's dataclass refuses)

    # --max-loaded-loras 3 counts adapters, not the base: a fourth evicts the least recently
    # used (a1: the batch above named a2 after it). A request's distinct names count the
    # base (None) too.
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a3", str(dirs["a3"])))
    assert status == 200 and set(body["loaded_adapters"]) == {"a1", "a2", "a3"}
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a4", str(dirs["a4"])))
    assert status == 200 and set(body["loaded_adapters"]) == {"a2", "a3", "a4"}
    status, body = await post(url, "/generate", {
        "input_ids": [*PROMPTS, [5]], "sampling_params": SAMPLED,
        "lora_path": ["a2", "a3", "a4", None]})
    assert (status, body) == (400, {"error": {"message": (
        "Received request with 4 unique loras requested but max loaded loras is 3")}})

    # Unloaded (a2) or evicted (a1): a request naming it loads it again from its path.
    status, body = await post(url, "/unload_lora_adapter", protocol.unload_lora_adapter("a2"))
    assert (status, body["success"], set(body["loaded_adapters"])) == (200, True,
                                                                       {"a3", "a4"})
    status, out = await post(url, "/generate", {"input_ids": PROMPTS[1],
                                                "sampling_params": SAMPLED,
                                                "return_logprob": True, "lora_path": "a1"})
    assert status == 200, out
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(peft_logprobs(dirs, "a1", PROMPTS[1], out["output_ids"]),
                                abs=1e-5)
    status, body = await post(url, "/load_lora_adapter",
                              protocol.load_lora_adapter("a1", str(dirs["a1"])))
    assert "already loaded" in body["error_message"]
    assert set(body["loaded_adapters"]) == {"a1", "a3", "a4"}


async def test_server_info_reports_the_lora_flags(engine: Engine) -> None:
    async with aiohttp.ClientSession() as session, \
            session.get(engine.url + "/server_info") as r:
        info = await r.json()
    assert (info["enable_lora"], info["max_lora_rank"], info["max_loaded_loras"],
            info["max_loras_per_batch"]) == (True, 8, 3, 2)
    assert "gate_up_proj" in info["lora_target_modules"]
