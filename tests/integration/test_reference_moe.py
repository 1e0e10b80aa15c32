"""A reference engine serving a tiny Qwen3-MoE as a server process, as the trainer sees an SGLang
engine of a MoE model: `/generate`'s `return_routed_experts` (single and batched forms) answers
the routes an HF forward over prompt + output takes, only when the engine was started with
--enable-return-routed-experts; at --tp-size 2 --ep-size 2 the weight-update group and the
tensor path reach both ranks in the checkpoint's per-expert names, and each rank's checksums
cover the experts SGLang's rank would hold (an update that leaves them out shows there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_trainer.engines.client import EngineClient
from kuberl_trainer.ray_actors import free_port
from kuberl_trainer.weight_sync.sender import DistributedWeightSender, bucketize
from kuberl_wire import codec, expert_names, protocol
from kuberl_wire.codec import tensor_sha256
from kuberl_wire.hf_routers import RouterControl
from kuberl_wire.moe_routes import ROUTES_FIELD, decode
from tests.integration.test_reference_engine import Engine, serving
from tests.integration.test_reference_engine_tp import every_rank
from tests.integration.tiny_moe import LAYERS, TOP_K, build_tiny_moe

pytestmark = pytest.mark.integration
PROMPTS = [[4, 5, 40, 6, 44], [7], [8, 9, 10, 11, 12, 13, 14, 15]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
OWN = [range(0, 4), range(4, 8)]  # the experts of TP ranks 0 and 1 at --ep-size 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "model")


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """[an EP engine of two ranks that returns routes, one engine started without the flag]"""
    logs = tmp_path_factory.mktemp("moe-engine-logs")
    started = [Engine(model_dir, logs / "ep.log", "--tp-size", "2", "--ep-size", "2",
                      "--enable-return-routed-experts"),
               Engine(model_dir, logs / "plain.log")]
    yield from serving(started)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    control = RouterControl(model, LAYERS)
    with torch.no_grad(), control.active():
        model(input_ids=torch.tensor([ids]))
    assert control.recorded is not None
    return control.recorded


def checkpoint_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict in the checkpoint's names (one matrix per expert), as a trainer sends."""
    return dict(part for name, t in state.items() for part in expert_names.split(name, t))


def rank_view(named: dict[str, torch.Tensor], own: range) -> dict[str, str]:
    """The checksums SGLang's rank holding experts `own` would report."""
    return {n: tensor_sha256(t) for n, t in named.items()
            if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) in own}


async def generate(url: str, body: dict[str, Any]) -> Any:
    async with EngineClient([url], request_timeout_s=60) as client:
        return await client.request(url, "POST", "/generate", body)


async def test_generate_returns_the_routes_hf_takes(engines: list[str],
                                                    hf: torch.nn.Module) -> None:
    single = await generate(engines[0], {"input_ids": PROMPTS[0], "sampling_params": GREEDY,
                                         "return_routed_experts": True})
    batch = await generate(engines[0], {"input_ids": PROMPTS, "sampling_params": GREEDY,
                                        "return_routed_experts": [True, False, True]})
    assert isinstance(single, dict) and isinstance(batch, list)
    for prompt, out in [(PROMPTS[0], single), (PROMPTS[0], batch[0]), (PROMPTS[2], batch[2])]:
        ids = prompt + out["output_ids"]
        routes = decode(out["meta_info"][ROUTES_FIELD], LAYERS, TOP_K)
        assert torch.equal(routes, hf_routes(hf, ids)[:-1])
    assert ROUTES_FIELD not in batch[1]["meta_info"]
    # Started without --enable-return-routed-experts: served, without routes (SGLang's way).
    plain = await generate(engines[1], {"input_ids": PROMPTS[0], "sampling_params": GREEDY,
                                        "return_routed_experts": True})
    assert plain["output_ids"] == single["output_ids"]
    assert ROUTES_FIELD not in plain["meta_info"]
    async with EngineClient([engines[0]], request_timeout_s=30) as client:
        info = await client.request(engines[0], "GET", "/server_info")
    assert (info["ep_size"], info["enable_return_routed_experts"]) == (2, True)


async def test_expert_updates_by_name_reach_the_ranks_that_hold_them(
        engines: list[str], hf: torch.nn.Module) -> None:
    """Over the weight-update group: one expert of each EP rank, by its checkpoint name, then
    the whole model; each rank's checksums change for its own expert only."""
    original = checkpoint_named(hf.state_dict())
    async with EngineClient([engines[0]], request_timeout_s=60) as client:
        assert await every_rank(client) == [[rank_view(original, own) for own in OWN]]
        sender = DistributedWeightSender(client, master_address="127.0.0.1",
                                         master_port=free_port(), backend="gloo",
                                         group_name="kuberl_moe", timeout_s=30, tp_sizes=[2])
        await sender.connect()
        try:
            names = ["model.layers.0.mlp.experts.1.up_proj.weight",
                     "model.layers.2.mlp.experts.6.down_proj.weight"]
            changed = {n: original[n] + 1.0 for n in names}
            await sender.send([list(changed.items())])
            state = original | changed
            ranks = (await every_rank(client))[0]
            assert ranks == [rank_view(state, own) for own in OWN]
            assert names[0] in ranks[0] and names[0] not in ranks[1]
            assert names[1] in ranks[1] and names[1] not in ranks[0]
            await sender.send(bucketize(original.items(), 8 << 10))
            assert await every_rank(client) == [[rank_view(original, own) for own in OWN]]
        finally:
            await sender.close()


async def test_each_rank_needs_only_its_own_experts_in_its_tensor_entry(
        engines: list[str], hf: torch.nn.Module) -> None:
    """Entry r of /update_weights_from_tensor holds the dense weights and rank r's experts
    only: every rank ends exact (SGLang's rank skips experts it does not hold, so neither
    needs the other's); an entry without its rank's experts leaves that rank stale."""
    original = checkpoint_named(hf.state_dict())
    gen = torch.Generator().manual_seed(3)
    state = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in original.items()}

    def entry(named: dict[str, torch.Tensor], own: range) -> str:
        keep = rank_view(named, own)
        return codec.encode_shared([(n, t) for n, t in named.items() if n in keep])

    async with EngineClient([engines[0]], request_timeout_s=60) as client:
        try:
            body = protocol.update_weights_from_tensor(
                [entry(state, OWN[0]), entry(state, OWN[1])], weight_version="split",
                flush_cache=False)
            await client.post_all("/update_weights_from_tensor", body)
            assert await every_rank(client) == [[rank_view(state, own) for own in OWN]]
            # Rank 1 sent rank 0's experts: its own stay what they were.
            body = protocol.update_weights_from_tensor(
                [entry(original, OWN[0]), entry(original, OWN[0])], weight_version="wrong",
                flush_cache=False)
            await client.post_all("/update_weights_from_tensor", body)
            ranks = (await every_rank(client))[0]
            assert ranks[0] == rank_view(original, OWN[0])
            assert ranks[1] != rank_view(original, OWN[1])
        finally:
            body = protocol.update_weights_from_tensor(
                [entry(original, OWN[0]), entry(original, OWN[1])], weight_version="restored",
                flush_cache=False)
            await client.post_all("/update_weights_from_tensor", body)
        assert await every_rank(client) == [[rank_view(original, own) for own in OWN]]
