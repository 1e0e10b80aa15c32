"""Reference engines at tensor parallel size 2, as the trainer sees SGLang engines of TP 2: two
engines of two processes each. Every TP process must join the weight-update group (5 ranks with
this test process as trainer rank 0) and read its own entry of a tensor update; after every sync
the weights must be exact on every TP process. Also: requests shaped as slime sends them
(flattened buckets per TP rank), and an update running while generation continues.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import sys
import types
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_trainer.engines.client import EngineClient, EngineError
from kuberl_trainer.weight_sync.sender import DistributedWeightSender, bucketize, send_tensors
from kuberl_wire import codec, protocol
from kuberl_wire.codec import tensor_sha256
from tests.integration.test_reference_engine import (
    GREEDY,
    PROMPTS,
    Engine,
    free_port,
    greedy_locally,
    perturbed,
    serving,
    trainer_params,
)
from tests.integration.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration
TP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tp") / "model")


@pytest.fixture(scope="module")
def tp_engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("tp-engine-logs")
    started = [Engine(model_dir, logs / f"engine{i}.log", "--tp-size", str(TP))
               for i in range(2)]
    yield from serving(started)


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir,
                                                                  dtype=torch.float32)
    return model.eval()


async def every_rank(client: EngineClient) -> list[list[dict[str, str]]]:
    """Per engine, each TP process's {name: sha256}."""
    return [(await client.request(u, "GET", "/get_weights_checksum?all_ranks=true"))["tp_ranks"]
            for u in client.urls]


def sums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_sha256(t) for n, t in state.items()}


async def test_distributed_sync_reaches_every_tp_process(
        tp_engines: list[str], reference_model: torch.nn.Module) -> None:
    original = {n: t.clone() for n, t in reference_model.state_dict().items()}
    async with EngineClient(tp_engines, request_timeout_s=60) as client:
        sender = DistributedWeightSender(client, master_address="127.0.0.1",
                                         master_port=free_port(), backend="gloo",
                                         group_name="kuberl_tp", timeout_s=30,
                                         tp_sizes=[TP, TP])
        assert sender.world_size == 5 and sender.rank_offsets == [1, 3]
        await sender.connect()
        try:
            for seed in (1, 2):
                state = perturbed(reference_model, seed)
                await sender.send(bucketize(trainer_params(state, reference_model), 16 << 10))
                assert await every_rank(client) == [[sums(state)] * TP] * 2
                out = await client.generate([PROMPTS[0]], GREEDY)
                assert out[0].output_ids == greedy_locally(reference_model, state, PROMPTS[0],
                                                           12)
        finally:
            await sender.close()
            await send_tensors(client, [trainer_params(original, reference_model)],
                               weight_version="restored", tp_sizes=[TP, TP])
        assert await every_rank(client) == [[sums(original)] * TP] * 2


async def test_each_tp_process_reads_its_own_tensor_entry(
        tp_engines: list[str], reference_model: torch.nn.Module) -> None:
    """Entry r goes to TP rank r (on GPUs: handles to the tensors on rank r's own GPU), and
    the engine's event log names the device each rank read its tensors from."""
    url = tp_engines[0]
    original = trainer_params(reference_model.state_dict(), reference_model)
    one, two = perturbed(reference_model, 11), perturbed(reference_model, 12)
    async with EngineClient([url], request_timeout_s=60) as client:
        body = protocol.update_weights_from_tensor(
            [codec.encode_shared(trainer_params(one, reference_model)),
             codec.encode_shared(trainer_params(two, reference_model))],
            weight_version="split", flush_cache=False)
        await client.post_all("/update_weights_from_tensor", body)
        assert await every_rank(client) == [[sums(one), sums(two)]]
        # The engine's record says where each rank's tensors were (a GPU run checks that a
        # colocated sync feeds each rank from its own GPU; here every rank is on the CPU).
        events = (await client.request(url, "GET", "/get_event_log"))["events"]
        assert events[-1]["op"] == "update_from_tensor"
        assert events[-1]["ranks"] == [{"tp_rank": r, "device": "cpu", "from": ["cpu"]}
                                       for r in range(TP)]
        # One entry for two TP ranks: SGLang's rank 1 would index past the list. Refused, and
        # rank 1 is named.
        single = protocol.update_weights_from_tensor(
            [codec.encode_shared(original)], weight_version="short", flush_cache=False)
        with pytest.raises(EngineError, match="tp rank 1: serialized_named_tensors has 1"):
            await client.post_all("/update_weights_from_tensor", single)
        await send_tensors(client, [original], weight_version="restored", tp_sizes=[TP])
        assert await every_rank(client) == [[sums(reference_model.state_dict())] * TP]


