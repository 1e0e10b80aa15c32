"""The learning-rate schedule (algorithm.lrWarmupSteps / lrDecayStyle / minLrRatio) against
values computed by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.optim import (
    LrMultiplier,
    OptimConfig,
    build_optimizer,
    build_scheduler,
    optim_config,
)


def test_linear_warmup_then_constant() -> None:
    m = LrMultiplier(warmup_steps=4, decay_steps=None, min_lr_ratio=0.0)
    assert [m(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_to_the_floor_after_warmup() -> None:
    m = LrMultiplier(warmup_steps=2, decay_steps=4, min_lr_ratio=0.2)
    # warmup 0.5, 1.0; then 1 - 0.8 * progress for progress 0, 1/4, 1/2, 3/4, 1; then floor
    expected = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert [m(s) for s in range(8)] == pytest.approx(expected)


def test_cosine_decay() -> None:
    m = LrMultiplier(warmup_steps=0, decay_steps=4, min_lr_ratio=0.0, decay_style="cosine")
    expected = [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2,
                0.0, 0.0]
    assert [m(s) for s in range(6)] == pytest.approx(expected, abs=1e-12)
    floor = LrMultiplier(warmup_steps=0, decay_steps=2, min_lr_ratio=0.1, decay_style="cosine")
    assert floor(1) == pytest.approx(0.1 + 0.9 * 0.5) and floor(2) == pytest.approx(0.1)


def spec(**algorithm: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": "/models/m"},
        "data": {"prompts": "/data/p.jsonl", "rolloutBatchSize": 4, "nSamplesPerPrompt": 8},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": 4,
                     "globalBatchSize": 16},
        "rollout": {"engine": "reference"},  # on CPU
        "schedule": {"numRollouts": 10},
        "algorithm": {"lr": 1e-3, **algorithm},
    })


def test_optim_config_spans_the_runs_optimizer_steps() -> None:
    # 32 samples per rollout / globalBatchSize 16 = 2 optimizer steps, x 10 rollouts = 20
    config = optim_config(spec(lrWarmupSteps=5, lrDecayStyle="cosine", minLrRatio=0.1))
    assert config == OptimConfig(warmup_steps=5, decay_steps=15, min_lr_ratio=0.1,
                                 decay_style="cosine")
    assert optim_config(spec()).decay_steps is None  # constant: no decay
    assert optim_config(spec(lrWarmupSteps=3)).warmup_steps == 3


def test_scheduler_drives_adamw_lr() -> None:
    config = optim_config(spec(lrWarmupSteps=2, lrDecayStyle="linear"))  # decay over 18
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], 1e-3, config)
    sched = build_scheduler(opt, config)
    seen = []
    for _ in range(21):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:3] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert seen[11] == pytest.approx(1e-3 * (1 - 9 / 18))
    assert seen[20] == pytest.approx(0.0, abs=1e-12)


def test_spec_rejects_bad_schedule_values() -> None:
    with pytest.raises(ValueError, match="minLrRatio"):
        spec(minLrRatio=1.5)
    with pytest.raises(ValueError, match="lrDecayStyle"):
        spec(lrDecayStyle="exponential")
    with pytest.raises(ValueError, match="lrWarmupSteps"):
        spec(lrWarmupSteps=-1)


def test_cpu_parameters_get_the_per_parameter_loop() -> None:
    """The loop (numerically identical across parameter layouts) wherever the fused CUDA
    kernel does not apply; plain CUDA tensors get fused=True (checked on GPUs:
    bench/fsdp_backend_check.py, bench/gpu_loop.py)."""
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3, OptimConfig())
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
