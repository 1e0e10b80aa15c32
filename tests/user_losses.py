"""Custom policy losses as a user writes them (`algorithm.policyLoss: custom`,
`lossFunction: tests.user_losses:<name>`), for the unit and learning tests.

`ppo_clip` is PPO's clipped surrogate written from the paper's formula, independently of
kuberl's own (kuberl_trainer.algos.policy_loss): the tests compare the two. It uses only
the attributes of its input, no kuberl import, as a user's loss may. The rest are broken on
purpose: each must be refused before the job starts."""

from __future__ import annotations

from typing import Any

import torch


def ppo_clip(inp: Any, *, eps_low: float = 0.2, eps_high: float = 0.2
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = pi / pi_old; reports the
    fraction of response tokens where the clipped term is the smaller one (no gradient)."""
    ratio = torch.exp(inp.logp - inp.old_logp)
    surrogate = ratio * inp.advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * inp.advantages
    on = inp.mask > 0
    clipfrac = ((clipped < surrogate) & on).sum() / on.sum().clamp(min=1)
    return -torch.min(surrogate, clipped), {"clipfrac": clipfrac}


def ppo_clip_flipped(inp: Any, **args: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ppo_clip with its sign flipped: it pushes down what earns reward."""
    loss, metrics = ppo_clip(inp, **args)
    return -loss, metrics


# ---------------------------------------------------------------- refused before the start

def summed_per_row(inp: Any) -> tuple[torch.Tensor, dict[str, float]]:
    return (-inp.advantages * inp.logp).sum(dim=1), {}


def not_finite(inp: Any) -> tuple[torch.Tensor, dict[str, float]]:
    return -inp.advantages * inp.logp + float("nan"), {}


def detached(inp: Any) -> tuple[torch.Tensor, dict[str, float]]:
    return (-inp.advantages * inp.logp).detach(), {}


def ignores_logp(inp: Any) -> tuple[torch.Tensor, dict[str, float]]:
    return -inp.advantages * inp.logp * 0.0, {}


def per_token_metric(inp: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inp.logp - inp.old_logp)
    return -ratio * inp.advantages, {"ratio": ratio.detach()}


def raises(inp: Any, *, scale: float) -> tuple[torch.Tensor, dict[str, float]]:
    raise RuntimeError(f"no loss at scale {scale}")


def no_pair(inp: Any) -> torch.Tensor:
    return -inp.advantages * inp.logp
