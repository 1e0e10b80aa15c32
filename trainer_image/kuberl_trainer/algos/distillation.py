"""On-policy distillation: the student samples, the teacher grades every token.

The signal per sampled token is how much more likely the teacher finds it than the student::

    A_t = log pi_teacher(x_t | x_<t) - log pi_student(x_t | x_<t)

the negative of a one-sample estimate of the per-token reverse KL(student || teacher) (Agarwal
et al. 2024, "On-policy distillation of language models" (GKD); Lu et al. 2025, Thinking
Machines, "On-policy distillation"). Used as per-token advantages in the policy-gradient loss
it lowers the reverse KL on the student's own samples - mode-seeking, and dense where a
verifier's reward is one bit per response. Each token is graded on its own (discount 0, the
published recipe; the return-to-go would be the exact sequence-level gradient, at more
variance). The signal is dense but high-variance: on the tiny job only small learning rates
are stable (bench/RESULTS.md, bench/distill_lr.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_advantages(teacher_logp: Tensor, student_logp: Tensor,
                          mask: Tensor) -> tuple[Tensor, float]:
    """``(advantages [B, T], reverse_kl)``: the per-token advantages (0 off ``mask``), and the
    token-mean estimate of KL(student || teacher) they imply (a metric: it should fall).

    Args:
        teacher_logp: ``[B, T]`` the teacher's log-probs of the sampled tokens.
        student_logp: ``[B, T]`` the student's, at sampling time (the engines' log-probs).
        mask: ``[B, T]`` 1 on response tokens.
    """
    if not teacher_logp.shape == student_logp.shape == mask.shape:
        raise ValueError(f"teacher_logp {tuple(teacher_logp.shape)}, student_logp "
                         f"{tuple(student_logp.shape)} and mask {tuple(mask.shape)} must match")
    on = mask.bool()
    adv = torch.where(on, teacher_logp - student_logp, torch.zeros_like(teacher_logp)).float()
    n = max(float(on.sum()), 1.0)
    reverse_kl = float(-adv.sum()) / n
    # A constant baseline: E[grad log pi] = 0 at every position, so subtracting the batch mean
    # leaves the gradient unbiased, and without it the mostly negative advantages push
    # probability off every sampled token at once (onto tokens neither model wants).
    centred = torch.where(on, adv - float(adv.sum()) / n, torch.zeros_like(adv))
    return centred, reverse_kl
