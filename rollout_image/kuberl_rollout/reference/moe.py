"""Mixture-of-experts models in the reference engine: the routes it reports and the experts
each tensor-parallel rank holds (docs/engine-contract.md, "Mixture-of-experts models").

Routes. With `--enable-return-routed-experts` (SGLang >= 0.5.7's flag) a request that asks
(`return_routed_experts`) gets `meta_info["routed_experts"]`: the experts each of its tokens
went to in every decoder layer, as the engine computed them (kuberl_wire.moe_routes: positions
[0, prompt + output - 1), base64 of int32). SGLang records a forward's top-k per KV-cache slot
and, when a request finishes, reads the slots of its tokens, so a token's route is the one
computed when its KV entry was made. Here a request keeps the rows of its own positions as they
are computed (prefill, then one per decode step), and a request resumed after a retraction
keeps the rows it had (its recomputed prefix is not recorded again: SGLang's resumed request
finds that prefix in its radix cache, with the routes stored beside it). The rows of padding
(left-padded prefills) are never anyone's.

A test switch (never kuberl's): `KUBERL_REFERENCE_PERTURB_ROUTES=1` makes the engine route
each token's last top-k expert to its (k+1)-th best (kuberl_wire.hf_routers' perturb), so its
routes differ from those a trainer holding the same weights computes; the routes it returns
and the log-probs it returns are both those of the perturbed forward.

Expert parallelism. SGLang shards a MoE layer over the TP ranks: by default every rank holds
every expert's 1/tp slice of the intermediate dimension (MoE TP); with `--ep-size ep`,
moe_tp = tp / ep and TP rank r is MoE-EP rank r // moe_tp, holding the whole experts
[ep_rank * E/ep, (ep_rank + 1) * E/ep), sliced r % moe_tp of moe_tp along the intermediate
dimension (sglang/srt/distributed/parallel_state.py,
initialize_model_parallel; layers/moe/fused_moe_triton/layer.py,
_map_global_expert_id_to_local_expert_id). Its weight loader takes full per-expert matrices
(slicing its part itself) and silently skips the experts it does not hold. What the trainer
observes of that is which experts a rank's update must carry; the reference engine's ranks hold
full copies of the model (tp.py), so a rank loads every expert it is sent (rank 0 generates
with all of them) but its checksums cover only the experts it owns, the ones SGLang's rank
would hold: an update that leaves a rank's own experts out shows as that rank's mismatch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kuberl_wire.hf_routers import RouterControl
from kuberl_wire.moe_routes import MoeShape, moe_shape

PERTURB_ENV = "KUBERL_REFERENCE_PERTURB_ROUTES"
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def perturb_requested() -> bool:
    return os.environ.get(PERTURB_ENV, "").lower() in {"1", "true", "yes"}


def model_shape(model: nn.Module) -> MoeShape | None:
    """The MoE layout of a loaded HF model (None: dense)."""
    config: Any = model.config
    return moe_shape(config.to_dict())


class EngineRouting:
    """The engine's hold on a MoE model's routers: each forward runs through `forward`, which
    perturbs (the test switch) and, when asked, yields what it routed."""

    def __init__(self, model: nn.Module, shape: MoeShape, *, perturb: bool) -> None:
        self.shape = shape
        self.perturb = perturb
        self.control = RouterControl(model, shape.layers)
        if not self.control.routers:
            raise ValueError(f"{type(model).__name__}: its config says mixture-of-experts, but "
                             "no router module of transformers' MoE form was found")

    @contextmanager
    def forward(self, record: bool) -> Iterator[RouterControl | None]:
        """Around one model forward. Yields the control (its `recorded`: [N, layers, k] for
        the forward's N = B * T rows, row-major) when recording or perturbing, else None."""
        if not (record or self.perturb):
            yield None
            return
        with self.control.active(perturb=self.perturb) as control:
            yield control


def recorded_rows(control: RouterControl | None, batch: int) -> torch.Tensor | None:
    """The last forward's routes as int32 ``[batch, T, layers, k]`` on the CPU."""
    if control is None or control.recorded is None:
        return None
    table = control.recorded.to(device="cpu", dtype=torch.int32)
    return table.view(batch, -1, *table.shape[1:])


def owned_experts(tp_rank: int, tp_size: int, ep_size: int, experts: int) -> range:
    """The routed experts TP rank `tp_rank` holds in SGLang 0.5.6 (see the module docstring):
    all of them without expert parallelism."""
    if ep_size <= 1:
        return range(experts)
    moe_tp = tp_size // ep_size
    ep_rank = tp_rank // moe_tp
    per_rank = experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def check_expert_parallel(tp_size: int, ep_size: int, experts: int | None) -> None:
    """SGLang's conditions on --ep-size (ValueError with what is wrong): it divides --tp-size
    (moe_tp = tp / ep) and, for a MoE model, the routed experts (FusedMoE asserts it)."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp_size}")
    if experts is not None and ep_size > 1 and experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide the model's {experts} routed "
                         "experts")


def expert_of(name: str) -> int | None:
    """The routed expert a checkpoint-named tensor belongs to, or None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None
