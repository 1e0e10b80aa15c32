"""The tiny job's mixture-of-experts variant (`tiny build --variant moe`): a Qwen3-MoE policy
of the dense model's width and depth, its own cache key, and the expert loads build.json
records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kuberl_trainer.tiny import data, tokenizer as tok
from kuberl_trainer.tiny.__main__ import main
from kuberl_trainer.tiny.build import MANIFEST, MODEL_DIR, MOE_SFT_STEPS, BuildConfig, build
from kuberl_trainer.tiny.evaluate import expert_loads
from kuberl_trainer.tiny.model import Experts, ModelShape, make_model

QUICK = BuildConfig(sft_steps=3, n_eval=32, eval_samples=2, variant="moe")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    build(out, QUICK, log=lambda _: None)
    return out


def test_the_moe_build_is_a_qwen3_moe_of_the_intended_shape(built: Path) -> None:
    config = AutoConfig.from_pretrained(str(built / MODEL_DIR))
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers) == (128, 4)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == 128 and config.norm_topk_prob is True
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # all sparse
    assert config.router_aux_loss_coef == 0.001 and config.output_router_logits is False
    assert config.initializer_range == ModelShape().init_std
    model = AutoModelForCausalLM.from_pretrained(str(built / MODEL_DIR))
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(str(built / MODEL_DIR)))
    # the experts a token goes to hold as many weights as the dense model's MLP
    shape = ModelShape()
    active = config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size
    assert active == 3 * shape.hidden * shape.intermediate
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.2e6


def test_the_checkpoint_names_each_expert_as_hf_checkpoints_do(built: Path) -> None:
    with safe_open(str(built / MODEL_DIR / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for e in range(4):
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.3.mlp.experts.{e}.{part}.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names  # the router


def test_the_moe_build_records_expert_loads_and_keeps_its_own_cache(built: Path) -> None:
    record = json.loads((built / MANIFEST).read_text())
    assert record["config"] == QUICK.key() and record["config"]["variant"] == "moe"
    assert record["config"]["experts"]["experts"] == 4
    loads = record["expert_loads"]
    assert len(loads) == 4 and all(len(layer) == 4 for layer in loads)
    assert all(sum(layer) == pytest.approx(1.0, abs=1e-3) for layer in loads)
    # the dense builds' keys (and so their caches) carry no expert fields
    assert "experts" not in BuildConfig().key()
    assert "experts" not in BuildConfig(variant="tool").key()
    # an add build of the same seed and steps into this directory rebuilds it, dense
    add = BuildConfig(sft_steps=QUICK.sft_steps, n_eval=QUICK.n_eval,
                      eval_samples=QUICK.eval_samples)
    assert add.key() != QUICK.key()


def test_expert_loads_see_a_router_that_sends_every_token_to_the_same_experts() -> None:
    tokenizer = tok.make_tokenizer()
    model = make_model(ModelShape(hidden=32, layers=2, heads=2, intermediate=32), 0,
                       Experts(intermediate=16))
    problems = data.split(0, 8)[1]
    spread = expert_loads(model, tokenizer, problems)
    assert all(min(layer) > 0 for layer in spread)  # a random router uses every expert
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    # equal logits: top-2 takes the same two experts (which two, torch's topk decides) for
    # every token
    assert [sorted(layer) for layer in expert_loads(model, tokenizer, problems)] == [
        [0.0, 0.0, 0.5, 0.5]] * 2


def test_the_command_builds_the_moe_variant_with_its_own_sft_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BuildConfig] = []
    monkeypatch.setattr("kuberl_trainer.tiny.__main__.build",
                        lambda out, config, force: seen.append(config))
    assert main(["build", "--out", str(tmp_path), "--variant", "moe"]) == 0
    assert seen == [BuildConfig(sft_steps=MOE_SFT_STEPS, variant="moe")]
