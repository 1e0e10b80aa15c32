"""Sequence packing and data-parallel balancing (backends/packing.py): partitions computed by
hand, invariants over random lengths, the packed <-> padded round trip, and the next-token
shift inside sequence boundaries checked against the padded log-prob convention."""

from __future__ import annotations

import random

import pytest
import torch

from kuberl_trainer.backends.packing import (
    align_to_tokens,
    balanced_partition,
    next_token_targets,
    pack_bins,
    pack_bins_to,
    pack_rows,
    to_rows,
    unpack,
)

# -- balanced_partition ----------------------------------------------------------------------


def test_balanced_partition_by_hand() -> None:
    # Longest first: 0 (5) -> g0; 2 (4) -> g1; 3 (2) -> g1 (4 < 5), now full; 1 (1) -> g0.
    assert balanced_partition([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]
    # 8 -> g0, 7 -> g1, 6 -> g2, 5 -> g2 (6), 4 -> g1 (7), 3 -> g0: every sum 11.
    assert balanced_partition([8, 7, 6, 5, 4, 3], 3) == [[0, 5], [1, 4], [2, 3]]
    # Ties in length go by index, ties in sum to the lowest group.
    assert balanced_partition([2, 2, 2, 2], 2) == [[0, 2], [1, 3]]
    assert balanced_partition([3, 1, 2], 1) == [[0, 1, 2]]
    assert balanced_partition([], 4) == [[], [], [], []]


@pytest.mark.parametrize(("n", "parts"), [(5, 2), (3, 0), (4, -1)])
def test_balanced_partition_rejects_uneven_counts(n: int, parts: int) -> None:
    with pytest.raises(ValueError, match=str(parts)):
        balanced_partition([1] * n, parts)


def test_balanced_partition_invariants_over_random_lengths() -> None:
    rng = random.Random(0)
    for _ in range(200):
        parts = rng.randint(1, 6)
        lengths = [rng.randint(1, 500) for _ in range(parts * rng.randint(1, 8))]
        groups = balanced_partition(lengths, parts)
        assert len(groups) == parts
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert {len(g) for g in groups} == {len(lengths) // parts}
        assert all(g == sorted(g) for g in groups)
        assert groups == balanced_partition(list(lengths), parts)  # deterministic


def test_balanced_partition_beats_a_contiguous_split_on_skewed_lengths() -> None:
    # Long samples first (e.g. a batch sorted by prompt): a contiguous split puts them on one rank.
    lengths = [1000, 900, 800, 700, 60, 50, 40, 30, 20, 10, 5, 1]
    parts = 4
    per = len(lengths) // parts

    def spread(groups: list[list[int]]) -> int:
        sums = [sum(lengths[i] for i in g) for g in groups]
        return max(sums) - min(sums)

    contiguous = [list(range(p * per, (p + 1) * per)) for p in range(parts)]
    greedy = balanced_partition(lengths, parts)
    assert spread(greedy) <= spread(contiguous)
    assert spread(greedy) < 400 < spread(contiguous)


# -- pack_bins -------------------------------------------------------------------------------


def test_pack_bins_by_hand() -> None:
    # Decreasing: 4 (9) -> A; 1 (7) -> B; 3 (5) -> C; 5 (4) -> C (9); 0 (3) -> B (10);
    # 2 (2) fits nowhere -> D. Ordered by first index.
    assert pack_bins([3, 7, 2, 5, 9, 4], 10) == [[0, 1], [2], [3, 5], [4]]
    # Oversize samples get bins of their own; one exactly at the budget fits alone.
    assert pack_bins([12, 3, 10, 11, 4], 10) == [[0], [1, 4], [2], [3]]
    assert pack_bins([], 5) == []


@pytest.mark.parametrize("budget", [0, -3])
def test_pack_bins_rejects_a_budget_below_one(budget: int) -> None:
    with pytest.raises(ValueError, match="budget"):
        pack_bins([1, 2], budget)


def test_pack_bins_invariants_over_random_lengths() -> None:
    rng = random.Random(1)
    for _ in range(200):
        budget = rng.randint(1, 300)
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(0, 30))]
        bins = pack_bins(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for b in bins:
            assert b == sorted(b)
            assert sum(lengths[i] for i in b) <= budget or (
                len(b) == 1 and lengths[b[0]] > budget)
        assert [b[0] for b in bins] == sorted(b[0] for b in bins)
        assert bins == pack_bins(list(lengths), budget)


# -- pack_rows / unpack ----------------------------------------------------------------------


def padded(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random rows; padding holds junk ids so the round trip must mask it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def test_pack_rows_by_hand() -> None:
    ids = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 33, 34]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 31, 32, 33, 34]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert packed.max_seqlen == 4
    assert packed.lengths == [3, 1, 4]
    assert packed.tokens == 8


