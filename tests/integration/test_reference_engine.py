"""The reference engine as a real server process, driven by the trainer's own client and weight
sender: generation semantics, weight sync over gloo (this test process is trainer rank 0,
two engines are ranks 1 and 2), the colocated tensor path, memory release, and a dead engine.

Three engines start once per module, in parallel (~5 s on two busy cores); the third is the
one the last test kills. They check an API key, as a job's engines do (SGLang's --api-key):
this process holds it in $KUBERL_ENGINE_API_KEY like a job's processes, so every client here
sends it, and test_the_api_key_is_checked_on_what_sglang_protects shows the others refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kuberl_trainer.engines.client import EngineClient, EngineError, SamplingParams
from kuberl_trainer.ray_actors import free_port  # (the ports other runs here are given, too)
from kuberl_trainer.weight_sync.sender import DistributedWeightSender, bucketize, send_tensors
from kuberl_wire.codec import tensor_sha256
from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.integration.tiny_model import EOS_ID, build_tiny_model, build_tokenizer

pytestmark = pytest.mark.integration

PROMPTS = [[4, 5, 40, 6, 44], [7], [8, 9, 10, 11, 12, 13, 14, 15]]
API_KEY = "module-engines-key-7f3a"
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


class Engine:
    def __init__(self, model_dir: Path, log: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model_dir),
             "--port", str(self.port), "--seed", "0", "--torch-threads", "1",
             "--weight-sync-timeout", "30", *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"engine not listening after {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serving(started: list[Engine], timeout: float = 120) -> Iterator[list[str]]:
    """A fixture's body for engines started together: their URLs once all are ready, and
    every one stopped after."""
    try:
        for engine in started:
            engine.wait_ready(timeout=timeout)
        yield [e.url for e in started]
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module", autouse=True)
def api_key() -> Iterator[str]:
    """The module's engines and clients share a key through the environment, as a job's
    processes do (the engines inherit it; EngineClient reads it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENGINE_API_KEY_ENV, API_KEY)
        yield API_KEY


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            api_key: str) -> Iterator[list[Engine]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    started = [Engine(model_dir, logs / f"engine{i}.log") for i in range(3)]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture
def pair(engines: list[Engine]) -> Iterator[list[str]]:
    yield [e.url for e in engines[:2]]
    # A test that took an engine down fails here with the engine's own last words, rather
    # than every later test failing with "cannot connect".
    for engine in engines[:2]:
        if engine.proc.poll() is not None:
            pytest.fail(f"engine {engine.url} exited {engine.proc.returncode} during this "
                        f"test; its log ends:\n{engine.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir,
                                                                  dtype=torch.float32)
    return model.eval()


async def generate_raw(url: str, body: dict[str, object]) -> object:
    async with EngineClient([url], request_timeout_s=30) as client:
        return await client.request(url, "POST", "/generate", body)


# ---- generation -----------------------------------------------------------------------------


async def test_batched_generation_matches_single_and_is_deterministic(pair: list[str]) -> None:
    url = pair[0]
    batch = await generate_raw(url, {"input_ids": PROMPTS, "sampling_params": GREEDY,
                                     "return_logprob": True})
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, batch, strict=True):
        single = await generate_raw(url, {"input_ids": prompt, "sampling_params": GREEDY})
        assert isinstance(single, dict)
        assert single["output_ids"] == out["output_ids"]  # left padding changes nothing
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == len(out["output_ids"])
        assert meta["weight_version"] == "default"
    text = await generate_raw(url, {"text": "12+3=", "sampling_params": GREEDY})
    assert isinstance(text, dict) and text["output_ids"] == batch[0]["output_ids"]


async def test_logprobs_are_temperature_scaled_logprobs_of_the_sampled_tokens(
        pair: list[str], reference_model: torch.nn.Module) -> None:
    """SGLang semantics: log softmax(logits / T) of each chosen token (T = 1 when greedy)."""
    for params in (GREEDY, {"temperature": 0.7, "max_new_tokens": 12, "sampling_seed": 5}):
        out = await generate_raw(pair[0], {"input_ids": PROMPTS[0], "sampling_params": params,
                                           "return_logprob": True})
        assert isinstance(out, dict)
        lps = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == \
            out["output_ids"]
        assert len(lps) == out["meta_info"]["completion_tokens"]
        full = torch.tensor([PROMPTS[0] + out["output_ids"]])
        with torch.no_grad():
            logits = reference_model(input_ids=full).logits[0, len(PROMPTS[0]) - 1:-1]
        temperature = max(float(params["temperature"]), 1e-6) if params["temperature"] else 1.0
        expected = torch.log_softmax(logits / temperature, -1).gather(
            1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(lps), expected, atol=1e-4)


