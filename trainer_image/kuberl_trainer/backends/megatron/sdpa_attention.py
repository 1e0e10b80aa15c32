"""Core attention for Megatron-core layers backed by PyTorch's scaled_dot_product_attention.

Megatron's own non-Transformer-Engine attention (``DotProductAttention``) materialises the full
``[b, heads, s, s]`` score matrix with baddbmm, a softmax and bmm; without Transformer Engine
(which the GPU machines here cannot install) that made the Megatron path run at about a third
of the fsdp backend's speed. SDPA dispatches to FlashAttention-2 / memory-efficient kernels and
handles grouped-query attention without copying keys and values (``enable_gqa``).

Packed sequences (Megatron's ``thd`` format: the micro-batch's sequences concatenated into one
row, ``cu_seqlens`` marking where each starts) go to ``backends/varlen_attention.sdpa_packed``,
which the fsdp backend shares: no token attends across a sequence boundary and no padding is
computed.

``sdpa(...)`` is the pure function (testable on CPU); ``core_attention_class()`` wraps it and
``sdpa_packed`` in the module interface Megatron's layer specs build
(``submodules.core_attention``), importing megatron-core only when called;
``local_spec_with_sdpa`` is the local GPT layer spec with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from kuberl_trainer.backends.varlen_attention import sdpa_packed


def sdpa(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
         causal: bool, scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Attention in Megatron's layouts.

    Args:
        query: ``[sq, b, heads, hn]``.
        key, value: ``[sk, b, groups, hn]``; ``heads`` must be a multiple of ``groups``
            (grouped-query attention: each group's key and value serve ``heads / groups``
            query heads, the same grouping as the fused QKV layout).
        attention_mask: Megatron's boolean mask, True where attention is *not* allowed,
            broadcastable to ``[b, heads, sq, sk]``; None with ``causal`` for the plain causal
            mask (no tensor built).
        scale: the softmax scale; default ``1 / sqrt(hn)``.

    Returns:
        ``[sq, b, heads * hn]``, as Megatron's attention output projection expects.
    """
    sq, b, heads, hn = query.shape
    groups = key.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} key/value groups")
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, hn]
    mask = None if attention_mask is None else ~attention_mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p,
        is_causal=causal and attention_mask is None,
        scale=scale if scale is not None else 1.0 / math.sqrt(hn),
        enable_gqa=groups != heads)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def core_attention_class() -> type:
    """The Megatron module class (built lazily: it subclasses megatron-core's MegatronModule)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):  # type: ignore[misc]
        """Drop-in for ``DotProductAttention`` (same constructor and forward arguments)."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any,
                     attention_type: str, attention_dropout: float | None = None,
                     softmax_scale: float | None = None, cp_comm_type: str | None = None,
                     pg_collection: Any = None) -> None:
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("SDPA core attention has no context parallelism; use cp 1 "
                                 "(or Transformer Engine's attention)")
            self.causal = attn_mask_type == AttnMaskType.causal
            self.dropout = (config.attention_dropout if attention_dropout is None
                            else attention_dropout)
            self.scale = softmax_scale
            if config.apply_query_key_layer_scaling:
                raise ValueError("apply_query_key_layer_scaling is for fp16 overflow; not "
                                 "supported by SDPA core attention")

        def forward(self, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, attn_mask_type: Any = None,
                    attention_bias: Tensor | None = None, packed_seq_params: Any = None
                    ) -> Tensor:
            if attention_bias is not None:
                raise ValueError("SDPA core attention takes no attention bias")
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError("SDPA core attention packs sequences only in thd format")
                if self.training and self.dropout > 0:
                    raise ValueError("packed SDPA attention has no dropout; set it to 0")
                return sdpa_packed(query, key, value, packed_seq_params.cu_seqlens_q,
                                   packed_seq_params.max_seqlen_q, scale=self.scale)
            causal = self.causal if attn_mask_type is None else (
                attn_mask_type == AttnMaskType.causal)
            return sdpa(query, key, value, attention_mask, causal=causal, scale=self.scale,
                        dropout_p=self.dropout if self.training else 0.0)

    return SDPACoreAttention


def local_spec_with_sdpa(qk_layernorm: bool = False, num_experts: int | None = None) -> Any:
    """Megatron's local GPT layer spec with ``SDPACoreAttention`` as its core attention (and an
    MoE MLP of ``SequentialMLP`` experts when ``num_experts``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = core_attention_class()
    return spec
