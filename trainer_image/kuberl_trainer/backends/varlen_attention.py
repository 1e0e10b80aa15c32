"""Causal attention over packed sequences, for both backends. Pure torch.

A packed micro-batch is one row of ``t`` tokens holding several sequences back to back
(``backends/packing.py``); ``cu_seqlens`` marks where each starts. Attention must stay inside
each sequence and compute nothing for padding, which there is none of.

- On a GPU, in bf16/fp16: PyTorch's variable-length flash attention
  (``torch.nn.attention.varlen``, torch 2.9+), one kernel for all the sequences.
- Elsewhere (CPU, float32, an older torch): the sequences are laid out as a right-padded
  ``[n, longest]`` batch for one causal ``scaled_dot_product_attention`` call, and the real
  positions read back. Causality alone keeps padding out: a real query at position ``i``
  sees keys ``0..i``, all inside its own sequence. Only attention computes the padding (a
  loop over the sequences instead made the CPU demo's step 3.5x slower: 256 short
  sequences, four layers, three passes).

``sdpa_packed`` is the function; ``hf_varlen_attention`` adapts it to Hugging Face's attention
interface (registered as ``HF_ATTENTION``), which is how the fsdp backend's HF models run
packed: the boundaries arrive through the forward's ``cu_seq_lens_q``/``max_length_q``
keyword arguments, the names HF's own flash-attention path takes.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

HF_ATTENTION = "kuberl_varlen"


def sdpa_packed(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                *, scale: float | None = None) -> Tensor:
    """Causal attention within each of the packed sequences.

    Args:
        query: ``[t, heads, hn]`` (``t``: all sequences' tokens, concatenated).
        key, value: ``[t, groups, hn]``; ``heads`` must be a multiple of ``groups``
            (grouped-query attention: each group's key and value serve ``heads / groups``
            query heads).
        cu_seqlens: int32 ``[n + 1]``, sequence ``i`` is tokens ``cu[i]:cu[i+1]``.
        max_seqlen: the longest sequence (the varlen kernel's tiling bound).
        scale: the softmax scale; default ``1 / sqrt(hn)``.

    Returns:
        ``[t, heads * hn]``.
    """
    t, heads, hn = query.shape
    groups = key.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} key/value groups")
    scale = scale if scale is not None else 1.0 / math.sqrt(hn)
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen() is not None:
        out = _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scale)
    else:
        out = _padded(query, key, value, cu_seqlens, max_seqlen, scale)
    return out.reshape(t, heads * hn)


def _padded(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int,
            scale: float) -> Tensor:
    """``[t, heads, hn]``: the packed sequences as a padded batch through one causal SDPA
    call (see the module docstring). Differentiable; no host sync (the sizes are known)."""
    t, heads, hn = q.shape
    groups = k.shape[1]
    cu = cu.to(device=q.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    n = lengths.shape[0]
    seq = torch.repeat_interleave(torch.arange(n, device=q.device), lengths, output_size=t)
    slot = seq * max_seqlen + torch.arange(t, device=q.device) - cu[seq]  # row-major [n, s]
    # q, k and v in one scatter: one index_copy is far cheaper than three index_puts.
    qkv = torch.cat([q, k, v], dim=1)
    padded = qkv.new_zeros(n * max_seqlen, *qkv.shape[1:]).index_copy(0, slot, qkv)
    parts = torch.split(padded.view(n, max_seqlen, -1, hn), [heads, groups, groups], dim=2)
    pq, pk, pv = (x.transpose(1, 2) for x in parts)
    out = F.scaled_dot_product_attention(pq, pk, pv, is_causal=True, scale=scale,
                                         enable_gqa=groups != heads)   # [n, h, s, hn]
    return out.transpose(1, 2).reshape(n * max_seqlen, heads, hn).index_select(0, slot)


@functools.cache
def _varlen() -> Any:
    """``torch.nn.attention.varlen.varlen_attn`` where this torch has it (2.9+), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen()).parameters)


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int,
                  scale: float) -> Tensor:
    fn = _varlen()
    params = _varlen_parameters()
    # The causal switch changed name across torch releases: is_causal, then window_size.
    causal: dict[str, Any] = ({"window_size": (-1, 0)} if "window_size" in params
                              else {"is_causal": True})
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            causal["enable_gqa"] = True
        else:  # older kernels want as many key/value heads as query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out: Tensor = fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal)
    return out


# -- Hugging Face ----------------------------------------------------------------------------


def hf_varlen_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None, *, scaling: float | None = None,
                        dropout: float = 0.0, sliding_window: int | None = None,
                        cu_seq_lens_q: Tensor | None = None, max_length_q: int | None = None,
                        **_: Any) -> tuple[Tensor, None]:
    """HF's attention interface over one packed row.

    ``query`` is ``[1, heads, t, hn]``, ``key``/``value`` ``[1, groups, t, hn]`` (after RoPE);
    returns ``([1, t, heads, hn], None)``, the layout HF's attention modules reshape. Under
    autocast the inputs are cast to its dtype: RoPE's float32 tables promote ``q`` and ``k``
    to float32, which the flash kernel does not take.
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attention {HF_ATTENTION!r} runs packed rows only: the forward "
                         "needs cu_seq_lens_q and max_length_q")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"attention {HF_ATTENTION!r} takes one packed row and no attention "
                         f"mask, got {query.shape[0]} rows")
    if sliding_window is not None:
        raise ValueError(f"attention {HF_ATTENTION!r} has no sliding window; this model's "
                         "config asks for one")
    if dropout:
        raise ValueError(f"attention {HF_ATTENTION!r} has no dropout")
    device = query.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else query.dtype)
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [t, h, hn]
    t, heads, hn = q.shape
    out = sdpa_packed(q, k, v, cu_seq_lens_q, max_length_q, scale=scaling)
    return out.view(1, t, heads, hn), None


def register_hf_attention() -> str:
    """Register ``hf_varlen_attention`` with transformers (idempotent); returns its name, for
    ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_varlen_attention)
    return HF_ATTENTION
