"""Vocab-parallel log-probs and entropy (megatron/vocab_parallel.py): one process against
torch's full softmax, then two gloo ranks holding half the vocabulary each, values and
gradients compared with the single-process computation."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kuberl_trainer.megatron.vocab_parallel import token_logprobs_and_entropy

W_LOGP, W_ENT = 0.7, -1.3  # fixed loss weights: loss = (logp * W_LOGP + entropy * W_ENT).sum()


def full(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: torch's log_softmax over the real columns."""
    real = logits.float()[..., :vocab_size]
    logp = torch.log_softmax(real, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def loss(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    return (logp * W_LOGP + entropy * W_ENT).sum()


def test_hand_computed_two_token_vocabulary() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([1]), vocab_start=0)
    assert logp.dtype == entropy.dtype == torch.float32
    assert logp.item() == pytest.approx(math.log(3 / 4))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_the_full_softmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4 + 100).to(dtype)  # large: needs the shift
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    logp, entropy = token_logprobs_and_entropy(logits, targets, vocab_start=0)
    want_logp, want_entropy = full(logits, targets)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy)


def test_padding_columns_take_no_mass() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=gen)
    logits[:, 6:] = 50.0  # padded output rows with large logits must still count for nothing
    targets = torch.tensor([0, 5, 3, 1])
    logp, entropy = token_logprobs_and_entropy(logits, targets, vocab_start=0, vocab_size=6)
    want_logp, want_entropy = full(logits, targets, vocab_size=6)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy)


@pytest.mark.parametrize("vocab_size", [None, 7])
def test_gradients_match_the_full_computation(vocab_size: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(6, 10, generator=gen) * 3
    targets = torch.randint(0, 7, (6,), generator=gen)
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss(*token_logprobs_and_entropy(mine, targets, vocab_start=0,
                                     vocab_size=vocab_size)).backward()
    loss(*full(ref, targets, vocab_size)).backward()
    assert mine.grad is not None and ref.grad is not None
    assert torch.isfinite(mine.grad).all()
    torch.testing.assert_close(mine.grad, ref.grad)
    if vocab_size is not None:
        assert not mine.grad[:, vocab_size:].any()


def test_rejects_a_slice_without_a_group() -> None:
    logits, targets = torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_start"):
        token_logprobs_and_entropy(logits, targets, vocab_start=4)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(logits, targets[:1], vocab_start=0)


# -- two ranks over gloo ---------------------------------------------------------------------

V = 8  # padded vocabulary; each rank holds V // 2 columns
# (name, real vocabulary size): all real; rank 1 partly padding; rank 1 only padding.
CASES: list[tuple[str, int | None]] = [("full", None), ("padded", 6), ("rank1_padding", 3)]


def case_inputs(vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, V, generator=gen) * 3
    logits[..., vocab_size or V:] = 40.0  # padding logits that would dominate if not masked
    # Targets on both halves where the real vocabulary has them (ids 0..3 rank 0, 4..7 rank 1).
    targets = torch.tensor([[0, 4, 3, 5, 1], [2, 5, 0, 4, 3]]) % (vocab_size or V)
    return logits, targets


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        half = V // 2
        results = {}
        for name, vocab_size in CASES:
            logits, targets = case_inputs(vocab_size)
            shard = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_()
            logp, entropy = token_logprobs_and_entropy(
                shard, targets, vocab_start=rank * half, group=dist.group.WORLD,
                vocab_size=vocab_size)
            loss(logp, entropy).backward()  # the same loss on every TP rank
            results[name] = (logp.detach(), entropy.detach(), shard.grad)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_the_vocabulary(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name, vocab_size in CASES:
        logits, targets = case_inputs(vocab_size)
        ref = logits.clone().requires_grad_()
        want_logp, want_entropy = full(ref, targets, vocab_size)
        loss(want_logp, want_entropy).backward()
        assert ref.grad is not None
        grads = []
        for result in ranks:
            logp, entropy, grad = result[name]
            torch.testing.assert_close(logp, want_logp.detach(), msg=name)
            torch.testing.assert_close(entropy, want_entropy.detach(), msg=name)
            grads.append(grad)
        # Each rank's gradient is its column slice of the full one (not tp times it).
        torch.testing.assert_close(torch.cat(grads, dim=-1), ref.grad, msg=name)
