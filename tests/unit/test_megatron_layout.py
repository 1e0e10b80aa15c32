"""HF <-> Megatron-core layout (megatron/hf_layout.py) on real HF models of each supported
family, on CPU: names, fused QKV and gate/up, vocabulary padding, TP shards and PP stages.
Round trips must be bit-exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kuberl_trainer.backends.megatron import hf_layout as L

COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 300,
          "max_position_embeddings": 64}
FAMILIES: dict[str, Any] = {
    "qwen2-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16,
                                                  tie_word_embeddings=False)),
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)),
}


@pytest.fixture(params=list(FAMILIES), scope="module")
def model(request: pytest.FixtureRequest) -> tuple[dict[str, torch.Tensor], L.DecoderShape]:
    torch.manual_seed(0)
    hf = FAMILIES[request.param]()
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return sd, L.DecoderShape.from_hf_config(hf.config.to_dict())


def test_shapes_read_from_the_config(model: Any) -> None:
    _, shape = model
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads) == (4, 8, 4)
    assert shape.head_dim in (8, 16) and shape.heads_per_group == 2


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bit_exact(model: Any, tp: int) -> None:
    sd, shape = model
    mg = L.hf_to_megatron(sd, shape, tp=tp)
    back = L.megatron_to_hf(mg, shape)
    expected = {k: v for k, v in sd.items() if not (shape.tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(back[name], t), name


def test_megatron_names_and_shapes(model: Any) -> None:
    """As megatron-core 0.16.1's GPTModel (local layer spec) names its state dict."""
    sd, shape = model
    mg = L.hf_to_megatron(sd, shape, tp=2)
    layer = {k.split(".", 3)[3] for k in mg if k.startswith("decoder.layers.0.")}
    expected = {"input_layernorm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    if shape.qkv_bias:
        expected.add("self_attention.linear_qkv.bias")
    if shape.qk_norm:
        expected |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    assert layer == expected
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows, 64)
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    assert mg["embedding.word_embeddings.weight"].shape == (512, 64)  # 300 -> 2 * 128 * 2
    assert ("output_layer.weight" in mg) == (not shape.tied)


def test_fused_qkv_groups_queries_with_their_key_and_value(model: Any) -> None:
    sd, shape = model
    mg = L.hf_to_megatron(sd, shape)
    qkv = mg["decoder.layers.1.self_attention.linear_qkv.weight"]
    hd = shape.head_dim
    q, k, v = (sd[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    block = (shape.heads_per_group + 2) * hd
    for g in range(shape.num_kv_heads):  # group g: its 2 query heads, its key, its value
        rows = qkv[g * block:(g + 1) * block]
        heads = slice(g * shape.heads_per_group * hd, (g + 1) * shape.heads_per_group * hd)
        assert torch.equal(rows[:shape.heads_per_group * hd], q[heads])
        assert torch.equal(rows[-2 * hd:-hd], k[g * hd:(g + 1) * hd])
        assert torch.equal(rows[-hd:], v[g * hd:(g + 1) * hd])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_hold_their_heads_and_gather_exactly(model: Any, tp: int) -> None:
    sd, shape = model
    mg = L.hf_to_megatron(sd, shape, tp=tp)
    for name, full in mg.items():
        shards = [L.tp_shard(name, full, shape, tp, r) for r in range(tp)]
        assert torch.equal(L.tp_gather(name, shards, shape), full), name
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    groups = shape.num_kv_heads // tp
    q_rows = shape.num_heads // tp * shape.head_dim
    kv_rows = groups * shape.head_dim
    for r in range(tp):
        q, k, v = L.split_qkv(L.tp_shard(name, mg[name], shape, tp, r), shape, groups)
        assert torch.equal(q, sd["model.layers.0.self_attn.q_proj.weight"][
            r * q_rows:(r + 1) * q_rows])
        assert torch.equal(k, sd["model.layers.0.self_attn.k_proj.weight"][
            r * kv_rows:(r + 1) * kv_rows])
        assert torch.equal(v, sd["model.layers.0.self_attn.v_proj.weight"][
            r * kv_rows:(r + 1) * kv_rows])
        fc1 = L.tp_shard("decoder.layers.0.mlp.linear_fc1.weight",
                         mg["decoder.layers.0.mlp.linear_fc1.weight"], shape, tp, r)
        part = 96 // tp  # each rank: its gate rows, then its up rows
        assert torch.equal(fc1[:part], sd["model.layers.0.mlp.gate_proj.weight"][
            r * part:(r + 1) * part])
        assert torch.equal(fc1[part:], sd["model.layers.0.mlp.up_proj.weight"][
            r * part:(r + 1) * part])
        proj = L.tp_shard("decoder.layers.0.self_attention.linear_proj.weight",
                          mg["decoder.layers.0.self_attention.linear_proj.weight"], shape, tp, r)
        width = shape.num_heads * shape.head_dim // tp  # row-parallel: its heads' columns
        assert torch.equal(proj, sd["model.layers.0.self_attn.o_proj.weight"][
            :, r * width:(r + 1) * width])


def test_arithmetic_and_errors(model: Any) -> None:
    sd, shape = model
    assert L.padded_vocab(151936, 1) == 151936 and L.padded_vocab(151936, 8) == 152576
    assert L.padded_vocab(300, 2) == 512
    assert L.stage_layers(28, 4, 1) == range(7, 14)
    with pytest.raises(ValueError, match="pp 3"):
        L.stage_layers(28, 3, 0)
    with pytest.raises(ValueError, match="tp 8"):
        L.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(192, 64), shape, 8, 0)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        L.hf_to_megatron({**sd, "model.layers.0.mlp.extra.weight": torch.zeros(1)}, shape)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        L.DecoderShape.from_hf_config({"model_type": "gpt2"})