def test_pack_bins_to_packs_each_bin_of_the_batch_by_hand() -> None:
    ids = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 33, 34]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    first, second = pack_bins_to(ids, mask, [[0, 2], [1]], "cpu")
    assert first.rows.tolist() == [0, 2] and second.rows.tolist() == [1]
    assert first.packed.input_ids.tolist() == [[11, 12, 13, 31, 32, 33, 34]]
    assert first.packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert first.packed.cu_seqlens.dtype == torch.int32
    assert first.packed.cu_seqlens.tolist() == first.cu_seqlens_cpu.tolist() == [0, 3, 7]
    assert (first.packed.max_seqlen, first.packed.lengths) == (4, [3, 4])
    assert second.packed.input_ids.tolist() == [[21]]
    assert second.packed.cu_seqlens.tolist() == [0, 1]
    assert pack_bins_to(ids, mask, [], "cpu") == []


def test_pack_bins_to_matches_pack_rows_on_random_bins() -> None:
    lengths = [random.Random(3).randint(1, 30) for _ in range(17)]
    ids, mask = padded(lengths, 32, seed=3)
    bins = pack_bins(lengths, 64)
    for rows, made in zip(bins, pack_bins_to(ids, mask, bins, "cpu"), strict=True):
        want = pack_rows(ids[rows], mask[rows])
        assert made.rows.tolist() == rows
        for field in ("input_ids", "position_ids", "cu_seqlens"):
            got, ref = getattr(made.packed, field), getattr(want, field)
            assert got.dtype == ref.dtype and torch.equal(got, ref), field
        assert (made.packed.max_seqlen, made.packed.lengths) == (want.max_seqlen, want.lengths)


def test_pack_bins_to_checks_its_input() -> None:
    ids, mask = padded([2, 3], 4)
    with pytest.raises(ValueError, match="row 0"):  # row 1 of the batch, row 0 of its bin
        pack_bins_to(ids, torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]), [[0], [1]], "cpu")
    with pytest.raises(ValueError, match="CPU tensors"):
        pack_bins_to(ids.to("meta"), mask, [[0]], "cpu")


@pytest.mark.parametrize(("mask", "row"), [
    ([[1, 1, 0], [1, 0, 1]], "row 1"),  # a hole
    ([[0, 1, 1], [1, 1, 1]], "row 0"),  # left padding
    ([[1, 1, 1], [0, 0, 0]], "row 1"),  # empty
])
def test_pack_rows_rejects_masks_that_are_not_a_prefix(mask: list[list[int]], row: str) -> None:
    with pytest.raises(ValueError, match=row):
        pack_rows(torch.ones(2, 3, dtype=torch.long), torch.tensor(mask))


def test_round_trip_is_the_masked_padded_input() -> None:
    rng = random.Random(2)
    for seed in range(20):
        width = rng.randint(1, 12)
        lengths = [rng.randint(1, width) for _ in range(rng.randint(1, 6))]
        ids, mask = padded(lengths, width, seed)
        packed = pack_rows(ids, mask)
        assert packed.tokens == sum(lengths)
        assert torch.equal(unpack(packed.input_ids, packed, width), ids * mask)
        assert torch.equal(unpack(packed.input_ids[0], packed, width + 3)[:, :width], ids * mask)
        values = torch.randn(packed.tokens, dtype=torch.float64)
        back = unpack(values, packed, width)
        assert back.dtype == torch.float64
        assert torch.equal(back[mask.bool()], values)  # row-major order is packed order


