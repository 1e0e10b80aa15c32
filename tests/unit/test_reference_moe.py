"""The reference engine serving mixture-of-experts models (reference/moe.py), in-process on tiny
random Qwen3-MoE and Qwen2-MoE models: the routes it returns are the experts an HF forward over
prompt + output routes to, alone, batched, joining a running batch, after a retraction and on
an abort; under the perturb switch they are the experts it used (its log-probs are those of an
HF forward replaying them); its per-expert weight names are the checkpoint's, and an update of
one expert by name changes exactly that expert; with expert parallelism a rank's checksums
cover its own experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kuberl_rollout.reference.engine import GenRequest, ReferenceEngine
from kuberl_rollout.reference.moe import PERTURB_ENV
from kuberl_rollout.reference.sampling import parse_sampling
from kuberl_rollout.reference.weights import Receiver
from kuberl_wire import codec
from kuberl_wire.codec import tensor_sha256
from kuberl_wire.hf_routers import RouterControl
from kuberl_wire.moe_routes import NO_ROUTE, ROUTES_FIELD, decode, pad_to
from tests.integration.tiny_model import build_tiny_model
from tests.integration.tiny_moe import DENSE_LAYERS, LAYERS, TOP_K, build_tiny_moe

SAMPLED = {"temperature": 1.0}  # (log-probs of T = 1: the model's own, comparable exactly)
PROMPTS = [[8, 9, 10], [4, 5, 40, 6, 44, 7, 11, 12, 13, 14], [7]]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp(f"moe-{request.param}") / "model",
                          family=request.param)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> ReferenceEngine:
    return ReferenceEngine(str(model_dir), return_routes=True)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def request(engine: ReferenceEngine, prompt: list[int], new: int, seed: int, *,
            routes: bool = True, params: dict[str, Any] | None = None) -> GenRequest:
    sampling = parse_sampling({**(params or SAMPLED), "max_new_tokens": new, "ignore_eos": True,
                               "sampling_seed": seed})
    return engine.make_request(prompt, sampling, rid=f"r{seed}", seq=seed, return_logprob=True,
                               return_routes=routes)


def routes_of(result: dict[str, Any]) -> torch.Tensor:
    return decode(result["meta_info"][ROUTES_FIELD], LAYERS, TOP_K)


def logprobs_of(result: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])


def hf_forward(model: torch.nn.Module, ids: list[int], replay: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each position went to [len(ids), layers, k], log-softmax [len(ids), V])
    of one plain HF forward over `ids`, replaying `replay` when given."""
    control = RouterControl(model, LAYERS)
    with torch.no_grad(), control.active(replay=replay):
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    assert control.recorded is not None
    return control.recorded, torch.log_softmax(logits.float(), -1)


def assert_routes_are_hfs(model: torch.nn.Module, prompt: list[int],
                          result: dict[str, Any]) -> None:
    """Rows for positions [0, prompt + output - 1), each the experts HF's forward picks."""
    routes = routes_of(result)
    ids = prompt + result["output_ids"]
    assert routes.shape == (len(ids) - 1, LAYERS, TOP_K)
    expected, _ = hf_forward(model, ids)
    assert torch.equal(routes, expected[:-1])
    assert (routes[:, list(DENSE_LAYERS)] == NO_ROUTE).all()
    assert (routes[:, 0] != NO_ROUTE).all()


def test_routes_are_the_experts_an_hf_forward_picks_alone_and_batched(
        engine: ReferenceEngine, hf: torch.nn.Module) -> None:
    alone = [engine.run_alone([request(engine, p, 9, seed=i)])[0]
             for i, p in enumerate(PROMPTS)]
    batched = engine.run_alone([request(engine, p, 9, seed=i) for i, p in enumerate(PROMPTS)])
    for prompt, one, many in zip(PROMPTS, alone, batched, strict=True):
        assert one is not None and many is not None
        assert_routes_are_hfs(hf, prompt, one)
        assert many["output_ids"] == one["output_ids"]
        assert torch.equal(routes_of(many), routes_of(one))  # left padding changes nothing
    # A request that does not ask gets none, beside one that does.
    plain, asked = engine.run_alone([request(engine, PROMPTS[0], 3, 0, routes=False),
                                     request(engine, PROMPTS[1], 3, 1)])
    assert plain is not None and asked is not None
    assert ROUTES_FIELD not in plain["meta_info"] and ROUTES_FIELD in asked["meta_info"]


