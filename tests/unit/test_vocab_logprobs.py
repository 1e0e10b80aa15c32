"""Log-probs and entropy over the vocabulary (backends/vocab_logprobs.py): one process against
torch's full float32 softmax (values, gradients, temperature, chunking, bf16, what is kept for
backward), then two gloo ranks holding half the vocabulary each, compared with the
single-process computation."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kuberl_trainer.backends import vocab_logprobs
from kuberl_trainer.backends.vocab_logprobs import (
    token_logprobs_and_entropy,
)

W_LOGP, W_ENT = 0.7, -1.3  # fixed loss weights: loss = (logp * W_LOGP + entropy * W_ENT).sum()


def full(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None,
         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: torch's log_softmax over the real columns."""
    real = logits.float()[..., :vocab_size] / temperature
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
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, temperature=0.0)


def test_hand_computed_temperature() -> None:
    # logits (0, 2 ln 3) at T=2 are (0, ln 3): p = (1/4, 3/4), as at T=1 above.
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([0]), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(1 / 4))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


@pytest.mark.parametrize("chunk_elements", [1, 23, 1 << 24])
def test_chunks_of_rows_change_nothing(monkeypatch: pytest.MonkeyPatch,
                                       chunk_elements: int) -> None:
    """Values and gradients are the same however the rows are cut (one row a chunk, chunks
    that split the batch unevenly, one chunk), at a temperature, with padding columns."""
    monkeypatch.setattr(vocab_logprobs, "EAGER_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3, 7, 12, generator=gen) * 3
    targets = torch.randint(0, 10, (3, 7), generator=gen)
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = token_logprobs_and_entropy(mine, targets, vocab_size=10, temperature=0.7)
    want = full(ref, targets, vocab_size=10, temperature=0.7)
    loss(*got).backward()
    loss(*want).backward()
    torch.testing.assert_close(got, want)
    assert mine.grad is not None and ref.grad is not None
    torch.testing.assert_close(mine.grad, ref.grad)


def test_bf16_logits_get_a_bf16_gradient_of_the_float32_computation() -> None:
    gen = torch.Generator().manual_seed(4)
    base = (torch.randn(16, 50, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (16,), generator=gen)
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = token_logprobs_and_entropy(mine, targets)
    want = full(ref, targets)  # float32 from the same bf16 values
    torch.testing.assert_close(got, want)
    loss(*got).backward()
    loss(*want).backward()
    assert mine.grad is not None and ref.grad is not None
    assert mine.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine.grad, ref.grad)  # both rounded once to bf16


@pytest.mark.parametrize("chunk_elements", [1 << 30, 40 * 300])
def test_the_compiled_kernels_compute_what_the_eager_ones_do(
        monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """The CUDA path's kernels (torch.compile; Inductor builds them for the CPU here, so the
    compiled code path runs without a GPU): one chunk, and chunks of 40 rows plus a last one
    of 17, with padding columns, temperature, bf16 logits and both gradients."""
    kernels = vocab_logprobs._compiled(torch.device("cpu"))
    assert kernels is not None, "the probe failed: see the warning logged"
    monkeypatch.setattr(vocab_logprobs, "COMPILED_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(vocab_logprobs, "_kernels",
                        lambda _: (kernels, vocab_logprobs.COMPILED_CHUNK_ELEMENTS))
    gen = torch.Generator().manual_seed(8)
    base = (torch.randn(97, 300, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 280, (97,), generator=gen)
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = token_logprobs_and_entropy(mine, targets, vocab_size=280, temperature=0.8)
    want = full(ref, targets, vocab_size=280, temperature=0.8)
    torch.testing.assert_close(got, want)
    loss(*got).backward()
    loss(*want).backward()
    assert mine.grad is not None and ref.grad is not None
    assert mine.grad.dtype == torch.bfloat16 and not mine.grad[:, 280:].any()
    torch.testing.assert_close(mine.grad, ref.grad)
    # The policy loss without an entropy bonus: the kernel skips the entropy term.
    mine.grad = ref.grad = None
    logp, entropy = token_logprobs_and_entropy(mine, targets, vocab_size=280, temperature=0.8)
    (logp.sum() + entropy.detach().sum()).backward()
    full(ref, targets, vocab_size=280, temperature=0.8)[0].sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad)


def test_an_unused_entropy_needs_no_gradient() -> None:
    """The policy loss without an entropy bonus backpropagates log-probs alone (the entropy
    is a metric), and gets the log-prob gradient exactly."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(4, 9, generator=gen)
    targets = torch.randint(0, 9, (4,), generator=gen)
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    logp, entropy = token_logprobs_and_entropy(mine, targets)
    (logp.sum() + entropy.detach().sum()).backward()
    full(ref, targets)[0].sum().backward()
    assert mine.grad is not None and ref.grad is not None
    torch.testing.assert_close(mine.grad, ref.grad)


def test_backward_keeps_no_float32_copy_of_the_logits() -> None:
    """What autograd keeps: the bf16 logits themselves and a few floats a row, nothing of
    [rows, vocab] in float32 (issue 17: that copy cost 0.6 MB a token at Qwen's vocabulary)."""
    rows, vocab = 32, 1000
    logits = torch.randn(rows, vocab).to(torch.bfloat16).requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp, entropy = token_logprobs_and_entropy(logits, torch.zeros(rows, dtype=torch.long))
        (logp + entropy).sum().backward()
    big = [t for t in saved if t.numel() >= rows * vocab]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [
        (t.dtype, tuple(t.shape)) for t in saved]
    assert sum(t.numel() for t in saved if t.numel() < rows * vocab) <= 8 * rows


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
