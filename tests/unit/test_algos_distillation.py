"""On-policy distillation's per-token signal, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import distillation


def test_reverse_kl_advantages_by_hand() -> None:
    # Row 0: prompt, then tokens the teacher likes more (+ln2) and less (-ln4) than the
    # student; row 1: one token, equal (0); padding holds -inf in the teacher's log-probs.
    # Raw: [ln2, -ln4, 0] -> reverse KL = -(ln2 - ln4 + 0) / 3 = ln2 / 3; the advantages are
    # centred on the batch mean (-ln2 / 3): [ln2 + ln2/3, -ln4 + ln2/3, ln2/3].
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    student = torch.tensor([[0.0, math.log(0.25), math.log(0.5)], [0.0, -1.0, 0.0]])
    teacher = torch.tensor([[0.0, math.log(0.5), math.log(0.125)], [0.0, -1.0, -math.inf]])
    adv, rkl = distillation.reverse_kl_advantages(teacher, student, mask)
    ln2 = math.log(2)
    assert rkl == pytest.approx(ln2 / 3)
    torch.testing.assert_close(adv, torch.tensor([[0.0, ln2 + ln2 / 3, -2 * ln2 + ln2 / 3],
                                                  [0.0, ln2 / 3, 0.0]]))
    assert abs(float(adv[mask.bool()].sum())) < 1e-6


def test_identical_models_give_no_signal() -> None:
    logp = torch.log(torch.rand(3, 5))
    adv, rkl = distillation.reverse_kl_advantages(logp, logp.clone(), torch.ones(3, 5))
    assert rkl == 0.0 and torch.count_nonzero(adv) == 0


def test_shapes_checked() -> None:
    with pytest.raises(ValueError, match="must match"):
        distillation.reverse_kl_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
