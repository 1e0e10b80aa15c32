"""Hugging Face <-> Megatron-core weight layout for the dense decoder families users train most
(Qwen2/Qwen2.5, Qwen3, Llama 3): names, fused tensors, and tensor-parallel shards. Pure torch.

Megatron-core's GPTModel (local or Transformer Engine layer spec) differs from HF in three ways:

- **Fused QKV** (``self_attention.linear_qkv``): rows grouped by query group - for each of the
  ``num_kv_heads`` groups, its ``num_heads / num_kv_heads`` query heads, then its key head, then
  its value head, ``head_dim`` rows each. Tensor parallelism splits whole groups, so a rank's
  shard has the same layout with ``num_kv_heads / tp`` groups.
- **Fused gate/up** (``mlp.linear_fc1``): ``[gate; up]``, and per TP rank ``[gate_r; up_r]``
  (each rank's SwiGLU needs its own gate and up halves), so a TP shard is not a contiguous row
  slice of the full tensor.
- **Names**, and the vocabulary padded to a multiple of ``128 * tp`` rows (embedding, output).

Row-parallel weights (``linear_proj``, ``linear_fc2``) split along the input dimension; column-
parallel ones (``linear_qkv``, ``linear_fc1``, embeddings, ``output_layer``) along the output
dimension; norms are replicated. Pipeline stages hold consecutive layers (``stage_layers``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kuberl_trainer.backends.megatron import moe_layout as moe
from kuberl_trainer.backends.megatron.moe_layout import ExpertShape

VOCAB_DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by default


@dataclass(frozen=True)
class DecoderShape:
    """What the layout depends on, read from an HF config (``from_hf_config``)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool   # Qwen2/Qwen2.5
    qk_norm: bool    # Qwen3: RMSNorm on each head's q and k
    experts: ExpertShape | None = None  # mixture-of-experts models (moe_layout)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> DecoderShape:
        kind = config.get("model_type")
        if kind not in ("qwen2", "qwen3", "llama", *moe.MOE_FAMILIES):
            raise ValueError(f"model_type {kind!r} is not supported by the megatron backend "
                             f"(qwen2, qwen3, llama, {', '.join(moe.MOE_FAMILIES)} are)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(num_layers=int(config["num_hidden_layers"]), hidden=hidden, num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   ffn=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
                   tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=kind in ("qwen2", "qwen2_moe")
                   or bool(config.get("attention_bias", False)),
                   qk_norm=kind in ("qwen3", "qwen3_moe"),
                   experts=ExpertShape.from_hf_config(config))

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tp(self, tp: int) -> None:
        for what, n in (("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.ffn)):
            if n % tp:
                raise ValueError(f"tp {tp} must divide {what} ({n})")


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of Megatron's embedding and output layer: ``vocab`` rounded up to a multiple of
    ``divisible_by * tp`` (so every TP rank holds the same number of rows)."""
    step = divisible_by * tp
    return -(-vocab // step) * step


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global layer indices pipeline stage ``stage`` of ``pp`` holds (an even split)."""
    if num_layers % pp:
        raise ValueError(f"pp {pp} must divide the number of layers ({num_layers})")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


# -- fused tensors ---------------------------------------------------------------------------


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: DecoderShape) -> Tensor:
    """HF ``q_proj``, ``k_proj``, ``v_proj`` (weights ``[out, hidden]`` or biases ``[out]``) ->
    Megatron's grouped ``linear_qkv``."""
    g, hd = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, shape.heads_per_group * hd, *rest)
    return torch.cat([qg, k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1).reshape(
        -1, *rest)


def split_qkv(qkv: Tensor, shape: DecoderShape, groups: int | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``fuse_qkv``; ``groups``: how many query groups ``qkv`` holds (a TP shard
    holds ``num_kv_heads / tp``)."""
    g = shape.num_kv_heads if groups is None else groups
    hd, per = shape.head_dim, shape.heads_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * hd, *rest)
    q = grouped[:, :per * hd]
    k = grouped[:, per * hd:(per + 1) * hd]
    v = grouped[:, (per + 1) * hd:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# -- names -----------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# HF per-layer suffix -> Megatron per-layer suffix, for the tensors that map one to one.
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_SIMPLE_BACK = {v: k for k, v in _SIMPLE.items()}


def hf_to_megatron(hf: Mapping[str, Tensor], shape: DecoderShape, *, tp: int = 1
                   ) -> dict[str, Tensor]:
    """A full HF state dict -> Megatron names and fused layouts, unsharded, with the vocabulary
    padded (with zeros) for ``tp``. Raises on a tensor it does not know (nothing is dropped
    silently)."""
    out: dict[str, Tensor] = {}
    rows = padded_vocab(shape.vocab, tp)
    used: set[str] = set()
    if shape.experts is not None:
        hf = moe.normalise_hf(hf)
    for i in range(shape.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (f"{p}self_attn.{x}_proj.{kind}" for x in "qkv")
            out[f"{m}self_attention.linear_qkv.{kind}"] = fuse_qkv(hf[q], hf[k], hf[v], shape)
            used.update((q, k, v))
        if shape.experts is not None:
            out.update(moe.hf_mlp_to_megatron(hf, i, shape.experts, used))
        else:
            gate, up = f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[gate], hf[up]])
            used.update((gate, up))
        for suffix, target in _SIMPLE.items():
            if p + suffix in hf:
                out[m + target] = hf[p + suffix]
                used.add(p + suffix)
    out["embedding.word_embeddings.weight"] = _pad_rows(hf["model.embed_tokens.weight"], rows)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    used.update(("model.embed_tokens.weight", "model.norm.weight"))
    if not shape.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], rows)
        used.add("lm_head.weight")
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # the tied alias of the embedding
    unknown = sorted(set(hf) - used)
    if unknown:
        raise ValueError(f"HF tensors with no Megatron counterpart: {unknown[:5]}")
    return out


def megatron_to_hf(mg: Mapping[str, Tensor], shape: DecoderShape) -> dict[str, Tensor]:
    """Inverse of ``hf_to_megatron`` (full tensors, any vocabulary padding dropped). A tied
    model gets no ``lm_head.weight`` entry, as HF saves it."""
    out: dict[str, Tensor] = {}
    for name, t in mg.items():
        layer = _MG_LAYER.match(name)
        if layer is None:
            continue
        p, suffix = f"model.layers.{layer.group(1)}.", layer.group(2)
        experts = moe.megatron_mlp_to_hf(suffix, t, p)
        if experts is not None:
            out.update(experts)
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            for x, part in zip("qkv", split_qkv(t, shape), strict=True):
                out[f"{p}self_attn.{x}_proj.{kind}"] = part
        elif suffix == "mlp.linear_fc1.weight":
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = t.chunk(2)
        elif suffix in _SIMPLE_BACK:
            out[p + _SIMPLE_BACK[suffix]] = t
        else:
            raise ValueError(f"Megatron tensor {name} has no HF counterpart")
    out["model.embed_tokens.weight"] = mg["embedding.word_embeddings.weight"][:shape.vocab]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not shape.tied:
        out["lm_head.weight"] = mg["output_layer.weight"][:shape.vocab]
    return out


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# -- tensor parallelism ----------------------------------------------------------------------


def tp_kind(name: str) -> str:
    """How a Megatron tensor is split over TP ranks: "qkv", "fc1" (column, fused), "column",
    "row" or "replicated"."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def tp_shard(name: str, full: Tensor, shape: DecoderShape, tp: int, rank: int) -> Tensor:
    """Rank ``rank``'s shard of the full Megatron tensor ``name`` (an expert's: ``tp``, ``rank``
    are etp's, checked by ``ExpertShape.check_parallel``)."""
    if not moe.is_expert(name):
        shape.check_tp(tp)
    kind = tp_kind(name)
    if kind == "replicated":
        return full
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    if kind == "fc1":
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp)[rank]  # qkv: whole query groups, in order; column: rows


def tp_gather(name: str, shards: list[Tensor], shape: DecoderShape) -> Tensor:
    """The full Megatron tensor ``name`` from every TP rank's shard (rank order)."""
    kind = tp_kind(name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]  # (no copy at TP=1: weight sync sends the live tensor)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "fc1":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards)