async def test_a_trajectory_goes_token_in_token_out_across_turns(
        pair: list[str], reference_model: torch.nn.Module, model_dir: Path) -> None:
    """Multi-turn, exactly (kuberl_trainer.agents): turn 2's request is the prompt, turn 1's
    output and the observation's ids (the engine answers it as it answers those ids sent by
    hand with turn 2's seed); the trained row is those and turn 2's output, the observation
    out of the loss; the engine's log-prob of every trainable token is the model's (fp32),
    and the trainer's (the fsdp backend on the same weights, step 0)."""
    from kuberl_trainer.agents import RolloutContext, Trajectory, turn_seed
    from kuberl_trainer.rollout.batch import pack
    from kuberl_trainer.rollout.generate import Response
    from kuberl_trainer.rollout.prompts import Sample

    prompt, observation, budget = PROMPTS[0], [30, 31, 32], 24
    sampling = {"temperature": 1.0, "max_new_tokens": budget, "sampling_seed": 7,
                "ignore_eos": True}
    async with EngineClient([pair[0]], request_timeout_s=30) as client:
        ctx = RolloutContext(client, sampling)
        traj = Trajectory(prompt_ids=list(prompt), budget=budget)
        first = await ctx.generate(traj, max_new_tokens=6)
        traj.append_env(observation)
        second = await ctx.generate(traj)
        by_hand = await client.generate_one(
            [*prompt, *first.ids, *observation],
            sampling | {"max_new_tokens": budget - 6 - 3, "sampling_seed": turn_seed(7, 1)})
    assert (len(first.ids), len(second.ids)) == (6, budget - 6 - 3)  # the budget, all of it
    assert second.ids == by_hand.output_ids and second.logprobs == by_hand.logprobs
    row = pack([Response.from_trajectory(Sample("", "", 0, 0), traj, text=second.text)],
               torch.zeros(1), pad_id=0)
    ids = [*prompt, *first.ids, *observation, *second.ids]
    assert row.input_ids[0].tolist() == ids
    trained = row.loss_mask[0].bool()
    assert trained.tolist() == [False] * len(prompt) + [True] * 6 + [False] * 3 + \
        [True] * len(second.ids)
    with torch.no_grad():  # position t scores token t (the backends' convention)
        logits = reference_model(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(row.rollout_logprobs[0, 1:][trained[1:]], expected[trained[1:]],
                          atol=1e-4)
    from kuberl_api.spec import RLJobSpec
    from kuberl_trainer.backends.factory import make_backend

    spec = RLJobSpec.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"prompts": "/p.jsonl", "maxPromptLen": len(prompt), "maxResponseLen": budget},
        "training": {"backend": "fsdp", "gpusPerNode": 0}, "rollout": {"engine": "reference"},
        "algorithm": {"temperature": 1.0}})
    trainer = make_backend(spec, rank=0, world_size=1, device="cpu").logprobs(row)[0]
    assert torch.allclose(trainer[trained], row.rollout_logprobs[0][trained], atol=1e-4)


async def test_seeds_reproduce_and_differ(pair: list[str]) -> None:
    async with EngineClient(pair, request_timeout_s=30) as client:
        def params(seed: int) -> dict[str, object]:
            return SamplingParams(temperature=1.0, max_new_tokens=16,
                                  sampling_seed=seed).to_dict()
        # The same seed on either engine, alone or in a batch: the same tokens.
        runs = await client.generate([PROMPTS[1]] * 4, [params(1), params(1), params(2),
                                                        params(3)])
        assert runs[0].output_ids == runs[1].output_ids
        assert len({tuple(r.output_ids) for r in runs}) >= 2
        again = await client.generate_one(PROMPTS[1], params(1), url=pair[1])
        assert again.output_ids == runs[0].output_ids
        # Load balancing spread the concurrent requests over both engines.
        spread = await client.generate([PROMPTS[0]] * 8, params(4))
        assert {r.engine_url for r in spread} == set(pair)