def test_routes_hold_when_requests_join_and_leave_a_running_batch(
        engine: ReferenceEngine, hf: torch.nn.Module) -> None:
    """(prompt, new tokens, joins at step): the second joins wider than the batch, the third
    narrower, the fourth leaves first (the cache is compacted around it)."""
    schedule = [(PROMPTS[0], 20, 0), (PROMPTS[1], 8, 4), (PROMPTS[2], 6, 6), ([20, 21], 2, 6)]
    reqs = [request(engine, p, n, seed=10 + i) for i, (p, n, _) in enumerate(schedule)]
    got: dict[str, dict[str, Any]] = {}
    for step in range(40):
        out = engine.step(join=[r for r, (_, _, at) in zip(reqs, schedule, strict=True)
                                if at == step])
        got.update((req.rid, result) for req, result in out.finished)
        if len(got) == len(reqs):
            break
    for req, (prompt, new, _) in zip(reqs, schedule, strict=True):
        assert len(got[req.rid]["output_ids"]) == new
        assert_routes_are_hfs(hf, prompt, got[req.rid])


def test_a_retracted_request_keeps_its_routes(engine: ReferenceEngine,
                                              hf: torch.nn.Module) -> None:
    [want] = engine.run_alone([request(engine, PROMPTS[1], 12, seed=3)])
    req = request(engine, PROMPTS[1], 12, seed=3)
    engine.step(join=[req])
    for _ in range(4):
        engine.step()
    engine.suspend = True
    out = engine.step()
    engine.suspend = False
    assert out.suspended == [req] and req.routed == len(PROMPTS[1]) + len(req.output_ids) - 1
    [got] = engine.run_alone([req])
    assert want is not None and got is not None
    assert got["output_ids"] == want["output_ids"]
    assert torch.equal(routes_of(got), routes_of(want))
    assert_routes_are_hfs(hf, PROMPTS[1], got)


def test_an_aborted_request_returns_the_routes_of_what_it_generated(
        engine: ReferenceEngine, hf: torch.nn.Module) -> None:
    req = request(engine, PROMPTS[0], 30, seed=4)
    engine.step(join=[req])
    for _ in range(3):
        engine.step()
    engine.aborted_rids.add(req.rid)
    out = engine.step()
    [(done, result)] = out.finished
    assert done is req and result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(result["output_ids"]) < 30
    assert_routes_are_hfs(hf, PROMPTS[0], result)
    # Aborted before it ran: no model work, no routes (as SGLang answers a queued request).
    queued = engine.abort_result(request(engine, PROMPTS[0], 5, seed=5))
    assert ROUTES_FIELD not in queued["meta_info"]