# ---- requests shaped exactly as slime sends them ---------------------------------------------


SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@pytest.fixture
def sglang_bucket_class() -> Iterator[type[codec.FlattenedTensorMetadata]]:
    """A class that pickles as SGLang's FlattenedTensorMetadata, as slime's payloads name it
    (the same fields as the decoder's stand-in, under SGLang's module, registered for the
    test's duration so pickle can find it)."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", SGLANG_BUCKET_MODULE]
    saved = {n: sys.modules.get(n) for n in names}
    cls = type("FlattenedTensorMetadata", (codec.FlattenedTensorMetadata,),
               {"__module__": SGLANG_BUCKET_MODULE})
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    module: Any = sys.modules[SGLANG_BUCKET_MODULE]
    module.FlattenedTensorMetadata = cls
    try:
        yield cls
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


def slime_flattened_bucket(named: list[tuple[str, torch.Tensor]],
                           metadata: type[codec.FlattenedTensorMetadata]
                           ) -> tuple[str, torch.Tensor]:
    """What slime puts in serialized_named_tensors[r]: SGLang 0.5.6's FlattenedTensorBucket
    (every tensor's bytes, uint8) as {flattened_tensor, metadata}, by MultiprocessingSerializer
    (ForkingPickler, base64). Returns the entry and the flat tensor it refers to, which must
    stay alive until the engine has read it."""
    parts, metas, at = [], [], 0
    for name, t in named:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append(metadata(name, t.shape, t.dtype, at, at + raw.numel(), raw.numel()))
        parts.append(raw)
        at += raw.numel()
    flat = torch.cat(parts)
    buf = io.BytesIO()
    # CPU tensors by shared-memory file name (slime's are CUDA tensors, by IPC handle).
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(
            {"flattened_tensor": flat, "metadata": metas})
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode(), flat


async def test_slime_shaped_requests(tp_engines: list[str], reference_model: torch.nn.Module,
                                     sglang_bucket_class: type[codec.FlattenedTensorMetadata]
                                     ) -> None:
    """Generate with slime's sampling parameters; then slime's update sequence: pause, flush,
    flattened buckets per TP rank (mixed dtypes in one bucket), continue; then offload and
    onload by tag."""
    url = tp_engines[1]
    state = perturbed(reference_model, 21)
    named = trainer_params(state, reference_model)
    async with EngineClient([url], request_timeout_s=60) as client:
        gen = {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
            "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
            "no_stop_trim": True, "spaces_between_special_tokens": False,
            "sampling_seed": 3, "custom_params": None}}
        out = await client.request(url, "POST", "/generate", gen)
        assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) > 0

        await client.request(url, "POST", "/pause_generation", {"mode": "retract"})
        await client.request(url, "POST", "/flush_cache")
        for bucket in bucketize(named, 16 << 10):
            entry, _alive = slime_flattened_bucket(bucket, sglang_bucket_class)
            body = {"serialized_named_tensors": [entry] * TP,
                    "load_format": "flattened_bucket", "flush_cache": False,
                    "weight_version": "slime-1"}
            await client.post_all("/update_weights_from_tensor", body)
        await client.request(url, "POST", "/continue_generation", {})
        assert await every_rank(client) == [[sums(state)] * TP]

        for tags in (["kv_cache"], ["weights"]):
            await client.request(url, "POST", "/release_memory_occupation", {"tags": tags})
        for tags in (["weights"], ["kv_cache"]):
            await client.request(url, "POST", "/resume_memory_occupation", {"tags": tags})
        out = await client.request(url, "POST", "/generate", {**gen, "sampling_params": GREEDY})
        assert out["meta_info"]["weight_version"] == "slime-1"
        # every TP rank lost its weights, as SGLang's do: the update below restores them
        nonzero = [n for n, t in state.items() if t.any()]
        lost = await every_rank(client)
        assert all(rank[n] != sums(state)[n] for rank in lost[0] for n in nonzero)
        await send_tensors(client, [trainer_params(reference_model.state_dict(),
                                                   reference_model)],
                           weight_version="restored", tp_sizes=[TP])


def test_flattened_bucket_with_mixed_dtypes_decodes_exactly(
        sglang_bucket_class: type[codec.FlattenedTensorMetadata]) -> None:
    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
             ("c", torch.randn(4).to(torch.bfloat16))]
    entry, _alive = slime_flattened_bucket(named, sglang_bucket_class)
    assert b"sglang.srt.weight_sync.tensor_bucket" in base64.b64decode(entry)
    out = codec.decode_named_tensors(entry, flattened=True)
    assert [n for n, _ in out] == ["a", "b", "c"]
    for (_, want), (_, got) in zip(named, out, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


async def test_generation_continues_across_an_update(
        tp_engines: list[str], reference_model: torch.nn.Module) -> None:
    """The trainer's update sequence while generation runs: the requests are retracted, the
    weights change on every TP process, and they complete after /continue_generation
    (SGLang recomputes a retracted request with the new weights), reporting the new version."""
    url = tp_engines[0]
    state = perturbed(reference_model, 31)
    async with EngineClient([url], request_timeout_s=300) as client:
        long = asyncio.ensure_future(client.generate(
            [PROMPTS[2]] * 32, {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}))
        while not (await client.request(url, "GET", "/v1/loads"))["loads"][0][
                "num_running_reqs"]:
            await asyncio.sleep(0.01)
        await send_tensors(client, bucketize(trainer_params(state, reference_model), 16 << 10),
                           weight_version="during", tp_sizes=[TP])
        results = await long
        assert {r.finish_reason for r in results} == {"length"}
        assert {len(r.output_ids) for r in results} == {240}
        assert {r.weight_version for r in results} == {"during"}
        assert await every_rank(client) == [[sums(state)] * TP]
        await send_tensors(client, [trainer_params(reference_model.state_dict(),
                                                   reference_model)],
                           weight_version="restored", tp_sizes=[TP])


async def test_an_engine_over_two_nodes_syncs_every_rank_from_its_own_node(
        model_dir: Path, reference_model: torch.nn.Module, tmp_path: Path) -> None:
    """SGLang's --nnodes 2: TP 4 as two processes of two ranks. Node 1's ranks connect to node
    0 (authenticated by the shared key), join the weight-update group themselves as ranks
    3..4 and hold the weights; node 1 answers only /health; a connection with the wrong key
    is refused; when node 0 goes, node 1 goes too."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    port = free_port()
    nodes = ["--tp-size", "4", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    key = {protocol.ENGINE_SECRET_ENV: "shared-key"}
    head = Engine(model_dir, tmp_path / "node0.log", *nodes, "--node-rank", "0", env=key)
    other: Engine | None = None
    try:
        # Node 0 listens, but not for strangers. (Node 1 starts after this: node 0 stops
        # listening once every remote rank is in, and a stranger arriving then meets a
        # closed port, not a refusal; it did under load.)
        with pytest.raises(AuthenticationError):
            for _ in range(600):
                try:
                    Client(("127.0.0.1", port), authkey=b"wrong").close()
                    break
                except ConnectionRefusedError:
                    await asyncio.sleep(0.1)
        other = Engine(model_dir, tmp_path / "node1.log", *nodes, "--node-rank", "1", env=key)
        head.wait_ready(timeout=180)
        other.wait_ready(timeout=180)
        async with EngineClient([head.url], request_timeout_s=60) as client:
            await client.wait_healthy(timeout_s=180)
            assert (await client.request(other.url, "GET", "/health")) in (None, "", {})
            with pytest.raises(EngineError):  # not an API server
                await client.request(other.url, "GET", "/get_model_info")
            sender = DistributedWeightSender(client, master_address="127.0.0.1",
                                             master_port=free_port(), backend="gloo",
                                             group_name="kuberl_nodes", timeout_s=30,
                                             tp_sizes=[4])
            await sender.connect()
            try:
                state = perturbed(reference_model, 21)
                await sender.send(bucketize(trainer_params(state, reference_model), 16 << 10))
                assert await every_rank(client) == [[sums(state)] * 4]
                out = await client.generate([PROMPTS[0]], GREEDY)
                assert out[0].output_ids == greedy_locally(reference_model, state, PROMPTS[0],
                                                           12)
            finally:
                await sender.close()
        head.stop()
        other.proc.wait(timeout=30)  # its ranks lost node 0: the node exits
    finally:
        head.stop()
        if other is not None:
            other.stop()