async def test_stops_and_length(pair: list[str]) -> None:
    tokenizer = build_tokenizer()
    async with EngineClient(pair[:1], request_timeout_s=30) as client:
        free = await client.generate_one(PROMPTS[2], {**GREEDY, "max_new_tokens": 10})
        assert free.finish_reason == "length" and free.completion_tokens == 10
        assert free.meta_info["finish_reason"] == {"type": "length", "length": 10}
        assert len(free.logprobs or []) == 10
        assert all(torch.isfinite(torch.tensor(free.logprobs)))

        stop_id = free.output_ids[3]
        first = free.output_ids.index(stop_id)
        by_id = await client.generate_one(PROMPTS[2], {**GREEDY, "stop_token_ids": [stop_id]})
        assert by_id.output_ids == free.output_ids[:first + 1]  # the stop token is kept
        assert by_id.meta_info["finish_reason"] == {"type": "stop", "matched": stop_id}
        assert by_id.text == tokenizer.decode(free.output_ids[:first])  # ...but not in text

        stop_str = free.text[4:6]
        cut = free.text.index(stop_str)
        by_str = await client.generate_one(PROMPTS[2], {**GREEDY, "stop": [stop_str]})
        assert by_str.meta_info["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert by_str.text == free.text[:cut]
        assert by_str.completion_tokens == cut + len(stop_str)  # one token per character

        ignore = await client.generate_one(PROMPTS[2], {**GREEDY, "stop_token_ids": [EOS_ID],
                                                         "max_new_tokens": 0})
        assert ignore.output_ids == [] and ignore.finish_reason == "length"


async def test_the_api_key_is_checked_on_what_sglang_protects(pair: list[str]) -> None:
    """Real HTTP to a real engine: without the key or with a wrong one, generation and every
    admin call the trainer makes are refused 401 with SGLang's body (and nothing changes);
    /health and /health_generate answer anyone (SGLang 0.5.6 exempts them); with the key
    (every other test of this module) everything works."""
    url = pair[0]
    calls = [("POST", "/generate", {"input_ids": [1, 2], "sampling_params": GREEDY}),
             ("POST", "/pause_generation", {"mode": "abort"}),
             ("POST", "/continue_generation", {}),
             ("POST", "/release_memory_occupation", {}),
             ("POST", "/resume_memory_occupation", {}),
             ("POST", "/flush_cache", None),
             ("POST", "/init_weights_update_group", {
                 "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                 "world_size": 2, "group_name": "x", "backend": "gloo"}),
             ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [],
                                                           "shapes": []}),
             ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
             ("POST", "/destroy_weights_update_group", {"group_name": "x"}),
             ("POST", "/abort_weights_update_group", {"group_name": "x"}),
             ("POST", "/abort_request", {"abort_all": True}),
             ("GET", "/get_model_info", None), ("GET", "/get_server_info", None),
             ("GET", "/get_weight_version", None), ("GET", "/get_weights_checksum", None)]
    async with EngineClient([url], request_timeout_s=30) as client:  # the key, from the env
        before = await client.request(url, "GET", "/get_event_log")
    for key in ("", "wrong-key"):
        async with EngineClient([url], request_timeout_s=30, api_key=key) as outsider:
            for method, path, body in calls:
                with pytest.raises(EngineError) as err:
                    await outsider.request(url, method, path, body)
                assert err.value.status == 401, (key, path, err.value)
                assert "Unauthorized" in err.value.message
            await outsider.wait_healthy(timeout_s=10)  # /health: no key needed
            await outsider.request(url, "GET", "/health_generate")
    async with EngineClient([url], request_timeout_s=30) as client:  # the key, from the env
        assert await client.request(url, "GET", "/get_event_log") == before  # none was run
        out = await client.generate_one([1, 2], GREEDY)
        assert out.output_ids and (await client.get_model_info(url))["model_path"]


async def test_bad_requests_are_400_with_a_message(pair: list[str]) -> None:
    async with EngineClient(pair[:1], request_timeout_s=30) as client:
        for body, needle in [({"input_ids": [1], "sampling_params": {"seed": 1}}, "sampling_seed"),
                             ({"input_ids": [999]}, "out of range"),
                             ({"input_ids": [1], "sampling_params": {"max_new_tokens": 9999}},
                              "context length"),
                             ({"input_ids": [1], "text": "x"}, "exactly one"),
                             ({"input_ids": [1], "sampling_params": {"min_p": 0.5}}, "min_p")]:
            with pytest.raises(EngineError, match=needle) as err:
                await client.request(pair[0], "POST", "/generate", body)
            assert err.value.status == 400 and err.value.url == pair[0]


# ---- weight sync ----------------------------------------------------------------------------


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {name: (t + 0.3 * torch.randn(t.shape, generator=gen)).contiguous()
             for name, t in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied, as in the model
    return state


def trainer_params(state: dict[str, torch.Tensor], model: torch.nn.Module) -> list[
        tuple[str, torch.Tensor]]:
    """What a trainer sends: named_parameters (tied lm_head.weight appears once, under the
    embedding's name) with values from `state`."""
    return [(name, state[name]) for name, _ in model.named_parameters()]


def greedy_locally(model: torch.nn.Module, state: dict[str, torch.Tensor], prompt: list[int],
                   steps: int) -> list[int]:
    clone = AutoModelForCausalLM.from_config(model.config).eval()
    clone.load_state_dict(state)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(clone(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == EOS_ID:
                break
    return ids[len(prompt):]


async def checksums(client: EngineClient) -> list[dict[str, str]]:
    return [await client.request(u, "GET", "/get_weights_checksum") for u in client.urls]


async def engine_sums(urls: list[str]) -> list[dict[str, str]]:
    async with EngineClient(urls, request_timeout_s=30) as client:
        return await checksums(client)


async def gloo_sender(client: EngineClient, group_name: str, *,
                      flatten: bool) -> DistributedWeightSender:
    """This test process as trainer rank 0 of a gloo group with the client's engines."""
    sender = DistributedWeightSender(client, master_address="127.0.0.1",
                                     master_port=free_port(), backend="gloo",
                                     group_name=group_name, timeout_s=30, flatten=flatten)
    await sender.connect()
    return sender


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened-buckets", "per-tensor"])
async def test_distributed_sync_over_gloo_to_two_engines(
        pair: list[str], reference_model: torch.nn.Module, flatten: bool) -> None:
    original = {n: t.clone() for n, t in reference_model.state_dict().items()}
    async with EngineClient(pair, request_timeout_s=60) as client:
        sender = await gloo_sender(client, "kuberl_test", flatten=flatten)
        try:
            for version, seed in ((1, 1), (2, 2)):
                state = perturbed(reference_model, seed)
                params = trainer_params(state, reference_model)
                stats = await sender.send(bucketize(params, bucket_bytes=16 << 10))
                assert stats.weight_version == str(version) and stats.buckets > 1
                # once, whatever the number of engines
                assert stats.bytes == sum(t.numel() * t.element_size() for _, t in params)
                want = {n: tensor_sha256(t) for n, t in state.items()}
                assert await checksums(client) == [want, want]
                for url in pair:
                    assert (await client.get_model_info(url))["weight_version"] == str(version)
                out = await client.generate([PROMPTS[0]] * 2, GREEDY)
                assert {o.weight_version for o in out} == {str(version)}
                assert out[0].output_ids == greedy_locally(reference_model, state, PROMPTS[0],
                                                           12)
            # An engine-side error (unknown name) fails the sync loudly, after the tensors
            # were received, so the group stays in step and the next sync works.
            with pytest.raises(EngineError, match="unknown tensor 'nope'"):
                await sender.send([[("nope", torch.zeros(2))]])
            stats = await sender.send([trainer_params(state, reference_model)])
            assert stats.buckets == 1 and stats.weight_version == "3"
            # Restore the original weights for the other tests (the tensor path, colocated).
            stats = await send_tensors(client, bucketize(trainer_params(
                original, reference_model), 1 << 20), weight_version="restored")
            assert stats.tensors == len(list(reference_model.named_parameters()))
            want = {n: tensor_sha256(t) for n, t in original.items()}
            assert await checksums(client) == [want, want]
            assert (await client.get_model_info(pair[1]))["weight_version"] == "restored"
        finally:
            await sender.close()


async def test_rejected_buckets_keep_every_engine_in_step(
        pair: list[str], reference_model: torch.nn.Module) -> None:
    """One engine answers a rejected bucket before the other has even got its request. The
    sender must not drop that request: the late engine would miss the bucket's broadcast and
    pair the next bucket's broadcasts with the wrong receives, and gloo aborts a process on a
    size mismatch (CI lost an engine this way; a loop like this one hit it within ~150 rounds
    when the sender cancelled the other engines' requests on the first error answer)."""
    state = perturbed(reference_model, seed=7)
    want = {n: tensor_sha256(t) for n, t in state.items()}
    async with EngineClient(pair, request_timeout_s=60) as client:
        sender = await gloo_sender(client, "kuberl_in_step", flatten=False)
        try:
            for _ in range(40):
                with pytest.raises(EngineError, match="unknown tensor 'nope'"):
                    await sender.send([[("nope", torch.zeros(2))]])
                await sender.send(bucketize(trainer_params(state, reference_model), 16 << 10))
            assert await checksums(client) == [want, want]
        finally:
            await sender.close()
            await send_tensors(client, [trainer_params(reference_model.state_dict(),
                                                       reference_model)],
                               weight_version="restored")


async def test_shared_tensor_update_reaches_both_engines(
        pair: list[str], reference_model: torch.nn.Module) -> None:
    """The colocated format (tensors by reference: shared memory here, CUDA IPC handles on
    GPUs) from the trainer's process into two engine processes: both hold the new weights
    and serve them; then the original weights go back the same way."""
    original = {n: t.clone() for n, t in reference_model.state_dict().items()}
    async with EngineClient(pair, request_timeout_s=60) as client:
        try:
            state = perturbed(reference_model, seed=5)
            stats = await send_tensors(client, bucketize(trainer_params(state, reference_model),
                                                         16 << 10),
                                       weight_version="shared-1", shared=True)
            assert stats.buckets > 1
            want = {n: tensor_sha256(t) for n, t in state.items()}
            assert await checksums(client) == [want, want]
            out = await client.generate([PROMPTS[0]] * 2, GREEDY)
            assert {o.weight_version for o in out} == {"shared-1"}
            assert out[0].output_ids == greedy_locally(reference_model, state, PROMPTS[0], 12)
        finally:
            await send_tensors(client, [trainer_params(original, reference_model)],
                               weight_version="restored", shared=True)
        want = {n: tensor_sha256(t) for n, t in original.items()}
        assert await checksums(client) == [want, want]


def trainer_worker(model_dir: Path, **engine_args: str) -> Any:
    """A real TrainWorker (the Ray actor's class, used in-process) of the fsdp backend on CPU,
    for reference engines given `engine_args`."""
    from kuberl_api import parse
    from kuberl_trainer.actors import TrainWorker

    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "sync"}, "spec": {
                      "model": {"path": str(model_dir)}, "data": {"prompts": "/d.jsonl"},
                      "training": {"backend": "fsdp", "gpusPerNode": 0},
                      "rollout": {"engine": "reference", "gpus": 0,
                                  "engineArgs": engine_args}}}).spec
    return TrainWorker(spec.model_dump_json(by_alias=True), rank=0, world_size=1)


def test_a_tied_model_takes_its_embedding_alone_and_its_lm_head_follows(
        model_dir: Path) -> None:
    """The fsdp backend sends a tied model's embedding once, without lm_head.weight (SGLang
    skips that name and ties lm_head to the embedding), in the engine's dtype: the reference
    engine takes the buckets as they are, its lm_head is the new embedding afterwards, and
    its checksums are the trainer's (TrainWorker.checksums, of what it sends)."""
    from kuberl_rollout.reference.engine import ReferenceEngine

    worker = trainer_worker(model_dir, dtype="bfloat16")
    threads = torch.get_num_threads()  # (a CPU worker sets its own; this process keeps ours)
    worker.setup("127.0.0.1", 0)
    torch.set_num_threads(threads)
    assert worker.sync_dtype() == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the trainer's weights move away from what the engine loaded
        for param in worker.backend.module.parameters():
            param.add_(torch.randn(param.shape, generator=gen))
    engine = ReferenceEngine(str(model_dir), dtype="bfloat16")
    before = engine.checksums()

    buckets = list(worker.backend.named_tensor_buckets(4096, worker.sync_dtype()))
    sent = dict(kv for bucket in buckets for kv in bucket)
    assert "lm_head.weight" not in sent and {t.dtype for t in sent.values()} == {torch.bfloat16}
    for bucket in buckets:
        engine.load_weights(bucket)

    embedding = sent["model.embed_tokens.weight"]
    assert torch.equal(engine.model.lm_head.weight, embedding)
    assert torch.equal(engine.model.model.embed_tokens.weight, embedding)
    after, want = engine.checksums(), worker.checksums()
    assert want.keys() == sent.keys() and {n: after[n] for n in want} == want
    assert after["lm_head.weight"] == want["model.embed_tokens.weight"]
    assert after["lm_head.weight"] != before["lm_head.weight"]


def test_colocated_syncs_reuse_rank_zeros_loop_and_session(
        pair: list[str], reference_model: torch.nn.Module, model_dir: Path) -> None:
    """push_colocated, one training rank (shared memory stands in for CUDA IPC on CPU), into
    both engines twice, with the Poster a TrainWorker keeps: both syncs reach the engines
    through one event loop and one HTTP session. A changed engine list (an engine replaced)
    gets a new Poster and closes the old one."""
    from kuberl_trainer.weight_sync.colocated import push_colocated

    worker = trainer_worker(model_dir)
    poster = worker._colocated_poster(pair)
    original = {n: t.clone() for n, t in reference_model.state_dict().items()}
    sessions = []
    try:
        for version in (1, 2):
            state = perturbed(reference_model, seed=20 + version)
            assert worker._colocated_poster(pair) is poster
            push_colocated(bucketize(trainer_params(state, reference_model), 16 << 10),
                           rank=0, world_size=1, gpu=("127.0.0.1", 0), engine_urls=pair,
                           engine_devices=[[0], [0]], weight_version=f"colocated-{version}",
                           poster=worker._colocated_poster(pair), dtype=torch.float32)
            sessions.append(poster.client._session)
            want = {n: tensor_sha256(t) for n, t in state.items()}
            assert asyncio.run(engine_sums(pair)) == [want, want]
        assert sessions[0] is not None and sessions[0] is sessions[1]
        assert not sessions[0].closed
        assert not poster.loop.is_closed()
    finally:
        async def restore() -> None:
            async with EngineClient(pair, request_timeout_s=60) as client:
                await send_tensors(client, [trainer_params(original, reference_model)],
                                   weight_version="restored", shared=True)
        asyncio.run(restore())
    replacement = worker._colocated_poster(pair[:1])
    assert replacement is not poster and poster.loop.is_closed() and sessions[0].closed
    replacement.close()


async def test_tensor_update_rejects_unknown_names_and_changes_nothing(
        pair: list[str], reference_model: torch.nn.Module) -> None:
    async with EngineClient(pair[:1], request_timeout_s=30) as client:
        before = await checksums(client)
        bad = [("model.embed_tokens.weight", torch.zeros(3, 3)), ("nope", torch.zeros(1))]
        with pytest.raises(EngineError, match=r"unknown tensor 'nope'.*shape"):
            await send_tensors(client, [bad], weight_version="x")
        assert await checksums(client) == before
        assert (await client.get_model_info(pair[0]))["weight_version"] != "x"
        # A failed update leaves the engines paused (half-updated weights never serve) until
        # the next complete update continues them; here nothing changed, so continue now.
        await client.request(pair[0], "POST", "/continue_generation", {})


async def test_release_and_resume_memory(pair: list[str],
                                         reference_model: torch.nn.Module) -> None:
    """As SGLang's memory saver without --enable-weights-cpu-backup: released weights are
    gone, and a resume brings back memory that only a weight update makes the model again."""
    url = pair[0]
    async with EngineClient([url], request_timeout_s=30) as client:
        before = await checksums(client)
        await client.request(url, "POST", "/release_memory_occupation", {"tags": None})
        with pytest.raises(EngineError, match="resume_memory_occupation") as err:
            await client.generate_one(PROMPTS[0], GREEDY)
        assert err.value.status == 503
        # /health generates a token, as SGLang 0.5.6's: unhealthy while released
        with pytest.raises(EngineError) as unhealthy:
            await client.request(url, "GET", "/health")
        assert unhealthy.value.status == 503
        await client.request(url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
        with pytest.raises(EngineError):  # kv_cache is still released
            await client.generate_one(PROMPTS[0], GREEDY)
        # tags null released cuda_graph too (SGLang's GPU_MEMORY_ALL_TYPES): resume it all.
        await client.request(url, "POST", "/resume_memory_occupation", {"tags": None})
        assert (await client.generate_one(PROMPTS[0], GREEDY)).completion_tokens == 12
        await client.request(url, "GET", "/health_generate")
        after = await checksums(client)
        assert after[0].keys() == before[0].keys()
        nonzero = [n for n, t in reference_model.state_dict().items() if t.any()]
        assert nonzero and all(after[0][n] != before[0][n] for n in nonzero)  # all lost
        await send_tensors(client, [trainer_params(reference_model.state_dict(),
                                                   reference_model)], weight_version="restored")
        assert await checksums(client) == before


@pytest.mark.parametrize("backup", [False, True], ids=["discarded", "cpu-backup"])
def test_released_weights_are_lost_unless_backed_up(model_dir: Path, backup: bool) -> None:
    """--enable-weights-cpu-backup (SGLang's flag) keeps released weights' values in host
    memory; without it a release frees them and a resume brings back zeros."""
    from kuberl_rollout.reference.engine import ReferenceEngine

    engine = ReferenceEngine(str(model_dir), weights_cpu_backup=backup)
    before = engine.checksums()
    engine.release(["weights"])
    assert all(p.numel() == 0 for p in engine.model.parameters()) != backup
    engine.resume(["weights"])
    after = engine.checksums()
    assert after.keys() == before.keys()
    if backup:
        assert after == before
    else:
        assert after != before and all(not p.any() for p in engine.model.parameters())


async def test_abort_request_finishes_running_requests_as_abort(pair: list[str]) -> None:
    url = pair[1]
    async with EngineClient([url], request_timeout_s=30) as client:
        long = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
        task = asyncio.ensure_future(client.generate([[4]] * 32, long))
        while client.outstanding[url] < 32:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await client.request(url, "POST", "/abort_request", {"rid": "", "abort_all": True})
        results = await asyncio.wait_for(task, timeout=10)
        assert {r.finish_reason for r in results} == {"abort"}
        assert all(r.completion_tokens < 240 for r in results)
        assert (await client.generate_one([4], GREEDY)).finish_reason != "abort"


async def test_engine_killed_mid_request_raises_with_its_url(engines: list[Engine]) -> None:
    victim = engines[2]
    async with EngineClient([victim.url], request_timeout_s=30) as client:
        await client.wait_healthy(timeout_s=10)
        long = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
        task = asyncio.ensure_future(client.generate([[4]] * 64, long))
        while client.outstanding[victim.url] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert not task.done(), "generation finished before the kill; make it longer"
        victim.proc.kill()
        with pytest.raises(EngineError) as err:
            await asyncio.wait_for(task, timeout=10)
        assert err.value.url == victim.url
        # SIGKILL is asynchronous: until the process is gone its listening socket may still
        # accept (then reset) a connection, so wait for the exit before checking a new call.
        victim.proc.wait(timeout=10)
        with pytest.raises(EngineError, match="cannot connect") as err:
            await client.generate_one([4], GREEDY)
        assert err.value.url == victim.url


# ---- SGLang parity: what slime and the trainer observe (issue 13) ---------------------------

LONG = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}


async def post(url: str, path: str, body: object = None) -> object:
    async with EngineClient([url], request_timeout_s=30) as client:
        return await client.request(url, "POST", path, body)


async def wait_running(client: EngineClient, url: str, n: int) -> None:
    """Until the engine reports `n` requests in a running batch (SGLang's /v1/loads)."""
    for _ in range(500):
        load = (await client.request(url, "GET", "/v1/loads"))["loads"][0]
        if load["num_running_reqs"] == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {n} running requests: {load}")


async def test_slime_generate_body_is_accepted(pair: list[str]) -> None:
    """The /generate body exactly as slime's sglang_rollout sends it (every sampling param,
    custom_params when top_p < 1), plus fields SGLang knows at their defaults and a field it
    does not know (ignored, as SGLang's HTTP layer ignores extra keys)."""
    body = {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 8, "stop": None,
        "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": False, "sampling_seed": 11,
        "custom_params": {"return_top_p_token_ids": True}},
        "return_routed_experts": False, "stream": False, "a_field_sglang_lacks": 1}
    out = await generate_raw(pair[0], body)
    assert isinstance(out, dict)
    assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert out["meta_info"]["completion_tokens"] == 8
    async with EngineClient(pair[:1], request_timeout_s=30) as client:
        for extra, needle in [({"stream": True}, "stream"), ({"image_data": "x"}, "image_data"),
                              ({"sampling_params": {"min_p": 0.5}}, "min_p")]:
            with pytest.raises(EngineError, match=needle) as err:
                await client.request(pair[0], "POST", "/generate", {**body, **extra})
            assert err.value.status == 400


