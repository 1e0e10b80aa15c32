"""Hugging Face <-> Megatron-core layout of a mixture-of-experts layer (Qwen3-MoE, Qwen2-MoE):
names, fused expert matrices, and their expert-parallel (ep) and expert-tensor-parallel (etp)
shards. Pure torch; ``hf_layout`` calls in here for the MLP of an MoE model's layers.

Megatron's ``MoELayer`` (local spec, ``SequentialMLP`` experts) per decoder layer ``i``:

- ``decoder.layers.i.mlp.router.weight`` ``[E, H]``: HF's ``mlp.gate.weight`` (replicated).
- ``decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight`` ``[2I, H]`` (``[gate;
  up]``) and ``linear_fc2.weight`` ``[H, I]``: HF's ``mlp.experts.e.{gate,up,down}_proj``.
  Expert parallelism gives ep rank ``r`` the experts ``r * E/ep .. (r + 1) * E/ep - 1`` as its
  local experts ``0 .. E/ep - 1`` (megatron-core's ``local_expert_indices``); the *full*
  Megatron state dict this module builds names them by their global index ``e``, and
  ``model.local_name`` turns that into the rank's local index. Each expert's matrices split
  over the etp ranks like a dense MLP's over tp (fc1 column-wise per half, fc2 row-wise).
- Qwen2-MoE's shared expert: ``mlp.shared_experts.linear_fc1/linear_fc2.weight`` (a dense
  MLP, split over tp) and ``mlp.shared_experts.gate_weight`` ``[1, H]`` (HF's
  ``mlp.shared_expert_gate.weight``; both apply ``sigmoid(x . w)`` to the shared output).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kuberl_wire import expert_names
from kuberl_wire.moe_routes import moe_shape

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
_EXPERT = re.compile(r"^(?P<head>decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)"
                     r"(?P<e>\d+)(?P<tail>\..+)$")


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of every decoder layer (Qwen MoE models: every layer is MoE)."""

    experts: int          # E
    top_k: int
    ffn: int              # I, each expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    shared_ffn: int = 0   # Qwen2-MoE's shared expert's intermediate size (0: none)
    aux_loss_coef: float = 0.0  # the HF config's router_aux_loss_coef

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ExpertShape | None:
        """None for a dense model. Raises for an MoE layout the backend does not build."""
        kind = config.get("model_type")
        routes = moe_shape(config)
        if routes is None:
            return None
        if kind not in MOE_FAMILIES:
            raise ValueError(f"mixture-of-experts model_type {kind!r} is not supported by the "
                             f"megatron backend ({', '.join(MOE_FAMILIES)} are)")
        if routes.dense_layers:
            raise ValueError(f"layers {list(routes.dense_layers)} are dense (mlp_only_layers / "
                             "decoder_sparse_step): the megatron backend builds models whose "
                             "every layer is MoE")
        return cls(experts=routes.experts, top_k=routes.top_k,
                   ffn=int(config["moe_intermediate_size"]),
                   # Qwen3-MoE's configs default it to True, Qwen2-MoE's to False.
                   norm_topk_prob=bool(config.get("norm_topk_prob", kind == "qwen3_moe")),
                   shared_ffn=int(config.get("shared_expert_intermediate_size") or 0),
                   aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0))

    def check_parallel(self, ep: int, etp: int, tp: int) -> None:
        if self.experts % ep:
            raise ValueError(f"ep {ep} must divide the number of experts ({self.experts})")
        if self.ffn % etp:
            raise ValueError(f"etp {etp} must divide moe_intermediate_size ({self.ffn})")
        if self.shared_ffn % tp:
            raise ValueError(f"tp {tp} must divide shared_expert_intermediate_size "
                             f"({self.shared_ffn})")

    def local_experts(self, ep: int, ep_rank: int) -> range:
        """The global indices of ep rank ``ep_rank``'s experts, its local experts 0, 1, ..."""
        per = self.experts // ep
        return range(ep_rank * per, (ep_rank + 1) * per)


def check_layout(experts: ExpertShape | None, tp: int, ep: int, etp: int | None) -> None:
    """Refuse an expert layout the megatron backend cannot build for this model (``experts``:
    its ``DecoderShape.experts``); ``etp`` None is tp."""
    if experts is None:
        if ep > 1 or etp is not None:
            raise ValueError("parallelism.ep and etp apply to mixture-of-experts models; this "
                             "model is dense")
        return
    if tp > 1:
        # megatron-core refuses to train an MoE layer under tp without sequence parallelism,
        # which this backend does not lay out (packed rows would have to split over tp).
        raise ValueError("a mixture-of-experts model trains with tp 1 in the megatron backend "
                         "(tp > 1 needs sequence parallelism, not built yet): spread the "
                         "experts with parallelism.ep and etp instead")
    experts.check_parallel(ep, tp if etp is None else etp, tp)


