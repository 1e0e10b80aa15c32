"""The fsdp backend with a mixture-of-experts policy (a tiny random Qwen3-MoE, one dense layer
between two MoE ones), on CPU in float32: routing replay in both modes, the router's aux loss,
and the experts' names in weight sync and checkpoints.

The "engine" here is the HF model itself run one sequence at a time under
``kuberl_wire.hf_routers`` with its top-k perturbed (each token's last expert swapped for its
next best), as the reference engine's test switch does: an engine that routes differently
from a trainer holding the same weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.backends.optim import OptimConfig
from kuberl_wire.hf_routers import RouterControl
from kuberl_wire.moe_routes import NO_ROUTE
from tests.unit.test_fsdp_backend import B, T, make_batch, make_spec
from tests.unit.tiny_lm import save_tiny_qwen3_moe

LAYERS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


def backend(moe_dir: str, optim: OptimConfig | None = None, **algorithm: object
            ) -> FSDPBackend:
    torch.manual_seed(0)
    return FSDPBackend(make_spec(moe_dir, **algorithm), rank=0, world_size=1, device="cpu",
                       optim=optim)


@torch.no_grad()
def engine_pass(model: torch.nn.Module, batch: TrainBatch, *, perturb: bool,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[B, T]`` and the routes used ``[B, T, layers, k]`` of ``model``
    run on each row's real tokens alone (an engine's forward; the trainer packs rows)."""
    control = RouterControl(model, LAYERS)
    logp = torch.zeros(B, T)
    routes = torch.full((B, T, LAYERS, TOP_K), NO_ROUTE, dtype=torch.long)
    for i in range(B):
        n = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :n][None]
        given = None if replay is None else replay[i, :n]
        with control.active(perturb=perturb, replay=given):
            out = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        assert control.recorded is not None
        routes[i, :n] = control.recorded
        logp[i, 1:n] = out[:n - 1].gather(-1, ids[0, 1:, None])[:, 0]
    return logp, routes


