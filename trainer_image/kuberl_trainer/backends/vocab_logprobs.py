"""Per-token log-probs and entropy over a large vocabulary, without a float32 copy of the logits.

Both backends need, for every token, ``log softmax(logits / T)[target]`` and the entropy of
that softmax. Done the obvious way (``logits.float() / T``, ``log_softmax``, ``gather``) every
step holds float32 ``[tokens, vocab]`` tensors for backward: with Qwen's 151,936-token vocabulary
that is 0.6 MB a token, and the passes over it cost 110-150 ms of GPU time per step (issue 17).
Here the softmax is reduced to three numbers a row and the gradient is recomputed from the
logits the model already keeps:

- forward, over chunks of rows: the row max (a shift for stability), then in float32
  ``sum exp(x - max)`` -> logsumexp, ``sum exp(x - max) * (x - max)`` -> the mean logit under
  p, and the target's logit; ``logp = x_t - lse``, ``entropy = lse - E_p[x]``;
- backward, chunk by chunk into one gradient tensor in the logits' dtype:
  ``dlogp/dx_j = [j = t] - p_j`` and ``dH/dx_j = -p_j (x_j - E_p[x])``.

What stays alive for backward is the logits (the model's output, alive anyway in the graph of
the output layer) and four floats a row. On CUDA the chunk functions are compiled
(``torch.compile``: Inductor fuses each into a kernel that reads bf16 and never writes the
float32 intermediates); on CPU they run eagerly over chunks small enough to bound the float32
temporaries. Both compute the same expressions.

Tensor parallelism. Megatron's output layer is column-parallel: each TP rank holds a
contiguous slice of the (padded) vocabulary. The row max is MAX-all-reduced, the three sums
SUM-all-reduced (one call), so no rank ever gathers the full logits. Every TP rank then computes
the same loss from the same reduced values, so the gradient of a rank's logits needs only its
own columns and the reduced statistics: backward communicates nothing (the identity of
Megatron's "reduce from tensor-parallel region"). Megatron pads the vocabulary to a multiple of
``128 * tp``; columns at or past ``vocab_size`` are masked to -inf, so they take no mass.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LOG = logging.getLogger(__name__)

# Elements of one chunk's float32 temporaries on the eager path (64 MiB each): the CPU tiny
# models fit one chunk; a 152k vocabulary takes ~110 rows a chunk.
EAGER_CHUNK_ELEMENTS = 1 << 24
# The compiled kernels keep no float32 temporaries; chunks only bound int32 indexing.
COMPILED_CHUNK_ELEMENTS = 1 << 30
# KUBERL_COMPILE_LOGPROBS=0 runs the eager path on CUDA too (to compare, or where Triton is
# missing).
COMPILE_ENV = "KUBERL_COMPILE_LOGPROBS"


def _masked(x: Tensor, real: int) -> Tensor:
    """``x`` with the padding columns (local index >= real) at -inf."""
    if real >= x.shape[-1]:
        return x
    cols = torch.arange(x.shape[-1], device=x.device)
    return x.masked_fill(cols >= real, float("-inf"))


def _scaled(logits: Tensor, inv_temp: float, real: int) -> Tensor:
    x = logits.float()  # (a no-op on float32 logits)
    return _masked(x if inv_temp == 1.0 else x * inv_temp, real)


def chunk_max(logits: Tensor, inv_temp: float, real: int) -> Tensor:
    """``[C]`` max of each row's real, temperature-scaled logits (float32)."""
    return _scaled(logits, inv_temp, real).amax(dim=-1)


