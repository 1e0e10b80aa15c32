"""SDPA core attention (megatron/sdpa_attention.py) against attention written out by hand, in
Megatron's layouts, on CPU: grouped-query heads, the causal mask, Megatron's boolean masks."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.backends.megatron.sdpa_attention import sdpa


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor,
          scale: float) -> torch.Tensor:
    """[s, b, h, d] inputs (k, v with groups), masked [b, 1, sq, sk] True = blocked."""
    sq, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(masked, -math.inf)
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(sq, b, h * d)


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (8, 2), (6, 1)])
def test_causal_gqa_matches_by_hand(heads: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(0)
    s, b, d = 7, 3, 16
    q = torch.randn(s, b, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, groups, d, generator=gen, dtype=torch.float64)
    v = torch.randn(s, b, groups, d, generator=gen, dtype=torch.float64)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    want = naive(q, k, v, causal, 1 / math.sqrt(d))
    torch.testing.assert_close(sdpa(q, k, v, None, causal=True), want)  # no mask tensor
    torch.testing.assert_close(sdpa(q, k, v, causal, causal=True), want)  # Megatron's mask


def test_padding_mask_and_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    s, b, h, d = 5, 2, 4, 8
    q, k, v = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    blocked = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None].repeat(
        b, 1, 1, 1)
    blocked[1, :, :, 3:] = True   # row 1: its last two keys are padding
    blocked[1, :, :, 0] = False   # (keep one key visible to every query)
    want = naive(q, k, v, blocked, 0.25)
    torch.testing.assert_close(sdpa(q, k, v, blocked, causal=True, scale=0.25), want)


def test_rejects_heads_that_do_not_split_into_groups() -> None:
    q, kv = torch.zeros(3, 1, 6, 4), torch.zeros(3, 1, 4, 4)
    with pytest.raises(ValueError, match="6 query heads"):
        sdpa(q, kv, kv, None, causal=True)