async def test_null_sampling_fields_take_sglang_defaults(pair: list[str]) -> None:
    seeded = {"sampling_seed": 3, "max_new_tokens": 12}
    nulls = {key: None for key in ("temperature", "top_p", "top_k", "stop", "stop_token_ids",
                                   "ignore_eos", "skip_special_tokens", "no_stop_trim",
                                   "spaces_between_special_tokens", "custom_params", "min_p",
                                   "repetition_penalty")}
    plain = await generate_raw(pair[0], {"input_ids": PROMPTS[0], "sampling_params": seeded})
    null = await generate_raw(pair[0], {"input_ids": PROMPTS[0], "return_logprob": None,
                                        "rid": None, "sampling_params": {**seeded, **nulls}})
    assert isinstance(plain, dict) and isinstance(null, dict)
    assert null["output_ids"] == plain["output_ids"] and null["text"] == plain["text"]
    # max_new_tokens null: as many as SGLang's scheduler allows, context_len - input - 2.
    prompt = PROMPTS[0]
    out = await generate_raw(pair[0], {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": None, "ignore_eos": True, "temperature": 0}})
    assert isinstance(out, dict)
    assert out["meta_info"]["completion_tokens"] == 256 - len(prompt) - 2
    assert out["meta_info"]["finish_reason"]["type"] == "length"


async def test_context_length_boundary_is_sglangs(pair: list[str]) -> None:
    """The tiny model's context is 256 tokens: SGLang refuses input_len >= 256 and
    input + max_new_tokens >= 256, then caps max_new_tokens at 256 - 1 - input - 1."""
    async with EngineClient(pair[:1], request_timeout_s=30) as client:
        for n, new, needle in [(256, 0, r"The input \(256 tokens\) is longer than the model's "
                                        r"context length \(256 tokens\)"),
                               (250, 6, r"Requested token count exceeds the model's maximum "
                                        r"context length of 256 tokens")]:
            with pytest.raises(EngineError, match=needle) as err:
                await client.generate_one([4] * n, {"max_new_tokens": new})
            assert err.value.status == 400
        assert (await client.generate_one([4] * 255, {"max_new_tokens": 0})).output_ids == []
        capped = await client.generate_one([4] * 250, {**GREEDY, "max_new_tokens": 5,
                                                       "ignore_eos": True})
        assert capped.completion_tokens == 4 and capped.finish_reason == "length"


async def test_pause_abort_aborts_running_and_holds_new_requests(pair: list[str]) -> None:
    url = pair[1]
    async with EngineClient([url], request_timeout_s=60) as client:
        running = asyncio.ensure_future(client.generate([[4]] * 16, LONG))
        await wait_running(client, url, 16)
        paused = await client.request(url, "POST", "/pause_generation", {})  # default: abort
        try:
            assert paused["status"] == "ok"
            # pause(abort) answers once nothing is in flight (the engine's own count: the
            # answers themselves may still be on their way): every request ended as aborted.
            load = (await client.request(url, "GET", "/v1/loads"))["loads"][0]
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0), load
            results = await asyncio.wait_for(running, 10)
            assert {r.finish_reason for r in results} == {"abort"}
            assert all(r.completion_tokens < 240 for r in results)
            later = asyncio.ensure_future(client.generate_one(PROMPTS[0], GREEDY))
            await asyncio.sleep(0.3)
            assert not later.done(), "a new request must wait while generation is paused"
            await client.request(url, "POST", "/flush_cache")  # idle while paused: succeeds
        finally:  # (never leave the shared engine paused for the next test)
            await client.request(url, "POST", "/continue_generation", {})
        assert (await asyncio.wait_for(later, 30)).finish_reason == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_holds_and_continue_resumes(pair: list[str], mode: str) -> None:
    """A paused request keeps its tokens and completes after /continue_generation exactly as
    if never paused (same seed, same weights). While held: an in_place pause keeps it in the
    running batch, so flush_cache fails; a retracted one holds no cache, so flush succeeds."""
    url = pair[1]
    params = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True,
              "sampling_seed": 17}
    async with EngineClient([url], request_timeout_s=60) as client:
        want = await client.generate([[4], [5]], params)
        task = asyncio.ensure_future(client.generate([[4], [5]], params))
        try:
            await wait_running(client, url, 2)
            await client.request(url, "POST", "/pause_generation", {"mode": mode})
            await wait_running(client, url, 0)
            load = (await client.request(url, "GET", "/v1/loads"))["loads"][0]
            assert load["queues"]["paused"] == 2 and not task.done()
            if mode == "in_place":
                with pytest.raises(EngineError) as err:
                    await client.request(url, "POST", "/flush_cache")
                assert err.value.status == 400
            else:
                await client.request(url, "POST", "/flush_cache")
            await asyncio.sleep(0.2)
            assert not task.done()
        finally:
            await client.request(url, "POST", "/continue_generation", {})
        got = await asyncio.wait_for(task, 60)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        for have, expect in zip(got, want, strict=True):
            assert have.logprobs == pytest.approx(expect.logprobs, abs=1e-4)
        assert {r.finish_reason for r in got} == {"length"}