def test_perturbed_routes_are_the_ones_the_engine_used(
        model_dir: Path, engine: ReferenceEngine, hf: torch.nn.Module,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the switch the engine routes differently from HF on the same weights; replaying
    the routes it returned, HF's forward gives the engine's log-probs; without the replay it
    gives others."""
    monkeypatch.setenv(PERTURB_ENV, "1")
    perturbed = ReferenceEngine(str(model_dir), return_routes=True)
    prompt = PROMPTS[1]
    [got] = perturbed.run_alone([request(perturbed, prompt, 16, seed=6)])
    assert got is not None
    routes = routes_of(got)
    ids = prompt + got["output_ids"]
    own, own_logp = hf_forward(hf, ids)
    assert not torch.equal(routes, own[:-1])
    last = routes[:, :, -1]  # the perturbed slot: each token's (k+1)-th best, not its own k-th
    assert (last[:, 0] != own[:-1, 0, -1]).all()
    replayed, logp = hf_forward(hf, ids, replay=pad_to(routes, len(ids), LAYERS, TOP_K))
    assert torch.equal(replayed[:-1], routes)
    at = torch.arange(len(prompt) - 1, len(ids) - 1)
    target = torch.tensor(got["output_ids"])
    assert torch.allclose(logprobs_of(got), logp[at, target], atol=1e-5)
    assert not torch.allclose(logprobs_of(got), own_logp[at, target], atol=1e-3)
    # The unperturbed engine's log-probs are HF's own (same ids, same weights).
    [plain] = engine.run_alone([request(engine, prompt, 16, seed=6)])
    assert plain is not None
    plain_ids = prompt + plain["output_ids"]
    _, plain_logp = hf_forward(hf, plain_ids)
    assert torch.allclose(logprobs_of(plain),
                          plain_logp[at, torch.tensor(plain["output_ids"])], atol=1e-5)


def test_routes_need_the_flag_and_a_moe_model(model_dir: Path,
                                              tmp_path: Path) -> None:
    """Without --enable-return-routed-experts a request asking gets no routes (SGLang's
    capturer is then a no-op); the flag on a dense model fails at start."""
    quiet = ReferenceEngine(str(model_dir))
    [out] = quiet.run_alone([request(quiet, PROMPTS[0], 3, seed=7)])
    assert out is not None and ROUTES_FIELD not in out["meta_info"]
    dense = build_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        ReferenceEngine(str(dense), return_routes=True)
    plain = ReferenceEngine(str(dense))
    [out] = plain.run_alone([request(plain, PROMPTS[0], 3, seed=7)])
    assert out is not None and ROUTES_FIELD not in out["meta_info"]


# ---- weights ---------------------------------------------------------------------------------


def test_expert_names_are_the_checkpoints(engine: ReferenceEngine, model_dir: Path) -> None:
    on_disk = load_file(model_dir / "model.safetensors")
    named = engine.named_tensors()
    assert set(named) == set(on_disk)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in named
    for name, tensor in on_disk.items():
        assert torch.equal(named[name], tensor), name


def test_updating_one_expert_by_name_changes_exactly_it(model_dir: Path) -> None:
    engine = ReferenceEngine(str(model_dir), return_routes=True)
    before = engine.checksums()
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    new = torch.randn(engine.named_tensors()[name].shape)
    engine.load_weights([(name, new)])
    after = engine.checksums()
    assert {n for n in before if before[n] != after[n]} == {name}
    assert after[name] == tensor_sha256(new)
    fused = engine.model.model.layers[2].mlp.experts.gate_up_proj
    assert torch.equal(fused[5, fused.shape[1] // 2:], new)  # the model's own weight
    # The colocated path (this rank's entry of /update_weights_from_tensor) the same way.
    other = "model.layers.0.mlp.experts.1.down_proj.weight"
    newer = torch.randn(engine.named_tensors()[other].shape)
    Receiver(engine).update_from_tensor(
        {"serialized_named_tensors": [codec.encode_shared([(other, newer)])]})
    latest = engine.checksums()
    assert {n for n in after if after[n] != latest[n]} == {other}
    assert latest[other] == tensor_sha256(newer)


def test_an_expert_parallel_rank_checksums_its_own_experts(model_dir: Path) -> None:
    """--tp-size 4 --ep-size 2: moe_tp 2, TP ranks 2 and 3 are EP rank 1 (experts 4..7)."""
    every = ReferenceEngine(str(model_dir)).checksums()
    for rank, own in [(0, range(0, 4)), (1, range(0, 4)), (2, range(4, 8)), (3, range(4, 8))]:
        sums = ReferenceEngine(str(model_dir), tp_rank=rank, tp_size=4, ep_size=2).checksums()
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in sums if ".experts." in n}
        assert experts == set(own)
        assert {n for n in every if n not in sums} == {
            n for n in every if ".experts." in n
            and int(n.split(".experts.")[1].split(".")[0]) not in own}
    with pytest.raises(ValueError, match="must divide the model's 8 routed experts"):
        ReferenceEngine(str(model_dir), tp_size=3, ep_size=3)
