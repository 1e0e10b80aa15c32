"""The megatron backend's mixture-of-experts machinery around a built model: routing-replay
hooks on its routers, the load-balancing loss's per-step scale and its metric.

Imports megatron-core inside the functions (only a GPU trainer calls them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.backends.megatron.routing_replay import (
    LayerReplay,
    layer_table,
    packed_routes,
    unpack_routes,
)
from kuberl_trainer.backends.micro_batches import MicroBatch
from kuberl_wire.moe_routes import NO_ROUTE

AUX_LOSS_NAME = "load_balancing_loss"  # megatron's tracker key for the aux_loss type


def routers(model: nn.Module) -> list[Any]:
    """The model's ``TopKRouter`` modules (its pipeline stage's MoE layers), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda r: int(r.layer_number))


def attach_replay(model: nn.Module) -> list[LayerReplay]:
    """A ``LayerReplay`` on each router of ``model`` (layer = megatron's 1-based global
    ``layer_number`` - 1, the routes' column)."""
    hooks = []
    for router in routers(model):
        hook = LayerReplay(int(router.layer_number) - 1)
        router.router_replay = hook
        hooks.append(hook)
    return hooks


class Replay:
    """The backend's routing-replay state over one model's routers."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        self.hooks = attach_replay(model)
        self.layers = layers  # decoder layers (the routes tables' third dimension)

    def set_micro_batch(self, routes: Tensor | None, attention_mask: Tensor, *,
                        record: bool) -> None:
        """Before a micro-batch's forward: its samples' routes (``[b, t, layers, k]`` or None:
        the routers' own) and whether to record the routers' own choice."""
        packed = None if routes is None else packed_routes(routes, attention_mask)
        for hook in self.hooks:
            hook.target = None if packed is None else packed[:, hook.layer]
            hook.record = record

    def take_recorded(self, attention_mask: Tensor) -> Tensor:
        """The routes recorded in the oldest unread micro-batch forward, ``[b, t, layers, k]``
        (``NO_ROUTE`` in layers other pipeline stages hold)."""
        recorded: list[Tensor | None] = []
        for hook in self.hooks:  # first in, first out: micro-batches in run order
            recorded.append(hook.recorded.pop(0) if hook.recorded else None)
        table = layer_table(recorded, self.layers, [h.layer for h in self.hooks])
        return unpack_routes(table, attention_mask)

    def clear(self) -> None:
        for hook in self.hooks:
            hook.target, hook.record = None, False
            hook.recorded.clear()

    def reset_counts(self) -> None:
        for hook in self.hooks:
            hook.reset_counts()

    def mismatch(self, pp_group: Any | None) -> float | None:
        """``routing_replay_mismatch`` of the passes since ``reset_counts``, over every
        pipeline stage's layers (collective over ``pp_group`` when given)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for hook in self.hooks:
            if hook.covered is not None and hook.mismatched is not None:
                counts += torch.stack([hook.mismatched.double(), hook.covered.double()])
        if pp_group is not None:
            dist.all_reduce(counts, group=pp_group)
        mismatched, covered = counts.tolist()
        return None if covered == 0 else mismatched / covered


def scale_aux_loss(model: nn.Module, per_layer_coef: float, step_tokens: float) -> None:
    """Before an optimizer step: the aux loss's weight for this step's micro-batches.

    megatron attaches each micro-batch's aux loss times its token count (its
    ``calculate_per_token_loss`` convention, expecting a later division by the step's tokens,
    which this backend's finalisation does not do: its policy loss is already normalised).
    Dividing the coefficient by the step's tokens over every data-parallel rank makes the
    aux term the token-weighted mean of the micro-batches' losses, times ``coef / layers``
    per layer, as the policy loss is normalised over the global batch.
    """
    if per_layer_coef <= 0:
        return
    coef = per_layer_coef / max(step_tokens, 1.0)
    for router in routers(model):  # (each reads its own config's coefficient when routing)
        router.config.moe_aux_loss_coeff = coef


def aux_loss_metric(micro_batches: int, moe_layers: int, pp_group: Any | None) -> float | None:
    """``moe_aux_loss``: the load-balancing loss (unweighted, HF's definition for one layer)
    averaged over the MoE layers and this rank's micro-batches since the last call, which
    clears megatron's tracker; None without an aux loss. Collective over ``pp_group``."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    if AUX_LOSS_NAME not in tracker:
        return None
    total = tracker[AUX_LOSS_NAME]["values"].sum().reshape(1).double()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    clear_aux_losses_tracker()
    return float(total.item()) / max(micro_batches * moe_layers, 1)



def idle_micro_batches(micros: list[MicroBatch], count: int) -> list[MicroBatch]:
    """``count`` micro-batches that add nothing to the loss (the last one again, its loss mask
    zeroed): a rank with fewer micro-batches than its expert-parallel peers still joins their
    all-to-alls. Its log-probs are the last one's, written to the same rows again."""
    if count <= 0:
        return []
    if not micros:
        raise RuntimeError("this rank has no samples while its expert-parallel group runs "
                           "micro-batches (the batch has fewer samples than data-parallel ranks)")
    last = micros[-1]
    idle = dataclasses.replace(last, batch=dataclasses.replace(
        last.batch, loss_mask=torch.zeros_like(last.batch.loss_mask)))
    return [idle] * count


def record_routes(replay: Replay, micros: list[MicroBatch], batch: TrainBatch) -> Tensor:
    """The routes each micro-batch's forward recorded (in run order), as one
    ``[B, T, layers, k]`` table of ``batch``'s rows (``NO_ROUTE`` on padding and in layers
    other pipeline stages hold)."""
    b, t = batch.input_ids.shape
    out: Tensor | None = None
    for mb in micros:
        rows = replay.take_recorded(mb.batch.attention_mask)
        if out is None:
            out = rows.new_full((b, t, *rows.shape[2:]), NO_ROUTE)
        out[mb.rows, :rows.shape[1]] = rows
    if out is None:
        raise ValueError("no micro-batch recorded routes")
    return out
