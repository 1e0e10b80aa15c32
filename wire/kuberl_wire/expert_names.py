"""Expert weights between transformers' fused layout and the checkpoint's per-expert names.

transformers (5.x) holds a Qwen2/3-MoE layer's experts as two 3-D parameters:
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``[E, H, I]``. Checkpoints on disk, SGLang's MoE loaders and every
weight update on the wire name each expert's matrices apart, as the HF checkpoints do:
``mlp.experts.<e>.gate_proj.weight`` ``[I, H]``, ``up_proj.weight`` ``[I, H]`` and
``down_proj.weight`` ``[H, I]``. The trainer exports and the reference engine imports through
here, so both sides speak the checkpoint's names. Pure torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\."
                    r"(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


def is_fused(name: str) -> bool:
    return _FUSED.match(name) is not None


def split(name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` in the checkpoint's names: a fused expert parameter becomes one
    matrix per expert (views, no copy); anything else passes through."""
    m = _FUSED.match(name)
    if m is None:
        yield name, tensor
        return
    prefix = m["prefix"]
    if m["kind"] == "down_proj":
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        return
    half = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
        yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint-named expert matrix lies in the fused parameter ``fused``:
    ``fused[expert, rows]`` (``rows`` None: the whole expert's matrix)."""

    fused: str
    expert: int
    part: str  # gate_proj | up_proj | down_proj

    def view(self, param: Tensor) -> Tensor:
        """The matrix's place in ``param`` (the fused tensor): a view to read or copy into."""
        if self.part == "down_proj":
            return param[self.expert]
        half = param.shape[1] // 2
        return param[self.expert, :half] if self.part == "gate_proj" else param[self.expert,
                                                                                   half:]


def slot(name: str) -> Slot | None:
    """The fused parameter a checkpoint-named expert matrix belongs to, or None for a name
    that is not one."""
    m = _SPLIT.match(name)
    if m is None:
        return None
    kind = m["kind"]
    fused = f"{m['prefix']}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
    return Slot(fused=fused, expert=int(m["expert"]), part=kind)


def fuse(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's ``state`` (per-expert names) under transformers' fused names: each
    layer's expert matrices stacked into its ``gate_up_proj`` and ``down_proj``; every other
    tensor as it is. Raises ``ValueError`` when a layer's experts are not numbered 0..E-1."""
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, tensor in state.items():
        s = slot(name)
        if s is None:
            out[name] = tensor
        else:
            parts.setdefault(s.fused, {})[(s.expert, s.part)] = tensor
    for fused, mats in parts.items():
        experts = sorted({e for e, _ in mats})
        if experts != list(range(len(experts))):
            raise ValueError(f"{fused}: the checkpoint's experts are {experts}, not 0..E-1")
        kinds = ("down_proj",) if fused.endswith("down_proj") else ("gate_proj", "up_proj")
        missing = [f"{e}.{k}" for e in experts for k in kinds if (e, k) not in mats]
        if missing:
            raise ValueError(f"{fused}: the checkpoint lacks experts' {', '.join(missing)}")
        out[fused] = torch.stack([torch.cat([mats[(e, k)] for k in kinds]) for e in experts])
    return out
