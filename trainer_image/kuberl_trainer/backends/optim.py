"""Optimizer, learning-rate schedule and gradient clipping shared by the backends.

The RLJob spec carries the learning rate and its schedule (``algorithm.lr``,
``lrWarmupSteps``, ``lrDecayStyle``, ``minLrRatio``); the AdamW settings are fixed defaults
here, chosen to match what the common RL post-training stacks ship (verl's FSDP actor, slime's
Megatron defaults), so that results are comparable with theirs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from kuberl_api.spec import RLJobSpec

# Clip the global gradient L2 norm to 1.0 before every optimizer step: the de-facto standard
# of RL post-training stacks (slime --clip-grad, verl grad_clip, OpenRLHF max_norm all default
# to 1.0). A rollout with extreme advantages otherwise produces one huge step.
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and schedule settings beyond the spec's ``lr``.

    betas (0.9, 0.999), eps 1e-8: PyTorch's and verl's defaults. With the tiny learning
        rates of RL fine-tuning (1e-6) the slower second-moment decay of 0.999 (vs the 0.95
        of pre-training recipes) keeps steps smooth across noisy rollouts.
    weight_decay 0.01, on every parameter: verl's default. At lr 1e-6 its pull is ~1e-8 per
        step, so it only matters for long runs; it is applied uniformly (no norm/bias
        exclusion) because the runs are short relative to pre-training.
    warmup_steps: linear warmup from lr/warmup_steps to lr over the first optimizer steps
        (0 = none; RL starts from a converged SFT model, so the default is a constant lr).
    decay_steps / min_lr_ratio / decay_style: optional decay (linear or cosine) to
        ``lr * min_lr_ratio`` over ``decay_steps`` optimizer steps after warmup (None =
        constant after warmup).
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    decay_style: str = "linear"


def optim_config(spec: RLJobSpec) -> OptimConfig:
    """The schedule the spec asks for. Decay spans the run's optimizer steps after warmup:
    ``numRollouts`` rollouts of ``samples / globalBatchSize`` optimizer steps each."""
    algo = spec.algorithm
    per_rollout = (spec.data.rollout_batch_size * spec.data.n_samples_per_prompt
                   // spec.global_batch_size)
    total = spec.schedule.num_rollouts * per_rollout
    decays = algo.lr_decay_style != "constant"
    return OptimConfig(warmup_steps=algo.lr_warmup_steps,
                       decay_steps=max(1, total - algo.lr_warmup_steps) if decays else None,
                       min_lr_ratio=algo.min_lr_ratio,
                       decay_style="cosine" if algo.lr_decay_style == "cosine" else "linear")


@dataclass(frozen=True)
class LrMultiplier:
    """``step -> lr multiplier`` for LambdaLR: linear warmup, then constant or linear decay.

    A dataclass rather than a closure so LambdaLR can save and restore it in state_dict.
    """

    warmup_steps: int
    decay_steps: int | None
    min_lr_ratio: float
    decay_style: str = "linear"  # or "cosine": half a cosine period from 1 to min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.decay_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        left = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay_style == "cosine" \
            else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * left


def build_optimizer(params: Iterable[Tensor], lr: float,
                    config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params``: torch's fused kernel when they are all plain CUDA tensors
    (single GPU, DDP), else the per-parameter loop (CPU, FSDP2's DTensors).

    The loop launches about ten kernels per tensor: at the Qwen2.5-1.5B shape on an H200
    that was 45 ms of a 0.6 s step (bench/RESULTS.md), the fused kernel a few launches in
    all. On CPU the loop stays: it is numerically identical across parameter layouts (DDP
    vs single process), which the CPU equivalence tests rely on."""
    params = list(params)
    fused = all(p.is_cuda and not _is_dtensor(p) for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay,
                             **({"fused": True} if fused else {"foreach": False}))


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    return LambdaLR(optimizer, LrMultiplier(config.warmup_steps, config.decay_steps,
                                            config.min_lr_ratio, config.decay_style))


def clip_gradients(params: Iterable[Tensor], max_norm: float = MAX_GRAD_NORM) -> float:
    """Clip the global grad norm in place; returns the norm before clipping.

    Under FSDP2 the norm comes back as a DTensor; ``full_tensor`` reduces it across ranks.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
