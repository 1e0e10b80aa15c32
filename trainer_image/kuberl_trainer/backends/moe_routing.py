"""A mixture-of-experts policy's routing in the fsdp backend: routing replay and the router's
load-balancing loss (docs/moe.md).

Replay (``algorithm.routingReplay``) sends each token of a forward pass to given experts
instead of the router's own top-k (``kuberl_wire.hf_routers``): the engine's, carried with
the sample (``rollout``), or those of the trainer's own old-log-prob pass (``training``,
recorded here). Routes travel with a ``TrainBatch`` as ``[B, T, layers, top_k]``; a packed
micro-batch's forward sees its rows' real tokens concatenated, the same order
``packed_routes`` gives. Each replayed pass also counts how often the router's own choice
differs from the replayed one: the metric ``routing_replay_mismatch``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from kuberl_api.spec import AlgorithmSpec
from kuberl_trainer.backends.base import TrainBatch
from kuberl_wire.hf_routers import RouterControl
from kuberl_wire.moe_routes import NO_ROUTE, MoeShape, mismatch, moe_shape

MISMATCH = "routing_replay_mismatch"
AUX_LOSS = "moe_aux_loss"


def packed_routes(batch: TrainBatch) -> Tensor | None:
    """``batch.routes`` of its real tokens, rows concatenated: ``[N, layers, top_k]`` (the
    packed row's order: rows right-padded, attention mask a prefix)."""
    if batch.routes is None:
        return None
    return batch.routes[batch.attention_mask.bool()]


def aux_loss_coef(config: Mapping[str, Any], algo: AlgorithmSpec) -> float:
    """``algorithm.routerAuxLossCoef``, or the model's own ``router_aux_loss_coef``."""
    if algo.router_aux_loss_coef is not None:
        return float(algo.router_aux_loss_coef)
    return float(config.get("router_aux_loss_coef") or 0.0)


class MoeRouting:
    """The routing of one HF MoE model (``model``: the unwrapped HF module, whose routers are
    the ones the training forward runs through)."""

    def __init__(self, model: nn.Module, config: Mapping[str, Any],
                 algo: AlgorithmSpec) -> None:
        shape = moe_shape(config)
        if shape is None:
            raise ValueError("MoeRouting needs a mixture-of-experts model")
        self.shape: MoeShape = shape
        self.control = RouterControl(model, shape.layers)
        if not self.control.routers:
            raise ValueError(f"the model's config names {shape.experts} experts, but no "
                             "router module was found (a family kuberl cannot route)")
        self.replay = algo.routing_replay
        self.aux_coef = aux_loss_coef(config, algo)

    @property
    def records(self) -> bool:
        """Whether the old-log-prob pass records the routes the training passes replay."""
        return self.replay == "training"

    def forward_kwargs(self, *, training: bool) -> dict[str, Any]:
        """What the HF forward needs: the routers' logits when the aux loss is on."""
        return {"output_router_logits": True} if training and self.aux_coef > 0 else {}

    @contextmanager
    def forward(self, batch: TrainBatch, stats: dict[str, Tensor] | None = None
                ) -> Iterator[RouterControl]:
        """Around one packed forward over ``batch``'s rows: its routes replayed (when the job
        replays and it has them), and the mismatch of the router's own choice with them
        written to ``stats``."""
        replay = packed_routes(batch) if self.replay != "none" else None
        with self.control.active(replay=replay) as control:
            yield control
        if replay is not None and stats is not None and control.own is not None:
            differ, compared = mismatch(control.own, replay)
            if compared:
                stats[MISMATCH] = torch.tensor(differ / compared, device=replay.device)

    def recorded_rows(self, batch: TrainBatch) -> Tensor:
        """The last forward's routes back on ``batch``'s padded rows: ``[b, t, layers,
        top_k]``, ``NO_ROUTE`` on padding."""
        recorded = self.control.recorded
        assert recorded is not None, "no forward ran under MoeRouting.forward"
        mask = batch.attention_mask.bool()
        rows = torch.full((*mask.shape, self.shape.layers, self.control.top_k), NO_ROUTE,
                          dtype=torch.long, device=recorded.device)
        rows[mask] = recorded
        return rows
