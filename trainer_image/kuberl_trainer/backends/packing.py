"""Sequence packing for both backends' micro-batches, and balancing samples across
data-parallel ranks. Pure torch.

RL batches mix short and long responses, so right-padding a micro-batch to its longest row
wastes most of the compute on padding. Packing instead concatenates the real tokens of every
row into one ``[1, N]`` row; ``cu_seqlens`` (cumulative sequence lengths, as flash-attention and
Transformer Engine's THD format take them) keeps attention inside each sequence and
``position_ids`` restart at 0 so RoPE sees each sequence as if it were alone.

The trainer stores per-token values aligned to ``input_ids`` positions (see
``backends/tokens.py``): the value at ``t`` is about token ``t``, and a sequence's first token,
which nothing predicts, gets 0. In packed form the model's output at position ``j`` is about
token ``j + 1``, and position ``j + 1`` may already belong to the next sequence;
``next_token_targets`` and ``align_to_tokens`` do that shift inside sequence boundaries, and
``unpack`` returns to the padded ``[b, T]`` layout the losses use.

Balancing: every data-parallel rank runs the same number of micro-batches in lockstep (the
gradient all-reduce waits for the slowest), so ``balanced_partition`` gives each rank the same
number of samples with token counts as even as a greedy pass makes them, and ``pack_bins``
groups one rank's samples into micro-batches under a token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# -- partitioning ----------------------------------------------------------------------------


def _longest_first(lengths: Sequence[int]) -> list[int]:
    """Sample indices by length, longest first, ties by index (a stable order, so every rank
    computes the same partition from the same lengths)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split sample indices into ``parts`` groups of equal count with even token sums.

    Greedy, longest first: each sample goes to the group with the smallest token sum that
    still has room (ties to the lowest group index). Equal counts keep the number of samples
    (and so of micro-batches and loss-normalisation terms) the same on every rank.

    Returns:
        ``parts`` lists of indices into ``lengths``, each sorted ascending.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} samples do not split into {parts} equal parts")
    room = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in _longest_first(lengths):
        # min over (sum, index) picks the lowest index on ties.
        g = min((g for g in range(parts) if len(groups[g]) < room), key=lambda g: (sums[g], g))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(group) for group in groups]


def step_shards(lengths: Sequence[int], parts: int, step_size: int) -> list[list[int]]:
    """A rollout's samples dealt to ``parts`` data-parallel ranks, one optimizer step at a
    time: each consecutive ``step_size`` samples (one global batch) are balanced over the
    ranks (``balanced_partition``), and each rank's list holds its share of step 0, then of
    step 1, ..., the order in which a backend cuts its shard into optimizer steps.
    """
    if step_size < 1 or len(lengths) % step_size:
        raise ValueError(f"{len(lengths)} samples do not split into global batches of "
                         f"{step_size}")
    shards: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, len(lengths), step_size):
        groups = balanced_partition(lengths[start:start + step_size], parts)
        for shard, group in zip(shards, groups, strict=True):
            shard += [start + i for i in group]
    return shards


def pack_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices whose lengths sum to at most ``budget``.

    A sample longer than ``budget`` gets a bin of its own (it cannot be split: a sequence's
    tokens attend to each other). Returns bins with ascending indices, ordered by their first
    index, so a packed micro-batch keeps the batch's sample order.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    bins: list[list[int]] = []
    sums: list[int] = []
    for i in _longest_first(lengths):
        n = lengths[i]
        fit = next((b for b in range(len(bins)) if sums[b] + n <= budget), None)
        if fit is None:  # includes n > budget: no bin has room, and none will join it
            bins.append([i])
            sums.append(n)
        else:
            bins[fit].append(i)
            sums[fit] += n
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


# -- packed rows -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """The real tokens of ``b`` right-padded rows, concatenated into one row."""

    input_ids: Tensor     # [1, N] long
    position_ids: Tensor  # [1, N], 0 .. length-1 within each sequence
    cu_seqlens: Tensor    # [b + 1] int32: 0, then cumulative lengths (sequence boundaries)
    max_seqlen: int
    lengths: list[int]

    @property
    def tokens(self) -> int:
        """N, the number of packed tokens."""
        return int(self.input_ids.shape[-1])