# -- names -----------------------------------------------------------------------------------


def expert_name(layer: int, expert: int, fc: str) -> str:
    """The full Megatron name (global expert index) of an expert's ``linear_fc1``/``fc2``."""
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.weight"


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """``(head, expert, tail)`` of an expert tensor's Megatron name, else None."""
    m = _EXPERT.match(name)
    return None if m is None else (m["head"], int(m["e"]), m["tail"])


def is_expert(name: str) -> bool:
    return _EXPERT.match(name) is not None


def to_local(name: str, experts: ExpertShape, ep: int, ep_rank: int) -> str | None:
    """An expert's full name -> its name in ep rank ``ep_rank``'s module (local index), or None
    when another ep rank holds it. Other names pass through."""
    parts = split_expert_name(name)
    if parts is None:
        return name
    head, e, tail = parts
    mine = experts.local_experts(ep, ep_rank)
    return f"{head}{e - mine.start}{tail}" if e in mine else None


def to_global(name: str, experts: ExpertShape, ep: int, ep_rank: int) -> str:
    """Inverse of ``to_local``."""
    parts = split_expert_name(name)
    if parts is None:
        return name
    head, j, tail = parts
    return f"{head}{experts.local_experts(ep, ep_rank).start + j}{tail}"


def hf_mlp_to_megatron(hf: Mapping[str, Tensor], layer: int, experts: ExpertShape,
                       used: set[str]) -> dict[str, Tensor]:
    """Layer ``layer``'s MoE MLP in Megatron's names (full, global expert indices). ``hf`` in
    the checkpoint's per-expert names (``normalise_hf`` first); marks what it read in
    ``used``."""
    p, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    out = {m + "router.weight": hf[p + "gate.weight"]}
    used.add(p + "gate.weight")
    for e in range(experts.experts):
        x = f"{p}experts.{e}."
        gate, up, down = (f"{x}{k}_proj.weight" for k in ("gate", "up", "down"))
        out[expert_name(layer, e, "linear_fc1")] = torch.cat([hf[gate], hf[up]])
        out[expert_name(layer, e, "linear_fc2")] = hf[down]
        used.update((gate, up, down))
    if experts.shared_ffn:
        s = p + "shared_expert."
        gate, up, down = (f"{s}{k}_proj.weight" for k in ("gate", "up", "down"))
        out[m + "shared_experts.linear_fc1.weight"] = torch.cat([hf[gate], hf[up]])
        out[m + "shared_experts.linear_fc2.weight"] = hf[down]
        out[m + "shared_experts.gate_weight"] = hf[p + "shared_expert_gate.weight"]
        used.update((gate, up, down, p + "shared_expert_gate.weight"))
    return out


def megatron_mlp_to_hf(suffix: str, tensor: Tensor, prefix: str) -> dict[str, Tensor] | None:
    """One Megatron MoE MLP tensor (per-layer ``suffix``, full) -> its HF tensors under the
    layer's HF ``prefix`` (``model.layers.i.``); None for a suffix that is not MoE."""
    if suffix == "mlp.router.weight":
        return {prefix + "mlp.gate.weight": tensor}
    m = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$",
                 suffix)
    if m is not None:
        x = f"{prefix}mlp.experts.{m[1]}."
        if m[2] == "linear_fc2":
            return {x + "down_proj.weight": tensor}
        gate, up = tensor.chunk(2)
        return {x + "gate_proj.weight": gate, x + "up_proj.weight": up}
    s = prefix + "mlp.shared_expert."
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return {s + "gate_proj.weight": gate, s + "up_proj.weight": up}
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return {s + "down_proj.weight": tensor}
    if suffix == "mlp.shared_experts.gate_weight":
        return {prefix + "mlp.shared_expert_gate.weight": tensor}
    return None


def normalise_hf(hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF state dict in the checkpoint's per-expert names: transformers 5's fused
    ``mlp.experts.gate_up_proj``/``down_proj`` (an in-memory model's state dict) are split
    (views); per-expert names pass through."""
    out: dict[str, Tensor] = {}
    for name, t in hf.items():
        out.update(expert_names.split(name, t))
    return out


# -- expert parallelism: gathering every expert of a layer -----------------------------------


def expert_group_order(etp: int, ep: int) -> list[tuple[int, int]]:
    """``(ep_rank, etp_rank)`` of each member of Megatron's expert tensor-and-model-parallel
    group, in group-rank order: its ranks are generated with etp fastest, then ep
    (``RankGenerator`` order ``tp-cp-ep-dp-pp``, the expert grid's tp being etp)."""
    return [(r // etp, r % etp) for r in range(etp * ep)]