async def test_a_request_arriving_mid_batch_joins_it_and_finishes_first(
        pair: list[str]) -> None:
    """Continuous batching, as SGLang's: a request that arrives while a long batch runs joins
    it at the next decode step (two running), finishes while the long one still runs, and
    answers what it answers alone."""
    url = pair[0]
    short = {"temperature": 0.8, "max_new_tokens": 8, "sampling_seed": 23}
    async with EngineClient([url], request_timeout_s=60) as client:
        want = await client.generate_one(PROMPTS[2], short)
        long = asyncio.ensure_future(client.generate_one(PROMPTS[0], LONG))
        await wait_running(client, url, 1)
        got = await client.generate_one(PROMPTS[2], short)
        assert not long.done()  # (answered while the long request still ran)
        assert got.output_ids == want.output_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert (await long).completion_tokens == 240


async def test_flush_cache_fails_while_generating(pair: list[str]) -> None:
    url = pair[1]
    async with EngineClient([url], request_timeout_s=60) as client:
        task = asyncio.ensure_future(client.generate([[4]] * 8, LONG))
        await wait_running(client, url, 8)
        with pytest.raises(EngineError, match="operation will not be performed") as err:
            await client.request(url, "POST", "/flush_cache")
        assert err.value.status == 400
        await task
        await client.request(url, "GET", "/flush_cache")  # idle: 200