def test_unpack_rejects_a_width_shorter_than_a_sequence() -> None:
    packed = pack_rows(*padded([2, 5], 5))
    with pytest.raises(ValueError, match="width 4"):
        unpack(torch.zeros(7), packed, 4)
    with pytest.raises(ValueError, match="N = 7"):
        unpack(torch.zeros(6), packed, 5)


# -- the next-token shift --------------------------------------------------------------------


def test_next_token_targets_and_alignment_by_hand() -> None:
    ids = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 33, 34]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask)
    targets, valid = next_token_targets(packed)
    assert targets.tolist() == [12, 13, 0, 0, 32, 33, 34, 0]
    assert valid.tolist() == [True, True, False, False, True, True, True, False]

    per_position = torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8])  # value j is about token j + 1
    aligned = align_to_tokens(per_position, packed)
    assert aligned.tolist() == [0.0, 1, 2, 0, 0, 5, 6, 7]
    assert align_to_tokens(per_position[None], packed).tolist() == [[0.0, 1, 2, 0, 0, 5, 6, 7]]
    assert unpack(aligned, packed, 4).tolist() == [[0.0, 1, 2, 0], [0, 0, 0, 0], [0, 5, 6, 7]]


def test_packed_logprobs_match_the_padded_computation() -> None:
    """A per-token 'model' (embedding + linear) run packed and padded: the packed log-probs,
    shifted and unpacked, equal logp[:, t] = log_softmax(logits[:, t-1])[input_ids[:, t]]."""
    torch.manual_seed(3)
    vocab, hidden, width = 50, 8, 9
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
    lengths = [9, 1, 4, 7, 2]
    ids, mask = padded(lengths, width, seed=3)
    packed = pack_rows(ids, mask)

    logits = head(embed(packed.input_ids[0]))  # [N, V]
    targets, valid = next_token_targets(packed)
    per_position = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    # to_rows drops what `valid` marks (each sequence's last position, a dummy target).
    got = to_rows(per_position, valid, packed, width)
    by_parts = unpack(align_to_tokens(per_position.masked_fill(~valid, 0.0), packed), packed,
                      width)
    torch.testing.assert_close(got, by_parts)

    padded_logp = torch.log_softmax(head(embed(ids)), -1)  # [b, T, V]
    want = torch.zeros(len(lengths), width)
    for r, n in enumerate(lengths):
        for t in range(1, n):
            want[r, t] = padded_logp[r, t - 1, ids[r, t]]
    torch.testing.assert_close(got, want)


def test_gradients_flow_through_align_and_unpack() -> None:
    packed = pack_rows(*padded([3, 1, 4], 5))
    weights = torch.arange(1.0, 16.0).reshape(3, 5)

    values = torch.randn(packed.tokens, requires_grad=True)
    (unpack(values, packed, 5) * weights).sum().backward()
    assert values.grad is not None
    # Each packed value gets the weight of its padded slot, nothing else.
    assert values.grad.tolist() == [1.0, 2, 3, 6, 11, 12, 13, 14]

    per_position = torch.randn(1, packed.tokens, requires_grad=True)
    (unpack(align_to_tokens(per_position, packed), packed, 5) * weights).sum().backward()
    assert per_position.grad is not None
    # Value j lands on slot j + 1 of its sequence; each sequence's last value goes nowhere.
    assert per_position.grad.tolist() == [[2.0, 3, 0, 0, 12, 13, 14, 0]]


def test_step_shards_balance_each_global_batch_in_step_order() -> None:
    """Two optimizer steps of 4 samples over 2 ranks: each step's 4 are balanced on their own
    (rank 0 gets its share of step 0, then of step 1), never mixing the steps."""
    from kuberl_trainer.backends.packing import step_shards

    lengths = [9, 1, 8, 2, 5, 5, 1, 9]
    # step 0 (9, 1, 8, 2): 9 -> rank 0, 8 -> rank 1, 2 -> rank 1, 1 -> rank 0: 10 tokens each.
    # step 1 (5, 5, 1, 9): 9 -> rank 0, 5 -> rank 1, 5 -> rank 1 (now full), 1 -> rank 0.
    assert step_shards(lengths, parts=2, step_size=4) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match="global batches of 3"):
        step_shards(lengths, parts=2, step_size=3)