def chunk_sums(logits: Tensor, index: Tensor, shift: Tensor, inv_temp: float,
               real: int) -> Tensor:
    """``[C, 3]``: ``sum exp(xs)``, ``sum exp(xs) * xs`` and ``xs[index]`` (0 where ``index``
    is -1: the target is on another rank), with ``xs = x - shift``, per row."""
    xs = _scaled(logits, inv_temp, real) - shift.unsqueeze(-1)
    exp = xs.exp()
    # exp * xs is 0 * -inf = nan on padding; those terms are 0 (no mass there).
    weighted = (exp * xs.masked_fill(exp == 0, 0.0)).sum(dim=-1)
    owned = index >= 0
    picked = xs.gather(-1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.stack([exp.sum(dim=-1), weighted, torch.where(owned, picked, 0.0)], dim=-1)


def chunk_grad(logits: Tensor, index: Tensor, shift: Tensor, log_total: Tensor, mean: Tensor,
               g_logp: Tensor, g_ent: Tensor | None, inv_temp: float, real: int) -> Tensor:
    """``[C, V]`` gradient w.r.t. the logits, in their dtype: ``g_logp * ([j = t] - p_j) -
    g_ent * p_j * (xs_j - mean)``, times ``inv_temp`` (the logits were scaled by it).
    ``g_ent`` None: the entropy was not trained on (its term is skipped, not multiplied by 0)."""
    xs = _scaled(logits, inv_temp, real) - shift.unsqueeze(-1)
    p = (xs - log_total.unsqueeze(-1)).exp()                    # 0 on padding
    cols = torch.arange(logits.shape[-1], device=logits.device)
    target = (cols == index.unsqueeze(-1)).to(p.dtype)
    grad = g_logp.unsqueeze(-1) * (target - p)
    if g_ent is not None:
        centred = (xs - mean.unsqueeze(-1)).masked_fill(p == 0, 0.0)  # no -inf * 0
        grad = grad - g_ent.unsqueeze(-1) * p * centred
    if inv_temp != 1.0:
        grad = grad * inv_temp
    return grad.to(logits.dtype)


Kernels = tuple[Callable[..., Tensor], Callable[..., Tensor], Callable[..., Tensor]]


def _rows_dynamic(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` compiled once for any number of rows but for its vocabulary width: a chunk's
    row count varies (the last chunk, every micro-batch), the width never does, and a width
    known at compile time lets Inductor pick its reduction tiling for it."""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args: Any) -> Tensor:
        for arg in args:
            if isinstance(arg, Tensor):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
                if arg.dim() == 2:
                    torch._dynamo.mark_static(arg, 1)
        return compiled(*args)

    return call


@functools.cache
def _compiled(device: torch.device) -> Kernels | None:
    """The chunk functions compiled for ``device``, or None when compiling is off or fails
    (then the eager path serves, with a warning: it is correct, only slower). Compiling is
    lazy, so a tiny probe runs each kernel once here: a missing Triton or compiler shows up
    now, not in the middle of a train step."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return None
    kernels = tuple(_rows_dynamic(fn) for fn in (chunk_max, chunk_sums, chunk_grad))
    try:
        x = torch.zeros(2, 8, dtype=torch.bfloat16, device=device)
        index, row = torch.zeros(2, dtype=torch.long, device=device), torch.zeros(2, device=device)
        kernels[0](x, 1.0, 8)
        kernels[1](x, index, row, 1.0, 8)
        kernels[2](x, index, row, row, row, row, row, 1.0, 8)
    except Exception as exc:
        LOG.warning("log-prob kernels not compiled (%s: %s); running them eagerly",
                    type(exc).__name__, exc)
        return None
    return kernels  # type: ignore[return-value]


def _kernels(logits: Tensor) -> tuple[Kernels, int]:
    compiled = _compiled(logits.device) if logits.is_cuda else None
    if compiled is not None:
        return compiled, COMPILED_CHUNK_ELEMENTS
    return (chunk_max, chunk_sums, chunk_grad), EAGER_CHUNK_ELEMENTS


def _row_chunks(rows: int, width: int, elements: int) -> list[slice]:
    step = max(1, elements // max(width, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _TokenStats(torch.autograd.Function):
    """``(logp, entropy)`` of flattened ``logits[N, V_local]``; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor, inv_temp: float, real: int,
                group: ProcessGroup | None) -> tuple[Tensor, Tensor]:
        (k_max, k_sums, _), elements = _kernels(logits)
        chunks = _row_chunks(logits.shape[0], logits.shape[1], elements)
        if len(chunks) == 1:  # (no buffers to fill: small inputs pay no extra copies)
            shift = k_max(logits, inv_temp, real)
        else:
            shift = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
            for rows in chunks:
                shift[rows] = k_max(logits[rows], inv_temp, real)
        if group is not None:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        if len(chunks) == 1:
            sums = k_sums(logits, index, shift, inv_temp, real)
        else:
            sums = torch.empty(logits.shape[0], 3, dtype=torch.float32, device=logits.device)
            for rows in chunks:
                sums[rows] = k_sums(logits[rows], index[rows], shift[rows], inv_temp, real)
        if group is not None:
            dist.all_reduce(sums, group=group)
        total, weighted, picked = sums.unbind(dim=-1)
        log_total = total.log()            # logsumexp of the shifted logits
        mean = weighted / total            # E_p[x - shift]
        ctx.save_for_backward(logits, index, shift, log_total, mean)
        ctx.inv_temp, ctx.real = inv_temp, real
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return picked - log_total, log_total - mean

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None
                 ) -> tuple[Tensor | None, None, None, None, None]:
        logits, index, shift, log_total, mean = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        g_logp = torch.zeros_like(shift) if g_logp is None else g_logp.float()
        g_ent = None if g_ent is None else g_ent.float()
        (_, _, k_grad), elements = _kernels(logits)
        chunks = _row_chunks(logits.shape[0], logits.shape[1], elements)
        if len(chunks) == 1:  # the kernel's output is the gradient: no second copy of it
            grad = k_grad(logits, index, shift, log_total, mean, g_logp, g_ent, ctx.inv_temp,
                          ctx.real)
            return grad, None, None, None, None
        grad = torch.empty_like(logits)
        for rows in chunks:
            grad[rows] = k_grad(logits[rows], index[rows], shift[rows], log_total[rows],
                                mean[rows], g_logp[rows], None if g_ent is None else g_ent[rows],
                                ctx.inv_temp, ctx.real)
        return grad, None, None, None, None


def _communicates(group: ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, *, vocab_start: int = 0,
                               group: ProcessGroup | None = None,
                               vocab_size: int | None = None,
                               temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and entropy of the full softmax of ``logits / temperature``.

    Args:
        logits: ``[..., V_local]``, this rank's columns: global ids ``vocab_start`` ..
            ``vocab_start + V_local - 1``. Any float dtype (bf16 from the model); the
            arithmetic is float32 and the gradient comes back in this dtype.
        targets: ``[...]`` long, global token ids (below ``vocab_size``).
        vocab_start: the global id of this rank's first column; 0 without a group.
        group: the tensor-parallel group the vocabulary is split over. None or a group of
            one: the slice is the whole vocabulary and nothing is communicated.
        vocab_size: the real vocabulary size; columns with global id ``>= vocab_size`` are
            padding and get no probability. None: every column is real.
        temperature: the sampling temperature (SGLang reports log-probs of the scaled
            distribution, and the PPO ratio must compare like with like).

    Returns:
        ``(logp, entropy)``, both ``[...]`` float32, differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    distributed = _communicates(group)
    local = logits.shape[-1]
    if not distributed and vocab_start != 0:
        raise ValueError(f"vocab_start is {vocab_start} but without a tensor-parallel group "
                         "the logits must hold the whole vocabulary (vocab_start 0)")
    real = local if vocab_size is None else min(max(vocab_size - vocab_start, 0), local)
    if not distributed and real == 0:
        raise ValueError(f"vocab_size {vocab_size}: no real column in the logits")

    flat = logits.reshape(-1, local)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    index = (targets.reshape(-1) - vocab_start).long()
    # -1: the target is another rank's column (or padding), picked there, 0 here.
    index = torch.where((index >= 0) & (index < real), index, -1)
    logp, entropy = _TokenStats.apply(flat, index, 1.0 / temperature, real,
                                      group if distributed else None)
    return logp.view(targets.shape), entropy.view(targets.shape)