async def test_bare_release_also_releases_cuda_graph(pair: list[str]) -> None:
    url = pair[0]
    async with EngineClient([url], request_timeout_s=30) as client:
        await client.request(url, "POST", "/release_memory_occupation", {})
        info = await client.request(url, "GET", "/server_info")
        assert info["internal_states"][0]["released_memory"] == ["cuda_graph", "kv_cache",
                                                                 "weights"]
        await client.request(url, "POST", "/resume_memory_occupation",
                             {"tags": ["weights", "kv_cache"]})
        with pytest.raises(EngineError) as err:
            await client.generate_one(PROMPTS[0], GREEDY)
        assert err.value.status == 503
        await client.request(url, "POST", "/resume_memory_occupation", {"tags": ["cuda_graph"]})
        assert (await client.generate_one(PROMPTS[0], GREEDY)).completion_tokens == 12


async def test_server_info_and_loads(pair: list[str]) -> None:
    url = pair[0]
    async with EngineClient([url], request_timeout_s=30) as client:
        info = await client.request(url, "GET", "/get_server_info")
        assert info == await client.request(url, "GET", "/server_info")
        assert info["tp_size"] == 1 and info["context_length"] == 256
        assert info["weight_version"] == (await client.get_model_info(url))["weight_version"]
        loads = await client.request(url, "GET", "/v1/loads")
        assert [load["dp_rank"] for load in loads["loads"]] == [0]
        assert loads["loads"][0]["num_running_reqs"] == 0


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("sglang:") and not (name := line.split("{")[0]).endswith(
                "_created")}  # (prometheus_client's creation times, in SGLang's too)


