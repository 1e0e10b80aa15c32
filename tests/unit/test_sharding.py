"""Which training worker gets which samples, and whose answers are read (sharding.py): the
driver's side of the data-parallel layout, for fsdp (every rank a replica) and megatron (TP
and PP ranks share a replica's samples)."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.sharding import DataParallelLayout


def batch(lengths: list[int]) -> TrainBatch:
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.arange(len(lengths))[:, None].expand(-1, width) * mask  # row i holds i
    zeros = torch.zeros(len(lengths), width)
    return TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.float(),
                      advantages=zeros, rollout_logprobs=zeros)


# Megatron tp=2 x dp=2: workers 0,1 are replica 0 (worker 0 reports), 2,3 replica 1.
TP2_DP2 = ((0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False))


def test_fsdp_layout_is_contiguous_blocks_one_per_worker() -> None:
    layout = DataParallelLayout(((0, 2, True), (1, 2, True)), step_size=4)
    rows, shards = layout.shards(batch([3, 3, 3, 3]))
    assert rows == [[0, 1], [2, 3]]
    assert [s.input_ids[:, 0].tolist() for s in shards] == [[0, 1], [2, 3]]


def test_model_parallel_ranks_of_a_replica_get_the_same_balanced_rows() -> None:
    layout = DataParallelLayout(TP2_DP2, step_size=4, balance=True)
    b = batch([9, 1, 8, 2, 5, 5, 1, 9])
    rows, shards = layout.shards(b)
    assert rows == [[0, 1, 6, 7], [2, 3, 4, 5]]  # each step's 4 balanced: 10 tokens a side
    assert [s.input_ids[:, 0].tolist() for s in shards] == [[0, 1, 6, 7], [0, 1, 6, 7],
                                                             [2, 3, 4, 5], [2, 3, 4, 5]]
    assert layout.reporters == [0, 2]
    assert layout.reported(["a", "b", "c", "d"]) == ["a", "c"]


def test_gather_puts_the_reporters_rows_back_in_batch_order() -> None:
    layout = DataParallelLayout(TP2_DP2, step_size=4, balance=True)
    b = batch([9, 1, 8, 2, 5, 5, 1, 9])
    rows, shards = layout.shards(b)
    # each worker answers with its shard's ids; non-reporters answer nothing useful
    answers = [s.input_ids.float() if rep else torch.empty(0)
               for s, (_, _, rep) in zip(shards, TP2_DP2, strict=True)]
    assert torch.equal(layout.gather(answers, rows, b.input_ids.shape), b.input_ids.float())


@pytest.mark.parametrize(("coords", "words"), [
    (((0, 2, True), (0, 1, True)), "disagree on the data-parallel size"),
    (((0, 2, True), (1, 2, False)), "one reporting worker per data-parallel rank"),
    (((0, 2, True), (0, 2, True)), "one reporting worker per data-parallel rank"),
])
def test_inconsistent_coordinates_are_refused(coords: tuple[tuple[int, int, bool], ...],
                                              words: str) -> None:
    with pytest.raises(ValueError, match=words):
        DataParallelLayout(coords, step_size=2)
