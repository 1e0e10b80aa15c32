"""What the trainer and the engines share about mixture-of-experts models (kuberl_wire): route
tables on the wire, the MoE layout read from a config, and experts' checkpoint names."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

from kuberl_wire import expert_names
from kuberl_wire.moe_routes import NO_ROUTE, decode, encode, mismatch, moe_shape, pad_to
from tests.unit.tiny_lm import tiny_qwen3_moe_config


def test_routes_travel_as_base64_of_int32_rows_in_order() -> None:
    table = torch.tensor([[[3, 1], [NO_ROUTE, NO_ROUTE]], [[0, 2], [NO_ROUTE, NO_ROUTE]]])
    text = encode(table)
    # SGLang's form: the int32 bytes of the [tokens, layers, top_k] table, row-major.
    raw = base64.b64decode(text)
    assert torch.frombuffer(bytearray(raw), dtype=torch.int32).tolist() == [
        3, 1, -1, -1, 0, 2, -1, -1]
    assert torch.equal(decode(text, layers=2, top_k=2), table)
    with pytest.raises(ValueError, match="not a whole number of tokens"):
        decode(text, layers=3, top_k=2)
    padded = pad_to(decode(text, 2, 2), 4, 2, 2)
    assert padded.shape == (4, 2, 2) and (padded[2:] == NO_ROUTE).all()


def test_the_moe_layout_is_read_from_the_config() -> None:
    shape = moe_shape(tiny_qwen3_moe_config().to_dict())
    assert shape is not None
    assert (shape.layers, shape.experts, shape.top_k) == (3, 4, 2)
    assert shape.moe_layers == (0, 2) and shape.dense_layers == (1,)
    assert moe_shape({"num_hidden_layers": 2, "hidden_size": 8}) is None  # dense
    deepseek = moe_shape({"num_hidden_layers": 4, "n_routed_experts": 8,
                          "num_experts_per_tok": 2, "first_k_dense_replace": 1})
    assert deepseek is not None and deepseek.moe_layers == (1, 2, 3)


def test_mismatch_counts_routes_whose_expert_sets_differ() -> None:
    own = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]]])
    replayed = torch.tensor([[[1, 0]], [[2, 1]], [[NO_ROUTE, NO_ROUTE]]])
    # order within a top-k does not count; a NO_ROUTE row is not compared
    assert mismatch(own, replayed) == (1, 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_names_are_the_checkpoints_and_fuse_back_exactly(
        tmp_path: Path, family: str) -> None:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32, num_experts=4, num_experts_per_tok=2))
    model.save_pretrained(tmp_path)
    disk = load_file(next(tmp_path.glob("*.safetensors")))
    ours = dict(part for name, t in model.state_dict().items()
                for part in expert_names.split(name, t))
    assert set(ours) == set(disk)
    assert all(torch.equal(ours[name], disk[name]) for name in disk)
    fused = expert_names.fuse(disk)
    assert set(fused) == set(model.state_dict())
    assert all(torch.equal(fused[n], t) for n, t in model.state_dict().items())
    # A slot is a view: writing an expert's matrix there writes the fused parameter.
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    slot = expert_names.slot(name)
    assert slot is not None
    param = model.state_dict()[slot.fused]
    slot.view(param).fill_(7.0)
    assert dict(expert_names.split(slot.fused, param))[name].eq(7.0).all()
    del disk["model.layers.0.mlp.experts.1.gate_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks experts' 1\.gate_proj"):
        expert_names.fuse(disk)
