"""Control over an HF mixture-of-experts model's routers: record the experts each token goes
to, replay given ones, or (a test engine's fault) perturb the choice.

transformers' MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...) route through a router
module whose forward maps hidden states ``[N, H]`` to ``(logits, weights [N, k], experts
[N, k])``: a softmax over the experts, its top-k, and (Mixtral always, the others with
``norm_topk_prob``) the top-k renormalised to sum to 1. ``RouterControl`` wraps those modules'
forwards for the length of a ``with`` block:

- record: every MoE layer's chosen experts land in ``recorded`` (``[N, layers, k]``);
- replay: a token whose replayed row is not ``NO_ROUTE`` goes to those experts, weighted by
  the router's own probabilities of them (renormalised as the router does), so the router
  still gets gradients through the weights; the router's own choice is kept, for the
  mismatch metric;
- perturb: each token's last top-k expert becomes its (k+1)-th best. Only the reference
  engine's test switch uses it, to make an engine route differently from a trainer holding
  the same weights.

The forward runs on one packed row (the trainer) or a ``[B, T]`` batch (the engine): the
router sees ``N = B * T`` rows either way, in row-major order, which is the order of the
tables here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from kuberl_wire.moe_routes import NO_ROUTE

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's MoE routers by decoder layer index: modules named ``...layers.<i>...gate``
    (or ``router``) whose forward returns logits, weights and experts (they have ``top_k``
    and a ``[experts, hidden]`` weight)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        match = _LAYER.search(name)
        if (leaf in ("gate", "router") and match and hasattr(module, "top_k")
                and isinstance(getattr(module, "weight", None), Tensor)):
            found[int(match.group(1))] = module
    return found


def _normalises(router: nn.Module) -> bool:
    # Mixtral's router has no such attribute and always renormalises.
    return bool(getattr(router, "norm_topk_prob", True))


def _weights_of(router: nn.Module, logits: Tensor, experts: Tensor, like: Tensor) -> Tensor:
    """The router's weights for ``experts`` (``[N, k]``) from its ``logits``: softmax
    probabilities, renormalised over the k when the router does, in ``like``'s dtype."""
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if _normalises(router):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(like.dtype)


class RouterControl:
    """Wraps a model's routers while active (see the module docstring). ``layers``: the
    model's decoder layer count (the tables' second dimension)."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        self.routers = routers(model)
        self.layers = layers
        # (getattr: an nn.Module's attribute types as Tensor | Module)
        self.top_k = max((int(getattr(r, "top_k")) for r in self.routers.values()),  # noqa: B009
                         default=0)
        self.replay: Tensor | None = None     # [N, layers, k] long, or None
        self.perturb = False
        self.recorded: Tensor | None = None   # [N, layers, k]: the experts used
        self.own: Tensor | None = None        # [N, layers, k]: the router's own choice

    @contextmanager
    def active(self, *, replay: Tensor | None = None, perturb: bool = False
               ) -> Iterator[RouterControl]:
        """The routers wrapped for one forward pass (or several over the same rows)."""
        self.replay, self.perturb = replay, perturb
        self.recorded = self.own = None
        originals = {i: r.forward for i, r in self.routers.items()}
        try:
            for i, router in self.routers.items():
                router.forward = self._wrapped(i, router, originals[i])
            yield self
        finally:
            for i, router in self.routers.items():
                router.forward = originals[i]
            self.replay = None

    def _table(self, rows: int, like: Tensor) -> Tensor:
        return torch.full((rows, self.layers, self.top_k), NO_ROUTE, dtype=torch.long,
                          device=like.device)

    def _wrapped(self, layer: int, router: nn.Module, forward: Any) -> Any:
        def run(hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
            logits, weights, experts = forward(hidden, *args, **kwargs)
            own = experts
            if self.perturb:
                experts = self._perturbed(logits, experts)
                weights = _weights_of(router, logits, experts, weights)
            if self.replay is not None:
                given = self.replay[:, layer].to(experts.device)
                if given.shape != experts.shape:
                    raise ValueError(
                        f"routes to replay hold {tuple(given.shape)} at layer {layer}, but the "
                        f"router chose {tuple(experts.shape)} (tokens x top_k): the routes do "
                        "not belong to these tokens or this model")
                keep = (given == NO_ROUTE).any(dim=-1, keepdim=True)
                experts = torch.where(keep, experts, given)
                weights = _weights_of(router, logits, experts, weights)
            self._note(layer, own, experts)
            return logits, weights, experts
        return run

    @staticmethod
    def _perturbed(logits: Tensor, experts: Tensor) -> Tensor:
        k = experts.shape[-1]
        ranked = torch.topk(logits.float(), min(k + 1, logits.shape[-1]), dim=-1).indices
        out = experts.clone()
        out[:, -1] = ranked[:, -1]
        return out

    def _note(self, layer: int, own: Tensor, used: Tensor) -> None:
        if self.recorded is None or self.recorded.shape[0] != used.shape[0]:
            self.recorded = self._table(used.shape[0], used)
            self.own = self._table(used.shape[0], used)
        assert self.own is not None
        self.recorded[:, layer, :used.shape[-1]] = used.detach()
        self.own[:, layer, :own.shape[-1]] = own.detach()
