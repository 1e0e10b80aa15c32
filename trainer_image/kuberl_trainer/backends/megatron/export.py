"""What a Megatron trainer sends to the engines, in which buckets: the plan for weight sync from
TP/PP shards (pure; the gathering itself needs the process groups).

Each ``Export`` is one Megatron tensor (full, i.e. after gathering its TP shards) and the HF
tensors it becomes (fused QKV -> q, k, v; fused fc1 -> gate, up; padded vocabulary rows
dropped; an MoE layer's expert ``j``: the same local expert of every ep rank, gathered over
the expert tensor-and-expert-parallel group, becomes each of those experts' per-expert HF
matrices, the checkpoint's and SGLang's names). Buckets never mix pipeline stages: a stage's
ranks gather and send their own layers, then hand over to the next stage, so memory stays
bounded by one bucket per stage at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kuberl_trainer.backends.megatron import moe_layout as moe
from kuberl_trainer.backends.megatron.hf_layout import (
    DecoderShape,
    split_qkv,
    stage_layers,
    tp_gather,
)
from kuberl_wire.plan import iter_buckets


@dataclass(frozen=True)
class Export:
    megatron: str             # the Megatron name (global layer index)
    hf: tuple[str, ...]       # the HF names it becomes, in that order
    stage: int                # the pipeline stage that holds it
    hf_numel: int             # elements of the HF tensors together (padding dropped)
    experts: tuple[int, ...] = ()  # an expert tensor: the global experts gathered, by ep rank

    def local_source(self, ep_rank: int) -> str:
        """The global Megatron name of the tensor ep rank ``ep_rank`` contributes."""
        if not self.experts:
            return self.megatron
        head, _, tail = moe.split_expert_name(self.megatron) or ("", 0, "")
        return f"{head}{self.experts[ep_rank]}{tail}"


def _moe_mlp(shape: DecoderShape, i: int, stage: int, ep: int) -> list[Export]:
    """Layer ``i``'s MoE MLP: router, experts (one export per local expert index and matrix,
    covering that index on every ep rank), Qwen2-MoE's shared expert."""
    e = shape.experts
    assert e is not None
    h, m, p = shape.hidden, f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    out = [Export(m + "router.weight", (p + "gate.weight",), stage, e.experts * h)]
    per = e.experts // ep
    for j in range(per):
        group = tuple(r * per + j for r in range(ep))
        out.append(Export(moe.expert_name(i, j, "linear_fc1"), tuple(
            f"{p}experts.{x}.{k}_proj.weight" for x in group for k in ("gate", "up")), stage,
            ep * 2 * e.ffn * h, group))
        out.append(Export(moe.expert_name(i, j, "linear_fc2"), tuple(
            f"{p}experts.{x}.down_proj.weight" for x in group), stage, ep * e.ffn * h, group))
    if e.shared_ffn:
        s = p + "shared_expert."
        out += [Export(m + "shared_experts.linear_fc1.weight", (s + "gate_proj.weight",
                                                               s + "up_proj.weight"), stage,
                       2 * e.shared_ffn * h),
                Export(m + "shared_experts.linear_fc2.weight", (s + "down_proj.weight",), stage,
                       e.shared_ffn * h),
                Export(m + "shared_experts.gate_weight", (p + "shared_expert_gate.weight",),
                       stage, h)]
    return out


def exports(shape: DecoderShape, pp: int = 1, ep: int = 1) -> list[Export]:
    """Every tensor to send, stage by stage, layers in order (the engines' load order does not
    matter to them; this order lets each stage send what it holds in one pass)."""
    h, hd, ffn = shape.hidden, shape.head_dim, shape.ffn
    q_rows, kv_rows = shape.num_heads * hd, shape.num_kv_heads * hd
    out = [Export("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0,
                  shape.vocab * h)]
    for stage in range(pp):
        for i in stage_layers(shape.num_layers, pp, stage):
            m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            attn = tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")
            items = [
                Export(m + "input_layernorm.weight", (p + "input_layernorm.weight",), stage, h),
                Export(m + "self_attention.linear_qkv.weight", attn, stage,
                       (q_rows + 2 * kv_rows) * h),
            ]
            if shape.qkv_bias:
                items.append(Export(m + "self_attention.linear_qkv.bias",
                                    tuple(n.replace(".weight", ".bias") for n in attn), stage,
                                    q_rows + 2 * kv_rows))
            if shape.qk_norm:
                items += [Export(m + f"self_attention.{x}_layernorm.weight",
                                 (p + f"self_attn.{x}_norm.weight",), stage, hd) for x in "qk"]
            items += [
                Export(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",),
                       stage, h * q_rows),
                Export(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",),
                       stage, h),
            ]
            if shape.experts is not None:
                items += _moe_mlp(shape, i, stage, ep)
            else:
                items += [
                    Export(m + "mlp.linear_fc1.weight",
                           (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), stage,
                           2 * ffn * h),
                    Export(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), stage,
                           h * ffn),
                ]
            out += items
    last = pp - 1
    out.append(Export("decoder.final_layernorm.weight", ("model.norm.weight",), last, h))
    if not shape.tied:
        out.append(Export("output_layer.weight", ("lm_head.weight",), last, shape.vocab * h))
    return out


def plan(shape: DecoderShape, pp: int, bucket_bytes: int, bytes_per_element: int, ep: int = 1
         ) -> list[list[Export]]:
    """Buckets of at most ``bucket_bytes`` of HF tensors (one export larger than that gets a
    bucket of its own), never spanning two pipeline stages, in send order."""
    buckets: list[list[Export]] = []
    for stage in range(pp):
        mine = [e for e in exports(shape, pp, ep) if e.stage == stage]
        buckets += iter_buckets(mine, lambda e: e.hf_numel * bytes_per_element, bucket_bytes)
    return buckets


def gather_experts(export: Export, parts: list[Tensor], shape: DecoderShape, etp: int, ep: int
                   ) -> list[Tensor]:
    """An expert export's full matrices, one per ep rank, from the shards gathered over the
    expert tensor-and-expert-parallel group (``moe_layout.expert_group_order``)."""
    order = moe.expert_group_order(etp, ep)
    if len(parts) != len(order):
        raise ValueError(f"{export.megatron}: {len(parts)} shards for etp {etp} x ep {ep}")
    return [tp_gather(export.megatron, [parts[i] for i, (r, _) in enumerate(order) if r == rank],
                      shape) for rank in range(ep)]


def experts_to_hf(export: Export, fulls: list[Tensor]) -> list[tuple[str, Tensor]]:
    """The per-expert HF matrices of an expert export (``gather_experts``'s output)."""
    if export.megatron.endswith("linear_fc1.weight"):
        halves = [t for full in fulls for t in full.chunk(2)]
        return list(zip(export.hf, halves, strict=True))
    return list(zip(export.hf, fulls, strict=True))


def to_hf(export: Export, full: Tensor, shape: DecoderShape) -> list[tuple[str, Tensor]]:
    """The HF tensors of one gathered Megatron tensor (not an expert's: ``experts_to_hf``)."""
    if "linear_qkv" in export.megatron:
        return list(zip(export.hf, split_qkv(full, shape), strict=True))
    if export.megatron.endswith("linear_fc1.weight"):
        return list(zip(export.hf, full.chunk(2), strict=True))
    if export.megatron.endswith(("word_embeddings.weight", "output_layer.weight")):
        return [(export.hf[0], full[:shape.vocab])]
    return [(export.hf[0], full)]
