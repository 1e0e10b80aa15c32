"""Packed micro-batches (backends/micro_batches.py): the token budget, splitting to a count
the busiest FSDP rank needs, and the rows and packed tokens each micro-batch carries."""

from __future__ import annotations

import random

import pytest
import torch

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.micro_batches import micro_batches, split_bins, token_budget
from kuberl_trainer.backends.packing import pack_bins


def test_the_budget_defaults_to_micro_batch_size_rows_of_the_longest_sample() -> None:
    assert token_budget([3, 9, 4], 2, None) == 18
    assert token_budget([3, 9, 4], 2, 40) == 40
    assert token_budget([], 2, None) == 2


def micro_bins(lengths: list[int], budget: int, at_least: int = 0) -> list[list[int]]:
    return split_bins(pack_bins(lengths, budget), lengths, at_least)


def test_bins_by_hand() -> None:
    # First-fit decreasing under 10 tokens: 9 alone, 6 + 4 fill a bin, 3 + 3 + 2 share the
    # last; bins listed by their first sample.
    assert micro_bins([3, 9, 4, 6, 3, 2], 10) == [[0, 4, 5], [1], [2, 3]]


def test_splitting_reaches_the_count_and_never_grows_a_bin() -> None:
    lengths = [3, 9, 4, 6, 3, 2]
    # 4 bins: the three-sample bin [0, 4, 5] (3, 3, 2 tokens) is halved, its longest samples
    # dealt apart.
    assert micro_bins(lengths, 10, at_least=4) == [[0, 5], [4], [1], [2, 3]]
    # More bins than samples cannot be made: one sample each.
    assert sorted(map(sorted, micro_bins(lengths, 10, at_least=9))) == [[i] for i in range(6)]


def test_random_bins_cover_every_sample_once_under_the_budget() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(max(lengths), 200)
        at_least = rng.randint(0, 40)
        bins = micro_bins(lengths, budget, at_least)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in bins)
        assert len(bins) >= min(at_least, len(lengths))
        if at_least <= len(micro_bins(lengths, budget)):
            assert bins == micro_bins(lengths, budget)  # no split asked for: none made


def test_a_sample_over_the_budget_runs_alone() -> None:
    assert micro_bins([5, 30, 5], 10) == [[0, 2], [1]]


def batch_of(lengths: list[int], width: int) -> TrainBatch:
    n = len(lengths)
    ids = torch.arange(n * width).reshape(n, width) + 100
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    zeros = torch.zeros(n, width)
    return TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.float(),
                      advantages=zeros, rollout_logprobs=zeros.clone(),
                      old_logprobs=torch.arange(n * width, dtype=torch.float).reshape(n, width))


def test_micro_batches_carry_their_rows_trimmed_and_packed() -> None:
    lengths, width = [3, 9, 4, 6, 3, 2], 12
    batch = batch_of(lengths, width)
    micros = micro_batches(batch, micro_batch_size=1, max_tokens=10, sft=True)
    assert [m.rows.tolist() for m in micros] == [[0, 4, 5], [1], [2, 3]]
    for m in micros:
        rows = m.rows.tolist()
        longest = max(lengths[r] for r in rows)
        assert m.sft and m.batch.input_ids.shape == (len(rows), longest)
        assert torch.equal(m.batch.old_logprobs, batch.old_logprobs[rows, :longest])
        real = torch.cat([batch.input_ids[r, :lengths[r]] for r in rows])
        assert torch.equal(m.packed.input_ids[0], real)
        assert m.packed.cu_seqlens.tolist() == [0, *torch.tensor(
            [lengths[r] for r in rows]).cumsum(0).tolist()]
    # The default budget: microBatchSize (2) rows of the longest sample (9), 18 tokens:
    # 9 + 6 + 3 and 4 + 3 + 2.
    assert [m.rows.tolist() for m in micro_batches(batch, micro_batch_size=2)] == [
        [0, 1, 3], [2, 4, 5]]


def test_an_empty_batch_has_no_micro_batches() -> None:
    assert micro_batches(batch_of([1], 4).slice(0, 0), micro_batch_size=2) == []


@pytest.mark.parametrize("agreed", [4, 6])
def test_micro_batches_split_to_the_count_the_ranks_agree_on(agreed: int) -> None:
    asked: list[int] = []

    def agree(own: int) -> int:
        asked.append(own)
        return agreed

    micros = micro_batches(batch_of([3, 9, 4, 6, 3, 2], 12), micro_batch_size=1,
                           max_tokens=10, agree=agree)
    assert asked == [3]  # this rank's own count, asked once
    assert len(micros) == agreed
    assert sorted(r for m in micros for r in m.rows.tolist()) == list(range(6))
