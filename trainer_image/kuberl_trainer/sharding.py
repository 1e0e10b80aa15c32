"""Which training worker gets which samples, and whose answers the driver reads. Pure.

Each worker reports ``(data-parallel rank, data-parallel size, reports)``
(``Backend.data_parallel_coords``). Every worker of one data-parallel rank gets the same rows
of a batch (Megatron's TP and PP ranks of one replica compute on the same samples); results
come from one reporting worker per data-parallel rank and are put back in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.packing import step_shards

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallelLayout:
    """``coords``: each worker's ``(dp_rank, dp_size, reports)``, in worker order.
    ``balance``: deal each global batch (``step_size`` samples) by token counts
    (``packing.step_shards``) rather than in contiguous blocks."""

    coords: tuple[tuple[int, int, bool], ...]
    step_size: int
    balance: bool = False

    def __post_init__(self) -> None:
        sizes = {size for _, size, _ in self.coords}
        if len(sizes) != 1:
            raise ValueError(f"workers disagree on the data-parallel size: {sorted(sizes)}")
        ranks = sorted(rank for rank, _, reports in self.coords if reports)
        if ranks != list(range(self.dp_size)):
            raise ValueError(f"need one reporting worker per data-parallel rank "
                             f"0..{self.dp_size - 1}, got ranks {ranks}")

    @property
    def dp_size(self) -> int:
        return self.coords[0][1]

    @property
    def reporters(self) -> list[int]:
        """The reporting workers, in data-parallel rank order."""
        return sorted((i for i, c in enumerate(self.coords) if c[2]),
                      key=lambda i: self.coords[i][0])

    def rows(self, batch: TrainBatch) -> list[list[int]]:
        """The batch's rows each data-parallel rank trains on."""
        if not self.balance:
            batch.split(self.dp_size)  # raises with the reason when it does not divide
            size = len(batch) // self.dp_size
            return [list(range(r * size, (r + 1) * size)) for r in range(self.dp_size)]
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return step_shards(lengths, self.dp_size, self.step_size)

    def per_worker(self, by_rank: Sequence[T]) -> list[T]:
        """One item per data-parallel rank -> one per worker (its rank's)."""
        return [by_rank[rank] for rank, _, _ in self.coords]

    def shards(self, batch: TrainBatch) -> tuple[list[list[int]], list[TrainBatch]]:
        """``(rows per data-parallel rank, each worker's shard)``."""
        rows = self.rows(batch)
        return rows, self.per_worker([batch.select(r) for r in rows])

    def reported(self, results: Sequence[T]) -> list[T]:
        """The reporting workers' results, in data-parallel rank order."""
        return [results[i] for i in self.reporters]

    def gather(self, results: Sequence[Tensor], rows: list[list[int]],
               shape: Sequence[int]) -> Tensor:
        """Per-row results ``[len(rows[r]), ...]`` of the reporting workers back into one
        ``shape`` tensor in batch order."""
        out = torch.zeros(tuple(shape), dtype=torch.float32)
        for i in self.reporters:
            out[torch.tensor(rows[self.coords[i][0]])] = results[i].to(out.dtype)
        return out
