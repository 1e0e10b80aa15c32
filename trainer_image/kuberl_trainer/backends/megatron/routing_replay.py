"""Routing replay for megatron-core's MoE routers (``algorithm.routingReplay``; docs/moe.md).

megatron-core 0.16's ``TopKRouter`` picks experts through ``router.router_replay.get_replay_topk
(scores, topk, num_groups, group_topk, default_compute_topk)`` whenever ``router_replay`` is set
(its own ``RouterReplay`` replays a whole layer's indices or nothing, keeps every instance in a
process-global list, and counts nothing). ``LayerReplay`` implements that same call for one
layer, and differs where kuberl needs it:

- a ``NO_ROUTE`` row (or entry) of the target keeps the router's own top-k for that token;
- it always computes the router's own top-k, records it (the ``training`` mode's old-log-prob
  pass) and counts, on the GPU, how many covered tokens' own expert *set* differs from the
  replayed one (``routing_replay_mismatch``, as ``kuberl_wire.moe_routes.mismatch``);
- the replayed experts' probabilities are gathered from the same scores the router would have
  ranked, so they go through the router's own normalisation afterwards (the softmax over the
  k chosen logits for Qwen3-MoE's ``norm_topk_prob``; the softmax over all experts, gathered,
  for Qwen2-MoE): the router keeps its gradient through the replayed experts' weights.

Token order: a Megatron MoE layer sees the micro-batch's packed row (``[N, 1, H]`` flattened
to ``N`` tokens, sequences one after another, each one's real tokens in order), so a layer's
target is ``TrainBatch.routes`` of the micro-batch's samples taken where the attention mask is
1, row-major (``packed_routes``), and what it records goes back the same way
(``unpack_routes``). Pure torch: no megatron import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kuberl_wire.moe_routes import NO_ROUTE

TopK = Callable[..., tuple[Tensor, Tensor]]


class LayerReplay:
    """One MoE layer's router hook (``TopKRouter.router_replay``)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer                  # global decoder layer index (the routes' column)
        self.target: Tensor | None = None   # [N, top_k] long for the next forward, or None
        self.record = False                 # keep the own top-k of each forward in `recorded`
        self.recorded: list[Tensor] = []
        self.mismatched: Tensor | None = None  # running counts (0-d long tensors, on device)
        self.covered: Tensor | None = None

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: TopK | None = None) -> tuple[Tensor, Tensor]:
        if default_compute_topk is None:
            raise ValueError("megatron's router passes its top-k function")
        values, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                           group_topk=group_topk)
        if self.record:
            self.recorded.append(own.detach())
        if self.target is None:
            return values, own
        return replay(scores, own, self.target.to(own.device), self)

    def count(self, mismatched: Tensor, covered: Tensor) -> None:
        self.mismatched = mismatched if self.mismatched is None else self.mismatched + mismatched
        self.covered = covered if self.covered is None else self.covered + covered

    def reset_counts(self) -> None:
        self.mismatched = self.covered = None


def replay(scores: Tensor, own: Tensor, target: Tensor, counter: LayerReplay | None = None
           ) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the replayed top-k: ``target`` ``[N, k]`` where it has no
    ``NO_ROUTE``, the router's ``own`` choice elsewhere; ``values`` are ``scores`` at those
    indices (differentiable). Counts ``(mismatched, covered)`` into ``counter``."""
    if target.shape != own.shape:
        raise ValueError(f"replayed routes {tuple(target.shape)} do not match the router's "
                         f"top-k {tuple(own.shape)} (tokens x top_k)")
    covered = (target != NO_ROUTE).all(dim=-1)
    indices = torch.where(covered[:, None], target, own)
    if counter is not None:
        same = (own.sort(dim=-1).values == indices.sort(dim=-1).values).all(dim=-1)
        counter.count((covered & ~same).sum(), covered.sum())
    return scores.gather(1, indices), indices


def packed_routes(routes: Tensor, attention_mask: Tensor) -> Tensor:
    """A micro-batch's ``[b, t, layers, k]`` routes -> ``[N, layers, k]`` in its packed row's
    token order (the masked-in tokens, row-major, as ``packing.pack_rows`` keeps them)."""
    return routes[attention_mask.bool()]


def unpack_routes(recorded: Tensor, attention_mask: Tensor) -> Tensor:
    """Inverse of ``packed_routes``: ``[N, layers, k]`` -> ``[b, t, layers, k]``, ``NO_ROUTE``
    on padding."""
    mask = attention_mask.bool()
    out = recorded.new_full((*mask.shape, *recorded.shape[1:]), NO_ROUTE)
    out[mask] = recorded
    return out


def layer_table(recorded: Sequence[Tensor | None], layers: int, moe_layers: Sequence[int]
                ) -> Tensor:
    """Per-MoE-layer ``[N, k]`` records (None: a layer this rank does not hold) -> one
    ``[N, layers, k]`` table, ``NO_ROUTE`` in the other layers' columns."""
    present = [r for r in recorded if r is not None]
    if not present:
        raise ValueError("no MoE layer recorded any route")
    n, k = present[0].shape
    out = present[0].new_full((n, layers, k), NO_ROUTE)
    for layer, r in zip(moe_layers, recorded, strict=True):
        if r is not None:
            out[:, layer] = r
    return out

