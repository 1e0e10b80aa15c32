"""The megatron backend's model plumbing that runs without megatron-core (megatron/model.py):
which pipeline stage and TP rank holds which tensor under which name, loading a rank's share
into a module, and the rotary settings read from HF configs. Building and running the
GPTModel itself needs GPUs (bench/megatron_backend_check.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kuberl_trainer.backends.megatron import hf_layout as L, model as M

COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 300,
          "max_position_embeddings": 64}


def hf_model(tied: bool) -> tuple[dict[str, torch.Tensor], L.DecoderShape]:
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)) if tied
             else LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, L.DecoderShape.from_hf_config(model.config.to_dict())


def test_names_by_stage() -> None:
    """4 layers over 2 stages: stage 1 holds global layers 2-3 as its local 0-1, the last
    norm and the output layer; stage 0 holds the embedding and layers 0-1."""
    first, last = M.Parallel(pp=2, pp_rank=0), M.Parallel(pp=2, pp_rank=1)
    assert M.local_name("decoder.layers.3.mlp.linear_fc2.weight", last, 4) == \
        "decoder.layers.1.mlp.linear_fc2.weight"
    assert M.local_name("decoder.layers.3.mlp.linear_fc2.weight", first, 4) is None
    assert M.local_name("decoder.layers.1.input_layernorm.weight", first, 4) == \
        "decoder.layers.1.input_layernorm.weight"
    assert M.local_name("embedding.word_embeddings.weight", last, 4) is None
    assert M.local_name("output_layer.weight", last, 4) == "output_layer.weight"
    assert M.local_name("decoder.final_layernorm.weight", first, 4) is None
    assert M.global_name("decoder.layers.1.mlp.linear_fc2.weight", last, 4) == \
        "decoder.layers.3.mlp.linear_fc2.weight"
    with pytest.raises(ValueError, match="unknown Megatron tensor"):
        M.local_name("rotary.inv_freq", first, 4)


@pytest.mark.parametrize("tied", [True, False], ids=["qwen2-tied", "llama3"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_rank_shares_reassemble_the_checkpoint(tied: bool, tp: int, pp: int) -> None:
    """Every rank's share, put back together (global names, TP shards gathered), is the whole
    Megatron state dict, bit for bit; a tied model's last stage also holds the embedding as
    its output layer (Megatron keeps that copy in step by all-reducing its gradient)."""
    hf, shape = hf_model(tied)
    want = L.hf_to_megatron(hf, shape, tp=tp)
    shards: dict[str, list[torch.Tensor]] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            par = M.Parallel(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
            share = M.stage_state(hf, shape, par)
            if tied and pp > 1 and par.last_stage:
                out = share.pop("output_layer.weight")
                assert torch.equal(out, L.tp_shard("embedding.word_embeddings.weight",
                                                   want["embedding.word_embeddings.weight"],
                                                   shape, tp, tp_rank))
            for name, tensor in share.items():
                shards.setdefault(M.global_name(name, par, shape.num_layers), []).append(tensor)
    got = {name: L.tp_gather(name, parts, shape) for name, parts in shards.items()}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def module_with(share: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree with exactly the parameter names and shapes of one rank's share."""
    root = nn.Module()
    for name, tensor in share.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, nn.Parameter(torch.zeros_like(tensor)))
    return root


def test_load_hf_fills_every_parameter_in_place_and_refuses_a_mismatch() -> None:
    hf, shape = hf_model(tied=False)
    par = M.Parallel(tp=2, tp_rank=1, pp=2, pp_rank=1)
    share = M.stage_state(hf, shape, par)
    module = module_with(share)
    storage = [p.data_ptr() for p in module.parameters()]
    M.load_hf(module, hf, shape, par)
    assert [p.data_ptr() for p in module.parameters()] == storage  # copied, not replaced
    for name, p in module.named_parameters():
        assert torch.equal(p, share[name])
    other = M.Parallel(tp=2, tp_rank=1, pp=2, pp_rank=0)  # stage 0's tensors: wrong stage
    with pytest.raises(ValueError, match="does not match the Megatron model"):
        M.load_hf(module, hf, shape, other)


def test_rope_settings_from_old_and_new_configs() -> None:
    assert M.rope_settings({"rope_theta": 1e6}) == {"rotary_base": 1000000}
    assert M.rope_settings({"rope_parameters": {"rope_type": "default",
                                                "rope_theta": 5e5}}) == {"rotary_base": 500000}
    assert M.rope_settings({}) == {"rotary_base": 10000}
    llama31 = {"rope_parameters": {"rope_type": "llama3", "factor": 32.0, "rope_theta": 5e5,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}}
    assert M.rope_settings(llama31) == {"rotary_base": 500000, "rope_scaling": True,
                                        "rope_scaling_factor": 32.0}


@pytest.mark.parametrize(("config", "words"), [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
     "high_freq_factor"),
])
def test_rope_settings_refuse_what_megatron_would_compute_differently(
        config: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        M.rope_settings(config)
