"""Megatron-core with SDPA core attention vs its local attention vs HF transformers (what the
fsdp backend runs), on one GPU: logits agreement, then training throughput (forward + backward
on a cross-entropy loss, bf16, random weights of the Qwen2.5-0.5B shape), side by side.

    torchrun --nproc-per-node 1 bench/megatron_attention.py [--batch 8 --seq 1024 --iters 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

from kuberl_trainer.backends.megatron import hf_layout as L
from kuberl_trainer.backends.megatron.sdpa_attention import local_spec_with_sdpa

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "max_position_embeddings": 4096, "tie_word_embeddings": True, "rope_theta": 1e6}
FUSE_SWIGLU = "--fuse-swiglu" in sys.argv  # Megatron's jit-fused SwiGLU (no TE/apex needed)
SMALL = {**QWEN25_05B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}


def megatron(hf_cfg: dict, shape: L.DecoderShape, *, sdpa: bool, dtype: torch.dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        bias_activation_fusion=FUSE_SWIGLU, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0)
    spec = local_spec_with_sdpa() if sdpa else get_gpt_layer_local_spec()
    return GPTModel(config=cfg, transformer_layer_spec=spec,
                    vocab_size=L.padded_vocab(shape.vocab, 1), max_sequence_length=4096,
                    position_embedding_type="rope", rotary_base=int(hf_cfg["rope_theta"]),
                    share_embeddings_and_output_weights=shape.tied, parallel_output=False).cuda()


def build(cfg: dict, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa")).to(dtype).cuda()
    shape = L.DecoderShape.from_hf_config(hf.config.to_dict())
    full = L.hf_to_megatron(hf.state_dict(), shape)
    models = {"hf (sdpa)": hf}
    for name, use in (("megatron local", False), ("megatron sdpa", True)):
        m = megatron(cfg, shape, sdpa=use, dtype=dtype)
        m.load_state_dict(full, strict=False)
        models[name] = m
    return models, shape


def run(model, name: str, ids, mask):
    pos = torch.arange(ids.shape[1], device="cuda")[None].expand_as(ids)
    if name.startswith("hf"):
        return model(input_ids=ids).logits
    return model(ids, pos, attention_mask=None if name.endswith("sdpa") else mask)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fuse-swiglu", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels")
    a = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")

    models, shape = build(SMALL, torch.float32)
    ids = torch.randint(0, shape.vocab, (2, 64), device="cuda")
    mask = torch.triu(torch.ones(64, 64, device="cuda"), diagonal=1).bool()[None, None]
    with torch.no_grad():
        out = {n: run(m, n, ids, mask)[..., :shape.vocab].float() for n, m in models.items()}
    for n in ("megatron local", "megatron sdpa"):
        print(f"fp32 logits, {n} vs hf: max |diff| {(out[n] - out['hf (sdpa)']).abs().max():.2e}")

    models, shape = build(QWEN25_05B, torch.bfloat16)
    ids = torch.randint(0, shape.vocab, (a.batch, a.seq), device="cuda")
    labels = torch.randint(0, shape.vocab, (a.batch, a.seq), device="cuda")
    mask = torch.triu(torch.ones(a.seq, a.seq, device="cuda"), diagonal=1).bool()[None, None]
    tokens = a.batch * a.seq
    rates = {}
    for name, model in models.items():
        model.train()
        for i in range(a.iters + 3):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            logits = run(model, name, ids, mask)[..., :shape.vocab]
            loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab), labels.reshape(-1))
            loss.backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rates[name] = tokens * a.iters / (time.perf_counter() - t0)
        del logits, loss
        model.cpu()
        torch.cuda.empty_cache()
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile
        for name in ("hf (sdpa)", "megatron sdpa"):
            model = models[name].cuda()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    logits = run(model, name, ids, mask)[..., :shape.vocab]
                    F.cross_entropy(logits.float().reshape(-1, shape.vocab),
                                    labels.reshape(-1)).backward()
                torch.cuda.synchronize()
            print(f"== {name}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                            max_name_column_width=60))
            model.cpu()
            del logits
            torch.cuda.empty_cache()
    base = rates["hf (sdpa)"]
    print(f"Qwen2.5-0.5B shape, bf16, batch {a.batch} x {a.seq}, forward + backward"
          f"{', fused SwiGLU' if FUSE_SWIGLU else ''}")
    print(f"{'model':<16} {'tokens/s':>10} {'vs hf':>7}")
    for name, rate in rates.items():
        print(f"{name:<16} {rate:>10.0f} {rate / base:>6.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
