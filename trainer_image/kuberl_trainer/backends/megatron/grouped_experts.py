"""An MoE layer's local experts run as two grouped matrix products instead of one small MLP per
expert.

Without Transformer Engine (and without the ``grouped_gemm`` package) megatron-core 0.16's only
expert module is ``SequentialMLP``: a Python loop over the local experts, each a full
``MLP`` module call (two small GEMMs, the activation, autograd bookkeeping) on its few hundred
tokens. With 128 experts a layer that loop, not the arithmetic, sets the step time
(bench/RESULTS.md: 0.16x the FLOP rate of a bare HF loop on the Qwen3-30B-A3B layer shape).

``GroupedExperts`` keeps SequentialMLP's parameters exactly (the same modules, names
``local_experts.j.linear_fc1.weight`` ``[2I, H]`` and ``linear_fc2.weight`` ``[H, I]``, the
same expert-parallel attributes, so loading, the optimizer and weight sync are unchanged) and
replaces its forward where it can: the weights stacked to ``[E, H, 2I]`` / ``[E, I, H]`` and
``torch._grouped_mm`` over the tokens, which megatron's dispatcher already sorted by expert
(``tokens_per_expert`` of them each); SwiGLU and the routing probability in between, as
megatron's MLP applies them (after the activation, before ``linear_fc2``). Autograd flows
through the stacks back to each expert's parameters. Elsewhere (float32, CPU, etp > 1, bias)
SequentialMLP's own loop runs.

``grouped_swiglu`` is the pure function (its loop fallback runs anywhere and is what the CPU
tests compare against); ``grouped_experts_class()`` builds the module, importing megatron-core
only when called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ENABLED = True  # (a benchmark's switch: False runs megatron's SequentialMLP loop)


def can_group(x: Tensor) -> bool:
    """``torch._grouped_mm``: bf16 on a CUDA device of compute capability 9.0 (Hopper)+."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def grouped_swiglu(x: Tensor, fc1: list[Tensor], fc2: list[Tensor], counts: Tensor,
                   probs: Tensor) -> Tensor:
    """Expert ``e``'s ``fc2 @ (silu(gate) * up * p)`` for its ``counts[e]`` consecutive rows of
    ``x`` ``[T, H]``, with ``fc1[e]`` ``[2I, H]`` (gate rows, then up rows), ``fc2[e]``
    ``[H, I]`` and each row's routing probability ``probs`` ``[T]``. Returns ``[T, H]``."""
    if can_group(x):
        offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)
        h = torch._grouped_mm(x, torch.stack(fc1).transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
        out: Tensor = torch._grouped_mm(a, torch.stack(fc2).transpose(1, 2), offs=offs)
        return out
    outs = []
    sizes = [int(n) for n in counts.tolist()]
    for rows, p, w1, w2 in zip(torch.split(x, sizes), torch.split(probs, sizes), fc1, fc2,
                               strict=True):
        gate, up = (rows @ w1.t()).chunk(2, dim=-1)
        outs.append(((F.silu(gate) * up * p.unsqueeze(-1)).to(x.dtype)) @ w2.t())
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


def grouped_experts_class() -> type:
    """SequentialMLP with ``grouped_swiglu`` as its forward where it applies."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedExperts(SequentialMLP):  # type: ignore[misc]
        def _groupable(self, x: Tensor) -> bool:
            c = self.config
            return bool(ENABLED and can_group(x) and self.tp_group.size() == 1
                        and c.gated_linear_unit and c.activation_func is F.silu
                        and not c.add_bias_linear and not c.moe_apply_probs_on_input
                        and not (c.fp8 or c.fp4))

        def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor,
                    permuted_probs: Tensor) -> tuple[Tensor, Any]:
            x = permuted_local_hidden_states
            if not self._groupable(x):
                return super().forward(x, tokens_per_expert, permuted_probs)  # type: ignore[no-any-return]
            counts = torch.as_tensor(tokens_per_expert)
            out = grouped_swiglu(
                x, [e.linear_fc1.weight for e in self.local_experts],
                [e.linear_fc2.weight for e in self.local_experts], counts, permuted_probs)
            return out, None

    return GroupedExperts