async def test_metrics_have_sglangs_names_and_count_what_was_generated(
        model_dir: Path, tmp_path: Path, pair: list[str]) -> None:
    """--enable-metrics (as SGLang's flag): GET /metrics with SGLang's metric names; without
    the flag there is no /metrics, as in SGLang."""
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{pair[0]}/metrics", timeout=10)
    assert err.value.code == 404
    engine = Engine(model_dir, tmp_path / "engine.log", "--enable-metrics")
    try:
        engine.wait_ready()
        before = scrape(engine.url)
        assert before == {"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0,
                          "sglang:prompt_tokens_total": 0, "sglang:generation_tokens_total": 0,
                          "sglang:num_requests_total": 0}
        prompts = [[5, 6, 7], [8, 9], [10]]
        await generate_raw(engine.url, {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 1.0}})
        after = scrape(engine.url)
        assert after["sglang:prompt_tokens_total"] == 6
        assert after["sglang:generation_tokens_total"] == 12
        assert after["sglang:num_requests_total"] == 3
        assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
        served_by_the_trainer(engine.url, tmp_path)
    finally:
        engine.stop()


def served_by_the_trainer(url: str, tmp_path: Path) -> None:
    """The trainer's Prometheus endpoint serves the engines' metrics too, labelled by engine
    (their ports are chosen at start: nothing else can scrape them); an engine that does not
    answer is left out of the scrape without holding it up."""
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from kuberl_trainer.engines.metrics import EngineMetrics
    from kuberl_trainer.report.metrics_log import MetricsLog

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port, silent = s.getsockname()[1], f"http://127.0.0.1:{s.getsockname()[1] + 1}"
    with socket.socket() as hung:  # accepts, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        stuck = f"http://127.0.0.1:{hung.getsockname()[1]}"
        log = MetricsLog(tmp_path / "trainer", prometheus_port=port)
        log.serve_also(EngineMetrics(lambda: [url, silent, stuck], timeout_s=1.0))
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        assert time.monotonic() - started < 5
        log.close()
    samples = {(m.name, s.name): s for m in text_string_to_metric_families(text)
               for s in m.samples}
    tokens = samples[("sglang:generation_tokens", "sglang:generation_tokens_total")]
    assert tokens.labels["engine"] == url and tokens.value == 12
    assert samples[("sglang:num_requests", "sglang:num_requests_total")].value == 3
    engines = {s.labels.get("engine") for s in samples.values() if s.name.startswith("sglang:")}
    assert engines == {url}


async def test_a_busy_engine_is_healthy_at_once(pair: list[str]) -> None:
    """/health (SGLang's handler) answers as soon as the engine produces anything: a long
    running batch's tokens count, so a probe never waits for the batch to end."""
    url = pair[0]
    async with EngineClient([url], request_timeout_s=60) as client:
        long = asyncio.ensure_future(client.generate_one(
            PROMPTS[0], {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}))
        await wait_running(client, url, 1)
        await client.request(url, "GET", "/health", timeout_s=10)
        assert not long.done()  # answered while the batch still ran, not after it
        await long
