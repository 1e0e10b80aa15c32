"""The running batch's KV cache: sequences of different lengths, left-padded to one width.

Continuous batching (batcher.py) needs a cache that rows can join and leave between decode
steps. HF transformers' DynamicCache holds one tensor per layer, [batch, heads, width, dim],
so rows of different lengths share it left-padded, with a 0/1 attention mask over the width
and per-row position ids (the count of real tokens before each one); padded positions are
masked out of attention, so a row's numbers are its own up to float rounding.

- a newcomer is prefilled on its own (with the other newcomers) and its cache merged in: the
  narrower of the two caches is left-padded to the other's width, then they are concatenated
  along the batch;
- a finished row leaves by index selection, and the columns that were padding for every row
  left are dropped, so the width stays the longest row's length rather than growing with the
  time the batch has been running.

Only caches whose every layer is a plain `DynamicLayer` can be merged or trimmed this way (a
sliding-window layer keeps the last W entries of each row, which padding would shift):
`joinable` tells; the engine then admits requests only into an empty batch, and rows leave it
without trimming.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def joinable(cache: DynamicCache) -> bool:
    """Whether rows can be merged into and selected out of caches like this one."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def prefill_inputs(prefixes: Sequence[Sequence[int]], pad_id: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, W] and the 0/1 mask of their real tokens."""
    width = max(len(p) for p in prefixes)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prefixes],
                       dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes],
                        dtype=torch.long, device=device)
    return ids, mask


def model_mask(mask: torch.Tensor, padded: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The attention mask and position ids to pass the model: None, None when nothing is
    padded, since the model's defaults (causal attention, positions counted from the cache's
    width) are then the same numbers, computed faster and exactly as a request alone gets
    them."""
    if not padded:
        return None, None
    return mask, (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class PaddedCache:
    """A DynamicCache of left-padded rows, the mask of their real entries and, on the host
    (so that no step waits on the device to know), each row's count of them."""

    cache: DynamicCache
    mask: torch.Tensor  # [B, width] long, 1 where the cache holds a real token
    lengths: list[int]  # per row: the real tokens in the cache

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @property
    def padded(self) -> bool:
        return any(n != self.width for n in self.lengths)

    def decode_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Mask and position ids for one new token per row (counted in from now on)."""
        positions = self.lengths
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.lengths = [n + 1 for n in self.lengths]
        if not self.padded:
            return None, None
        return self.mask, torch.tensor(positions, dtype=torch.long,
                                       device=self.mask.device)[:, None]

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), then drop the leading columns that are padding
        in every row left."""
        if len(rows) == len(self.lengths):
            return
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.lengths = [self.lengths[i] for i in rows]
        first = self.width - max(self.lengths, default=self.width)
        # (a sliding-window layer holds only its window: the mask stays as wide as the
        # sequence, as HF's masks for such layers expect, and nothing is trimmed)
        if first > 0 and joinable(self.cache):
            for layer in _layers(self.cache):
                keys, values = _kv(layer)
                layer.keys, layer.values = keys[:, :, first:, :], values[:, :, first:, :]
            self.mask = self.mask[:, first:]

    def merge(self, other: PaddedCache) -> None:
        """Append `other`'s rows after these, both left-padded to the wider width."""
        width = max(self.width, other.width)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            (k1, v1), (k2, v2) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_left_pad(k1, width), _left_pad(k2, width)])
            mine.values = torch.cat([_left_pad(v1, width), _left_pad(v2, width)])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(other.mask, width)])
        self.lengths += other.lengths


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    return cast(list[DynamicLayer], list(cache.layers))  # (joinable: plain DynamicLayers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None  # (filled by a prefill)
    return layer.keys, layer.values


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros before the sequence axis (dim 2 of a cache tensor, dim 1 of a mask)."""
    missing = width - t.shape[-2 if t.dim() == 4 else -1]
    if missing == 0:
        return t
    if t.dim() == 4:
        return F.pad(t, (0, 0, missing, 0))
    return F.pad(t, (missing, 0))