def pack_rows(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """Pack right-padded rows ``input_ids[b, T]``, ``attention_mask[b, T]`` (1 on a prefix of
    each row, 0 after). Raises ValueError on a row that is empty or not right-padded: packing
    keeps the masked-in tokens, so a hole in the mask would silently join two pieces."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must be the same [b, T] shape")
    mask = attention_mask.bool()
    b, width = mask.shape
    lengths = mask.sum(dim=1)
    columns = torch.arange(width, device=mask.device).expand(b, width)
    bad = (mask != (columns < lengths[:, None])).any(dim=1) | (lengths == 0)
    if bad.any():
        row = int(bad.nonzero()[0].item())
        raise ValueError(f"row {row}: attention_mask must be ones then zeros (right padding) "
                         f"with at least one token, got {attention_mask[row].tolist()}")
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    # Row-major boolean indexing keeps each row's tokens in order, rows one after another; a
    # prefix mask makes the kept column numbers exactly each token's position.
    return Packed(input_ids=input_ids[mask].unsqueeze(0),
                  position_ids=columns[mask].unsqueeze(0),
                  cu_seqlens=cu, max_seqlen=int(lengths.max().item()),
                  lengths=[int(n) for n in lengths.tolist()])


@dataclass(frozen=True)
class PackedBin:
    """One micro-batch: which rows of the batch it holds and their packed form."""

    rows: Tensor            # [b] long, on the target device: the samples' rows in the batch
    packed: Packed          # on the target device
    cu_seqlens_cpu: Tensor  # the same boundaries, on the host


def pack_bins_to(input_ids: Tensor, attention_mask: Tensor, bins: Sequence[Sequence[int]],
                 device: torch.device | str) -> list[PackedBin]:
    """Pack each bin's rows of the host tensors ``input_ids``/``attention_mask`` [B, T]
    (``pack_rows``), then move every bin's row index and packed tensors to ``device`` in one
    transfer. Packing reads lengths and masks on the host, and a copy from ordinary host
    memory to a GPU waits for the GPU's queue to drain: built on the GPU, or moved tensor by
    tensor, a step's micro-batches cost ~60 host syncs (measured on megatron 1.5B)."""
    if input_ids.device.type != "cpu" or attention_mask.device.type != "cpu":
        raise ValueError("pack_bins_to packs on the host: pass CPU tensors")
    indices = [torch.tensor(list(rows), dtype=torch.long) for rows in bins]
    packs = [pack_rows(input_ids.index_select(0, i), attention_mask.index_select(0, i))
             for i in indices]
    parts = [t for index, p in zip(indices, packs, strict=True)
             for t in (index, p.input_ids[0], p.position_ids[0], p.cu_seqlens.long())]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    target = torch.device(device)
    if target.type == "cuda":
        # Pinned memory lets the copy run without the host waiting for it.
        flat = flat.pin_memory().to(target, non_blocking=True)
    else:
        flat = flat.to(target)
    moved = iter(torch.split(flat, [t.numel() for t in parts]))
    out = []
    for p in packs:
        rows, ids, pos, cu = next(moved), next(moved), next(moved), next(moved)
        out.append(PackedBin(rows=rows, cu_seqlens_cpu=p.cu_seqlens, packed=Packed(
            input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0),
            cu_seqlens=cu.to(torch.int32), max_seqlen=p.max_seqlen, lengths=p.lengths)))
    return out


def _flat(values: Tensor, packed: Packed, what: str) -> Tensor:
    """``[N]`` or ``[1, N]`` -> ``[N]`` (a view, so autograd flows through)."""
    if values.dim() not in (1, 2) or values.numel() != packed.tokens or (
            values.dim() == 2 and values.shape[0] != 1):
        raise ValueError(f"{what} must be [N] or [1, N] with N = {packed.tokens}, "
                         f"got {tuple(values.shape)}")
    return values.reshape(-1)


def unpack(values: Tensor, packed: Packed, width: int) -> Tensor:
    """A per-packed-token tensor (``[N]`` or ``[1, N]``) -> ``[b, width]``, right-padded with
    zeros. Differentiable: the gradient of each packed value is that of its padded slot."""
    if width < packed.max_seqlen:
        raise ValueError(f"width {width} is shorter than the longest sequence "
                         f"({packed.max_seqlen})")
    flat = _flat(values, packed, "values")
    cols = packed.position_ids.reshape(-1).to(flat.device)
    # Each token's row: how many sequences have started by it. From the positions on the
    # device, not from `lengths`: this runs in every micro-batch's loss, and a host-built
    # index would stall the GPU's queue there (a sync each).
    rows = (cols == 0).cumsum(0) - 1
    # Out-of-place index_put: autograd routes each slot's gradient back to its packed value.
    return flat.new_zeros(len(packed.lengths), width).index_put((rows, cols), flat)


def next_token_targets(packed: Packed) -> tuple[Tensor, Tensor]:
    """``(targets [N] long, valid [N] bool)``: ``targets[j]`` is the token after ``j`` in the
    same sequence. A sequence's last token has none (the next packed token starts another
    sequence): there ``valid`` is False and the target 0, a safe index for a gather."""
    ids = packed.input_ids.reshape(-1)
    pos = packed.position_ids.reshape(-1)
    # j has a next token in its sequence iff position j + 1 exists and does not restart at 0.
    valid = torch.cat([pos[1:] != 0, pos.new_zeros(1, dtype=torch.bool)])
    targets = torch.cat([ids[1:], ids.new_zeros(1)]).masked_fill(~valid, 0)
    return targets, valid


def align_to_tokens(per_position: Tensor, packed: Packed) -> Tensor:
    """Move values about the next token onto the token they are about.

    ``per_position[j]`` is computed at packed position ``j`` about token ``j + 1`` (e.g. the
    log-prob of ``targets[j]`` from ``next_token_targets``). Returns ``out[j] =
    per_position[j - 1]``, and 0 at each sequence start, which nothing predicts (this also
    drops each sequence's last value, which would cross into the next sequence). Same shape
    as the input (``[N]`` or ``[1, N]``); differentiable.
    """
    flat = _flat(per_position, packed, "per_position")
    starts = packed.position_ids.reshape(-1).to(flat.device) == 0
    shifted = F.pad(flat[:-1], (1, 0)).masked_fill(starts, 0)
    return shifted.reshape(per_position.shape)


def to_rows(per_position: Tensor, valid: Tensor, packed: Packed, width: int) -> Tensor:
    """Per-position values about the next token (e.g. log-probs of ``next_token_targets``,
    ``valid`` from there) -> ``[b, width]`` rows aligned to ``input_ids``: shifted onto the
    token they are about (``align_to_tokens``), 0 where nothing is predicted, unpacked.
    Differentiable."""
    values = torch.where(valid, _flat(per_position, packed, "per_position"), 0.0)
    return unpack(align_to_tokens(values, packed), packed, width)
