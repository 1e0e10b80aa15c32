"""A batch cut into packed micro-batches: the forward passes both backends run.

Each micro-batch is a bin of samples whose real tokens are concatenated into one row
(``backends/packing.py``): no padding is computed, and attention stays inside each sequence
(``backends/varlen_attention.py``). A bin holds at most a token budget:
``training.maxTokensPerMicroBatch`` when set, else ``microBatchSize`` times the batch's
longest sample (the work of one padded micro-batch of ``microBatchSize`` rows, without the
padding). A sample longer than the budget runs alone.

The budget bounds a forward pass's memory; it also decides how many passes a batch takes.
Under FSDP every pass is a collective (each layer's all-gather), so every rank must run as
many: ``agree`` turns a rank's own bin count into the count all run (the busiest rank's),
and bins are split until there are that many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.packing import Packed, PackedBin, pack_bins, pack_bins_to


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch: its samples (padded rows, trimmed to their longest) and the
    packed row the model runs on."""

    batch: TrainBatch
    bin: PackedBin      # its rows in the batch it was cut from and their packed form
    sft: bool = False   # demonstrations (the SFT term), not rollout samples

    @property
    def rows(self) -> Tensor:
        """The samples' rows in the batch it was cut from, on the batch's device."""
        return self.bin.rows

    @property
    def packed(self) -> Packed:
        return self.bin.packed


def token_budget(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None) -> int:
    """Tokens one micro-batch may hold (see the module docstring)."""
    return max_tokens or micro_batch_size * max(max(lengths, default=1), 1)


def split_bins(bins: list[list[int]], lengths: Sequence[int], at_least: int) -> list[list[int]]:
    """``bins`` (of sample indices, e.g. ``pack_bins``'s) split until there are ``at_least``
    where the samples allow (one sample a bin at most). A split halves the bin with the most
    samples (the first such bin on ties): no bin grows, so none exceeds the budget it met."""
    bins = [list(b) for b in bins]
    while len(bins) < min(at_least, len(lengths)):
        i = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        # Deal the samples, longest first, alternately to the halves: their token counts
        # stay close.
        dealt = sorted(bins[i], key=lambda r: (-lengths[r], r))
        bins[i:i + 1] = [sorted(dealt[0::2]), sorted(dealt[1::2])]
    return bins


def micro_batches(batch: TrainBatch, *, micro_batch_size: int, max_tokens: int | None = None,
                  agree: Callable[[int], int] | None = None,
                  sft: bool = False) -> list[MicroBatch]:
    """``batch`` cut into packed micro-batches (see the module docstring); ``agree``: this
    rank's bin count -> the count to run (a collective under FSDP2), None to keep its own.

    The layout is read on the host once and every micro-batch's indices go to the batch's
    device in one transfer (``pack_bins_to``): one host sync to build them all.
    """
    if len(batch) == 0:
        return []
    host = torch.stack([batch.input_ids, batch.attention_mask.to(batch.input_ids.dtype)]).cpu()
    ids, mask = host[0], host[1]
    lengths = [int(n) for n in mask.sum(dim=1).tolist()]
    bins = pack_bins(lengths, token_budget(lengths, micro_batch_size, max_tokens))
    if agree is not None:
        bins = split_bins(bins, lengths, agree(len(bins)))
    out = []
    for rows, made in zip(bins, pack_bins_to(ids, mask, bins, batch.input_ids.device),
                          strict=True):
        width = max(lengths[r] for r in rows)
        mb = batch.select(made.rows).map(lambda t, w=width: t[:, :w])
        out.append(MicroBatch(batch=mb, bin=made, sft=sft))
    return out
