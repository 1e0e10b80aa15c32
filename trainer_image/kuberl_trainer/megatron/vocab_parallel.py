"""Per-token log-probs and entropy when the vocabulary is split across tensor-parallel ranks.

Megatron's output layer is column-parallel: each TP rank holds a contiguous slice of the
(padded) vocabulary and computes only those columns of the logits. Gathering the full
``[tokens, vocab]`` logits on every rank would cost ``tp`` times the memory of the largest
activation in the model, so the softmax is assembled from per-rank partial results instead:

- the max over the vocabulary (a shift for stability; MAX all-reduce, no gradient needed:
  the result does not depend on it),
- the sum of ``exp`` (SUM all-reduce) -> logsumexp,
- the target's logit, picked on the rank that owns the target's id, 0 elsewhere (SUM),
- ``sum(exp * logit)`` (SUM) -> entropy = logsumexp - E_p[logit].

The three sums go in one all-reduce. Megatron pads the vocabulary to a multiple of
``128 * tp`` (``hf_layout.padded_vocab``); the padding columns' logits are whatever the padded
output rows produce, so with ``vocab_size`` they are masked out, not left to take mass.

Gradient: every TP rank computes the same loss from the reduced values, so the gradient of a
rank's partial sum is the gradient of the reduced value itself. The SUM reduction is therefore
an all-reduce forward and the identity backward (Megatron's "reduce from tensor-parallel
region"). ``torch.distributed.nn.functional.all_reduce`` all-reduces the gradient too, which
would scale every logit gradient by ``tp`` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward, identity backward (see the module docstring for why)."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: ProcessGroup) -> Tensor:
        total = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _communicates(group: ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, *, vocab_start: int,
                               group: ProcessGroup | None = None,
                               vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and entropy of the full softmax, from a vocabulary slice.

    Args:
        logits: ``[..., V_local]``, this rank's columns: global ids ``vocab_start`` ..
            ``vocab_start + V_local - 1``. Any float dtype; computed in float32.
        targets: ``[...]`` long, global token ids (below ``vocab_size``).
        vocab_start: the global id of this rank's first column; 0 without a group.
        group: the tensor-parallel group the vocabulary is split over. None or a group of
            one: the slice is the whole vocabulary and nothing is communicated.
        vocab_size: the real vocabulary size; columns with global id ``>= vocab_size`` are
            padding and get no probability. None: every column is real.

    Returns:
        ``(logp, entropy)``, both ``[...]`` float32, differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    distributed = _communicates(group)
    local = logits.shape[-1]
    if not distributed and vocab_start != 0:
        raise ValueError(f"vocab_start is {vocab_start} but without a tensor-parallel group "
                         "the logits must hold the whole vocabulary (vocab_start 0)")
    real = local if vocab_size is None else min(max(vocab_size - vocab_start, 0), local)
    if not distributed and real == 0:
        raise ValueError(f"vocab_size {vocab_size}: no real column in the logits")

    x = logits.float()
    pad = None
    if real < local:
        pad = torch.arange(local, device=x.device) >= real
        # -inf before the max and the exp: padding neither sets the shift nor takes mass. (A
        # rank holding only padding gets max -inf here; the MAX all-reduce replaces it.)
        x = x.masked_fill(pad, float("-inf"))

    shift = x.detach().amax(dim=-1, keepdim=True)
    if distributed:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = x - shift  # <= 0; -inf on padding
    exp = shifted.exp()
    # exp * shifted is 0 * -inf = nan on padding; those terms are 0 (no mass there).
    finite = shifted if pad is None else shifted.masked_fill(pad, 0.0)
    weighted = (exp * finite).sum(dim=-1)

    index = targets - vocab_start
    owned = (index >= 0) & (index < local)
    picked = shifted.gather(-1, torch.where(owned, index, 0).unsqueeze(-1)).squeeze(-1)
    # where (not multiply) so a -inf picked on a rank that does not own the target stays out.
    picked = torch.where(owned, picked, 0.0)

    sums = torch.stack([exp.sum(dim=-1), weighted, picked], dim=-1)
    if distributed:
        assert group is not None
        sums = _SumOverRanks.apply(sums, group)
    total, weighted, picked = sums.unbind(dim=-1)

    log_total = total.log()  # logsumexp of the shifted logits
    logp = picked - log_total
    entropy = log_total - weighted / total  # logsumexp - E_p[logit], both shifted alike
    return logp, entropy
