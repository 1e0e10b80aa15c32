"""The HF -> Megatron-core layout (megatron/hf_layout.py) checked numerically on GPUs: for each
supported family, a random HF model's weights are converted, sharded over the TP ranks of a
megatron-core GPTModel (local layer spec, fp32) and its logits compared with HF's on the same
tokens. Prints the largest absolute difference per family. Run under torchrun; the world size
is the TP size:

    torchrun --nproc-per-node 1 bench/megatron_layout_check.py
    torchrun --nproc-per-node 2 bench/megatron_layout_check.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import family_configs  # bench/ is on sys.path; it adds trainer_image/

from kuberl_trainer.backends.megatron import hf_layout as L

COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
          "max_position_embeddings": 128}


def families() -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_config(config)
            for name, config in family_configs(COMMON).items()}


def megatron_model(shape: L.DecoderShape, hf_config: dict, tp: int) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm",
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, tensor_model_parallel_size=tp, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
        qk_layernorm=shape.qk_norm), vocab_size=L.padded_vocab(shape.vocab, tp),
        max_sequence_length=128, position_embedding_type="rope",
        rotary_base=int(hf_config.get("rope_theta", 10000)),
        share_embeddings_and_output_weights=shape.tied, parallel_output=False)


def main() -> None:
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)  # every rank builds the same HF models and tokens
    ids = torch.randint(0, COMMON["vocab_size"], (2, 48)).cuda()
    rows = []
    for name, hf in families().items():
        shape = L.DecoderShape.from_hf_config(hf.config.to_dict())
        full = L.hf_to_megatron(hf.state_dict(), shape, tp=tp)
        mg = megatron_model(shape, hf.config.to_dict(), tp)
        missing, unexpected = mg.load_state_dict(
            {k: L.tp_shard(k, v, shape, tp, rank) for k, v in full.items()}, strict=False)
        assert not unexpected and all("_extra_state" in k for k in missing), (missing,
                                                                             unexpected)
        mg.cuda().eval()
        hf.cuda().eval()
        s = ids.shape[1]
        mask = torch.triu(torch.ones(s, s, device="cuda"), diagonal=1).bool()[None, None]
        pos = torch.arange(s, device="cuda")[None].expand_as(ids)
        with torch.no_grad():
            ours = mg(ids, pos, attention_mask=mask)[..., :shape.vocab].float()
            ref = hf(input_ids=ids).logits.float()
        diff = float((ours - ref).abs().max())
        rows.append((name, diff, float(ref.abs().max())))
    if rank == 0:
        print(f"TP={tp} on {torch.cuda.get_device_name()}")
        print(f"{'family':<30} {'max |logit diff|':>17} {'max |logit|':>12}")
        for name, diff, scale in rows:
            print(f"{name:<30} {diff:>17.2e} {scale:>12.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