def hf(moe_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def on_response(a: torch.Tensor, b: torch.Tensor, batch: TrainBatch) -> float:
    return float(((a - b).abs() * batch.loss_mask).max())


def test_rollout_replay_gives_the_engines_logprobs_even_when_it_routed_otherwise(
        moe_dir: str) -> None:
    batch = make_batch()
    engine_logp, routes = engine_pass(hf(moe_dir), batch, perturb=True)
    _, own = engine_pass(hf(moe_dir), batch, perturb=False)
    differs = (routes != own).any(-1)[batch.attention_mask.bool()]  # [tokens, layers]
    assert differs[:, 0].all() and not differs[:, 1].any()  # (layer 1 is dense)
    assert differs[:, 2].float().mean() > 0.8
    with_routes = dataclasses.replace(batch, routes=routes)

    replayed = backend(moe_dir, routingReplay="rollout").logprobs(with_routes)
    assert on_response(replayed, engine_logp, batch) < 1e-5
    # Without replay the trainer routes by itself, and the engine's log-probs are far off.
    unreplayed = backend(moe_dir).logprobs(with_routes)
    assert on_response(unreplayed, engine_logp, batch) > 1e-2


def test_replay_reports_how_often_the_routers_own_choice_differs(moe_dir: str) -> None:
    batch = make_batch()
    _, perturbed = engine_pass(hf(moe_dir), batch, perturb=True)
    _, own = engine_pass(hf(moe_dir), batch, perturb=False)
    # Perturbed: every token's last expert differs in each MoE layer; one step, one pass.
    metrics = backend(moe_dir, routingReplay="rollout").train_step(
        dataclasses.replace(batch, routes=perturbed, old_logprobs=None))
    assert metrics["routing_replay_mismatch"] == pytest.approx(1.0)
    metrics = backend(moe_dir, routingReplay="rollout").train_step(
        dataclasses.replace(batch, routes=own, old_logprobs=None))
    assert metrics["routing_replay_mismatch"] == 0.0


def test_training_replay_keeps_the_first_passes_experts_when_the_router_changes(
        moe_dir: str) -> None:
    # globalBatchSize B/2: the rollout feeds two optimizer steps, so the old-log-prob pass
    # runs, and records the experts the second step must replay.
    b = backend(moe_dir, routingReplay="training")
    b2 = FSDPBackend(make_spec(moe_dir, gbs=B // 2, routingReplay="training"), rank=0,
                     world_size=1, device="cpu")
    batch = dataclasses.replace(make_batch(), old_logprobs=None)
    prepared, _ = b2._prepare(batch)
    _, own = engine_pass(hf(moe_dir), batch, perturb=False)
    assert prepared.routes is not None
    mask = batch.attention_mask.bool()
    assert torch.equal(prepared.routes[mask], own[mask])
    # With one optimizer step per rollout there is nothing to record (the training forward
    # is the old policy's own).
    assert b._prepare(batch)[0].routes is None

    # Now the routers change (as an optimizer step changes them): the replayed pass still
    # sends every token to the first pass's experts.
    with torch.no_grad():
        for name, p in b2.module.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.neg_()
    changed = hf(moe_dir)
    changed.load_state_dict(b2.module.state_dict())
    replayed = b2.logprobs(prepared)
    expected, used = engine_pass(changed, batch, perturb=False, replay=prepared.routes)
    assert torch.equal(used[mask], own[mask])
    assert on_response(replayed, expected, batch) < 1e-5
    own_routing, _ = engine_pass(changed, batch, perturb=False)
    assert on_response(replayed, own_routing, batch) > 1e-2


def gate_weights(b: FSDPBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for n, p in b.module.named_parameters()
                      if n.endswith("mlp.gate.weight")])


def test_the_routers_aux_loss_trains_the_router_and_is_reported(moe_dir: str) -> None:
    # Advantages all 0: the policy loss has no gradient, only the aux loss moves anything.
    batch = dataclasses.replace(make_batch(), old_logprobs=None)
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))
    runs = {}
    for coef in (0.0, 0.5):
        b = backend(moe_dir, OptimConfig(weight_decay=0.0), routerAuxLossCoef=coef)
        before = gate_weights(b)
        metrics = b.train_step(batch)
        runs[coef] = (gate_weights(b) - before).abs().max().item(), metrics
    assert runs[0.0][0] == 0.0 and "moe_aux_loss" not in runs[0.0][1]
    assert runs[0.5][0] > 1e-4
    # Switch-style loss: num_experts x sum(fraction routed x mean probability) >= top_k/1.
    assert runs[0.5][1]["moe_aux_loss"] >= 1.0
    # Unset, the model's own coefficient (0.01 in its config) applies.
    assert backend(moe_dir).moe is not None and backend(moe_dir).moe.aux_coef == 0.01


def test_weight_sync_and_checkpoints_name_experts_as_the_checkpoint_does(
        moe_dir: str, tmp_path: Path) -> None:
    b = backend(moe_dir)
    sent = {name: t for bucket in b.named_tensor_buckets(1 << 20) for name, t in bucket}
    on_disk = load_file(next(Path(moe_dir).glob("*.safetensors")))
    assert set(sent) == set(on_disk)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent
    assert all(torch.equal(sent[n], on_disk[n]) for n in on_disk)
    # A checkpoint of a trained step loads back exactly (experts fused again on load).
    b.train_step(dataclasses.replace(make_batch(), old_logprobs=None))
    b.save(tmp_path / "ckpt")
    saved = load_file(next((tmp_path / "ckpt" / "model").glob("*.safetensors")))
    assert set(saved) == set(on_disk)
    fresh = backend(moe_dir)
    fresh.load(tmp_path / "ckpt")
    for (name, x), (_, y) in zip(b.module.state_dict().items(),
                                 fresh.module.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
