"""Mixture-of-experts routes: which experts each token went to, as an engine reports them and
a trainer replays them (docs/moe.md).

A route table is an int tensor ``[tokens, layers, top_k]``: row ``t`` is about the token at
position ``t`` of the sequence, as an *input* to the forward pass (the experts its hidden state
was sent to in each decoder layer). ``layers`` counts every decoder layer, dense ones too, as
SGLang's ``routed_experts`` does; a dense layer's entries are ``NO_ROUTE``.

On the wire (``meta_info["routed_experts"]`` of ``/generate``, SGLang >= 0.5.7's field, asked
for with ``return_routed_experts: true``) the table is base64 of its int32 bytes, row-major,
covering positions ``[0, len(prompt) + len(output) - 1)``: the last sampled token was never an
input. The trainer keeps it beside the sample's tokens, padded with ``NO_ROUTE`` rows to the
sample's length; a ``NO_ROUTE`` row (or entry) leaves that token to the router's own choice.

Everything here is pure torch: both sides (the reference engine and the trainer) import it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

NO_ROUTE = -1
ROUTES_FIELD = "routed_experts"           # meta_info key, as SGLang names it
RETURN_ROUTES = "return_routed_experts"   # the request field that asks for it
ROUTES_FLAG = "enable-return-routed-experts"  # the engine flag that makes it answerable


@dataclass(frozen=True)
class MoeShape:
    """What a route table's shape depends on, read from an HF config."""

    layers: int           # decoder layers (every one gets a row of the table)
    experts: int          # routed experts per MoE layer
    top_k: int            # experts per token
    moe_layers: tuple[int, ...]  # the layers whose MLP is a routed MoE block

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if i not in set(self.moe_layers))


# Config keys that name the routed-expert count in the HF families kuberl reads.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def moe_shape(config: Mapping[str, Any]) -> MoeShape | None:
    """The MoE layout of an HF ``config.json`` (a dict), or None for a dense model.

    Qwen2/3-MoE: ``num_experts``, ``num_experts_per_tok``, MoE in layers not in
    ``mlp_only_layers`` and at every ``decoder_sparse_step``-th one; Mixtral:
    ``num_local_experts`` (every layer); DeepSeek-V3-style: ``n_routed_experts`` after the
    first ``first_k_dense_replace`` layers.
    """
    experts = next((int(config[k]) for k in _EXPERT_KEYS if config.get(k)), 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts <= 0 or top_k <= 0:
        return None
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    first_dense = int(config.get("first_k_dense_replace") or 0)
    moe = tuple(i for i in range(layers)
                if i not in dense and i >= first_dense and (i + 1) % step == 0)
    return MoeShape(layers=layers, experts=experts, top_k=top_k, moe_layers=moe)


def encode(routes: Tensor) -> str:
    """A ``[tokens, layers, top_k]`` table as the wire's base64 of int32 bytes."""
    if routes.dim() != 3:
        raise ValueError(f"routes must be [tokens, layers, top_k], got {tuple(routes.shape)}")
    data = routes.to(torch.int32).contiguous().cpu().numpy().tobytes()
    return base64.b64encode(data).decode("ascii")


def decode(text: str, layers: int, top_k: int) -> Tensor:
    """The wire's base64 back into an int64 ``[tokens, layers, top_k]`` table."""
    raw = base64.b64decode(text)
    per_token = 4 * layers * top_k
    if len(raw) % per_token:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, not a whole number of "
                         f"tokens of {layers} layers x top-{top_k} int32 experts")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    return flat.view(-1, layers, top_k).to(torch.int64)


def pad_to(routes: Tensor | None, length: int, layers: int, top_k: int) -> Tensor:
    """``routes`` (``[n, layers, top_k]``, n <= length, or None) as a table of ``length``
    rows: the rows it lacks are ``NO_ROUTE``."""
    out = torch.full((length, layers, top_k), NO_ROUTE, dtype=torch.int64)
    if routes is not None:
        n = min(int(routes.shape[0]), length)
        out[:n] = routes[:n]
    return out


def mismatch(own: Tensor, replayed: Tensor) -> tuple[int, int]:
    """``(routes whose expert set differs, routes compared)`` between a pass's own top-k and
    the replayed one, over the ``(token, layer)`` routes the replay covered (no ``NO_ROUTE``).
    Both ``[..., top_k]``; the order within a top-k does not count."""
    covered = (replayed != NO_ROUTE).all(dim=-1)
    same = (own.sort(dim=-1).values == replayed.sort(dim=-1).values).all(dim=-1)
    return int((covered & ~same).sum()), int(covered.sum())
