"""The weight-sync plan from Megatron shards (megatron/export.py): every HF tensor exactly once,
buckets bounded and never spanning pipeline stages, and the HF tensors rebuilt bit-exactly
from gathered TP shards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kuberl_trainer.backends.megatron import export as X, hf_layout as L

COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 300,
          "max_position_embeddings": 64}


def model(kind: str) -> tuple[dict[str, torch.Tensor], L.DecoderShape]:
    torch.manual_seed(0)
    hf = (Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)) if kind == "qwen2"
          else Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)))
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    shape = L.DecoderShape.from_hf_config(hf.config.to_dict())
    if shape.tied:
        sd.pop("lm_head.weight")  # HF saves a tied head as the embedding only
    return sd, shape


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_hf_tensor_exactly_once_with_its_size(kind: str, pp: int) -> None:
    sd, shape = model(kind)
    ex = X.exports(shape, pp)
    names = [n for e in ex for n in e.hf]
    assert sorted(names) == sorted(sd) and len(names) == len(set(names))
    for e in ex:
        assert e.hf_numel == sum(sd[n].numel() for n in e.hf), e
    stages = [e.stage for e in ex]
    assert stages == sorted(stages) and set(stages) == set(range(pp))


@pytest.mark.parametrize("pp", [1, 2])
def test_buckets_are_bounded_and_never_span_stages(pp: int) -> None:
    _, shape = model("qwen3")
    cap = 40_000
    buckets = X.plan(shape, pp, bucket_bytes=cap, bytes_per_element=4)
    assert [e for b in buckets for e in b] == X.exports(shape, pp)  # all, in order
    for b in buckets:
        assert len({e.stage for e in b}) == 1
        size = sum(e.hf_numel * 4 for e in b)
        assert size <= cap or len(b) == 1, (size, [e.megatron for e in b])


@pytest.mark.parametrize("tp", [1, 2])
def test_gathered_shards_rebuild_the_hf_tensors(tp: int) -> None:
    sd, shape = model("qwen2")
    full = L.hf_to_megatron(sd, shape, tp=tp)
    rebuilt = {}
    for bucket in X.plan(shape, 1, bucket_bytes=1 << 16, bytes_per_element=4):
        for e in bucket:  # what each rank holds, gathered as the TP group would
            shards = [L.tp_shard(e.megatron, full[e.megatron], shape, tp, r) for r in range(tp)]
            rebuilt.update(X.to_hf(e, L.tp_gather(e.megatron, shards, shape), shape))
    assert sorted(rebuilt) == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(rebuilt[name], t), name
