"""The megatron backend's mixture-of-experts layout without megatron-core (megatron/moe_layout.py,
model.py's names and shares, export.py's expert plan): an HF Qwen MoE checkpoint in Megatron's
names and back bit for bit, every (pp, ep, etp) rank's share, and weight sync's gathering of
every expert over the expert-parallel ranks into the checkpoint's per-expert names. Running the
GPTModel needs GPUs (bench/megatron_moe_layout_check.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kuberl_trainer.backends.megatron import export, hf_layout as L, model as M, moe_layout as moe

SMALL = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
         "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
         "max_position_embeddings": 64}


def hf_model(family: str) -> tuple[dict[str, torch.Tensor], L.DecoderShape]:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, norm_topk_prob=True))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**SMALL, shared_expert_intermediate_size=24))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return moe.normalise_hf(state), L.DecoderShape.from_hf_config(model.config.to_dict())


def test_shape_read_from_the_configs() -> None:
    _, q3 = hf_model("qwen3_moe")
    _, q2 = hf_model("qwen2_moe")
    assert q3.experts == moe.ExpertShape(experts=4, top_k=2, ffn=16, norm_topk_prob=True,
                                         shared_ffn=0, aux_loss_coef=0.001)
    assert q3.qk_norm and not q3.qkv_bias
    assert q2.experts is not None and q2.experts.shared_ffn == 24
    assert q2.qkv_bias and not q2.experts.norm_topk_prob
    config = Qwen3MoeConfig(**SMALL, mlp_only_layers=[1]).to_dict()
    with pytest.raises(ValueError, match=r"layers \[1\] are dense"):
        L.DecoderShape.from_hf_config(config)
    with pytest.raises(ValueError, match="ep 3 must divide the number of experts"):
        q3.experts.check_parallel(3, 1, 1)


def test_fused_transformers_names_become_per_expert_matrices() -> None:
    """transformers 5 holds experts fused ([E, 2I, H], [E, H, I]); the layout reads the
    checkpoint's per-expert names (what save_pretrained writes and SGLang loads)."""
    hf, _shape = hf_model("qwen3_moe")
    assert "model.layers.0.mlp.experts.gate_up_proj" not in hf
    assert hf["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (16, 32)
    assert hf["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (32, 16)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_round_trip_is_exact(family: str) -> None:
    hf, shape = hf_model(family)
    mg = L.hf_to_megatron(hf, shape)
    assert mg["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (32, 32)
    assert torch.equal(mg["decoder.layers.2.mlp.router.weight"],
                       hf["model.layers.2.mlp.gate.weight"])
    back = L.megatron_to_hf(mg, shape)
    assert set(back) == set(hf) - ({"lm_head.weight"} if shape.tied else set())
    for name, t in back.items():
        assert torch.equal(t, hf[name]), name


@pytest.mark.parametrize(("pp", "ep", "etp"), [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 2),
                                               (1, 1, 2)])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_shares_and_weight_sync_gather(family: str, pp: int, ep: int, etp: int) -> None:
    """Each rank holds its stage's layers and E/ep experts (local numbers 0..E/ep-1) split
    over etp; weight sync's expert exports, gathered over the etp x ep group in megatron's
    rank order, give back every expert's HF matrices bit for bit, each exported once."""
    hf, shape = hf_model(family)
    assert shape.experts is not None
    per = shape.experts.experts // ep
    # local[(pp_rank, ep_rank, etp_rank)] = that rank's tensors under their global names
    local: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for pp_rank, ep_rank, etp_rank in itertools.product(range(pp), range(ep), range(etp)):
        par = M.Parallel(pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank, etp=etp,
                         etp_rank=etp_rank)
        share = M.stage_state(hf, shape, par)
        experts = {n for n in share if moe.is_expert(n)}
        assert {int(n.split(".")[6]) for n in experts} == set(range(per))
        if etp > 1:
            fc2 = share["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
            assert fc2.shape == (32, 16 // etp)
        local[pp_rank, ep_rank, etp_rank] = {
            M.global_name(n, par, shape.num_layers, shape.experts): t for n, t in share.items()}
    got: dict[str, torch.Tensor] = {}
    for e in export.exports(shape, pp, ep):
        if not e.experts:
            continue
        assert len(e.experts) == ep and all(x % per == e.experts[0] for x in e.experts)
        parts = [local[e.stage, r, t][e.local_source(r)]
                 for r, t in moe.expert_group_order(etp, ep)]
        for name, t in export.experts_to_hf(e, export.gather_experts(e, parts, shape, etp, ep)):
            assert name not in got
            got[name] = t
    want = {n: t for n, t in hf.items() if ".mlp.experts." in n}
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_every_hf_tensor_is_exported_once() -> None:
    hf, shape = hf_model("qwen2_moe")
    names = [n for e in export.exports(shape, 2, 2) for n in e.hf]
    assert sorted(names) == sorted(n for n in hf if n != "lm_head.weight" or not shape.tied)


def test_layouts_the_backend_refuses() -> None:
    _, q3 = hf_model("qwen3_moe")
    with pytest.raises(ValueError, match="apply to mixture-of-experts models"):
        moe.check_layout(None, 1, 2, None)
    with pytest.raises(ValueError, match="tp 1"):
        moe.check_layout(q3.experts, 2, 1, None)
    with pytest.raises(ValueError, match="etp 3 must divide moe_intermediate_size"):
        moe.check_layout(q3.experts, 1, 2, 3)
    moe.check_layout(q3.experts, 1, 4, 2)  # 4 experts over ep 4, I = 16 over etp 2
