"""A gradient norm without a host sync per parameter, where megatron-core has no fused one.

megatron-core computes the global gradient norm (for clipping) with Transformer Engine's or
Apex's multi-tensor L2 norm. With neither installed it falls back to
``megatron.core.utils.local_multi_tensor_l2_norm``, which builds a CPU tensor from one CUDA
scalar per parameter: a host sync for each (198 a step on the Qwen2.5-1.5B shape, measured with
``bench/megatron_throughput.py --sync-sites``). ``torch._foreach_norm`` gives the same norms
in a few kernels and no sync; this swaps it in for that fallback only. The trainer image has
Transformer Engine, and then nothing is changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def foreach_l2_norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[Tensor, None]:
    """Drop-in for megatron's ``local_multi_tensor_l2_norm`` (same arguments, same result:
    ``([L2 norm of every tensor of tensor_lists[0] together] float32, None)``), on the device,
    without reading anything back to the host."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms: megatron's clipping never asks for them")
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def use_sync_free_grad_norm() -> bool:
    """Replace megatron-core's local fallback norm with ``foreach_l2_norm``; True if it was
    the fallback (no Transformer Engine, no Apex), False if a fused one is in use."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    return True
