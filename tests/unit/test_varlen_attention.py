"""Attention over packed sequences (backends/varlen_attention.py) on CPU: each sequence alone,
against attention written out by hand, and the adapter HF models call."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.backends.varlen_attention import (
    HF_ATTENTION,
    hf_varlen_attention,
    register_hf_attention,
    sdpa_packed,
)
from tests.unit.test_megatron_sdpa import naive


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (8, 2)])
def test_packed_sequences_attend_only_within_themselves(heads: int, groups: int) -> None:
    """Three sequences packed into one row give what each gives alone (causal, no padding),
    so nothing leaks across a boundary."""
    gen = torch.Generator().manual_seed(2)
    lengths, d = [5, 1, 7], 8
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q = torch.randn(13, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(13, groups, d, generator=gen, dtype=torch.float64)
    v = torch.randn(13, groups, d, generator=gen, dtype=torch.float64)
    got = sdpa_packed(q, k, v, cu, max(lengths))
    assert got.shape == (13, heads * d)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        s = b - a
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        alone = naive(q[a:b, None], k[a:b, None], v[a:b, None], causal, 1 / math.sqrt(d))
        torch.testing.assert_close(got[a:b], alone[:, 0])


def hf_inputs(heads: int = 4, groups: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(1, heads, 13, d, generator=gen),
            torch.randn(1, groups, 13, d, generator=gen),
            torch.randn(1, groups, 13, d, generator=gen))


def test_hf_adapter_is_sdpa_packed_in_hf_layouts() -> None:
    q, k, v = hf_inputs()
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    out, weights = hf_varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3,
                                       cu_seq_lens_q=cu, max_length_q=7)
    assert weights is None and out.shape == (1, 13, 4, 8)
    want = sdpa_packed(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, 7, scale=0.3)
    torch.testing.assert_close(out.reshape(13, 32), want)


def test_hf_adapter_computes_in_the_autocast_dtype() -> None:
    """RoPE's float32 tables make q and k float32 under autocast; the flash kernel takes
    bf16 only, so the adapter casts to autocast's dtype."""
    q, k, v = hf_inputs()
    cu = torch.tensor([0, 13], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf_varlen_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu,
                                     max_length_q=13)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(("kwargs", "words"), [
    ({}, "needs cu_seq_lens_q"),
    ({"attention_mask": torch.ones(1, 1, 13, 13, dtype=torch.bool)}, "no attention mask"),
    ({"sliding_window": 4}, "no sliding window"),
    ({"dropout": 0.1}, "no dropout"),
])
def test_hf_adapter_refuses_what_it_cannot_run(kwargs: dict[str, object], words: str) -> None:
    q, k, v = hf_inputs()
    if kwargs:
        kwargs = {"cu_seq_lens_q": torch.tensor([0, 13], dtype=torch.int32),
                  "max_length_q": 13, **kwargs}
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(ValueError, match=words):
        hf_varlen_attention(torch.nn.Module(), q, k, v, mask, **kwargs)  # type: ignore[arg-type]


def test_registered_with_transformers() -> None:
    from transformers import AttentionInterface

    assert register_hf_attention() == HF_ATTENTION
    assert AttentionInterface._global_mapping[HF_ATTENTION] is hf_varlen_attention
