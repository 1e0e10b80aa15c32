"""Value loss (plain and clipped) and explained variance, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import value_loss as VL

NAN, INF = float("nan"), float("inf")


def test_unclipped_by_hand() -> None:
    # Prompt token (NaN everywhere), then V [1, 3] against R [2, 0]:
    #   loss [0.5 * 1, 0.5 * 9] = [0.5, 4.5]; d loss / d V = V - R = [-1, 3].
    values = torch.tensor([[NAN, 1.0, 3.0]], requires_grad=True)
    returns = torch.tensor([[NAN, 2.0, 0.0]])
    mask = torch.tensor([[0, 1, 1]])
    loss, metrics = VL.value_loss(values, torch.full((1, 3), NAN), returns, mask, None)
    torch.testing.assert_close(loss, torch.tensor([[0.0, 0.5, 4.5]]))
    assert metrics == {"vf_clipfrac": 0.0}
    loss.sum().backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.0, 3.0]]))


def test_clipped_by_hand() -> None:
    # clip 0.5, old_values 1 -> V_clipped in [0.5, 1.5]. Per token, max(unclipped, clipped):
    #   t0: V 1.2, R 2:  0.5 * 0.8^2 = 0.32;  V_c = 1.2 (inside) -> 0.32   grad V - R = -0.8
    #   t1: V 2.0, R 2:  0;         V_c = 1.5 -> 0.5 * 0.5^2 = 0.125  clipped, grad 0
    #   t2: V 0.0, R 2:  0.5 * 4 = 2;   V_c = 0.5 -> 0.5 * 1.5^2 = 1.125  -> 2, grad -2
    #   t3: V 3.0, R 0:  0.5 * 9 = 4.5; V_c = 1.5 -> 1.125               -> 4.5, grad 3
    #   t4: V -1, R -2:  0.5 * 1 = 0.5; V_c = 0.5 -> 0.5 * 2.5^2 = 3.125 clipped, grad 0
    #   t5: padding: NaN value, inf old value and target -> 0, grad 0
    # vf_clipfrac = 2 / 5 (t5 does not count).
    values = torch.tensor([[1.2, 2.0, 0.0, 3.0, -1.0, NAN]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, INF]])
    returns = torch.tensor([[2.0, 2.0, 2.0, 0.0, -2.0, INF]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, metrics = VL.value_loss(values, old, returns, mask, 0.5)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.125, 2.0, 4.5, 3.125, 0.0]]))
    assert metrics["vf_clipfrac"] == pytest.approx(0.4)
    loss.sum().backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[-0.8, 0.0, -2.0, 3.0, 0.0, 0.0]]))


def test_clipping_bounds_the_update_at_random() -> None:
    # Invariant: a token gets zero gradient iff its value moved more than clip away from
    # old_values and the clipped error is the larger; every other token gets V - R.
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 64, generator=gen, dtype=torch.float64)
    values = (old + torch.randn(4, 64, generator=gen, dtype=torch.float64)).requires_grad_()
    returns = torch.randn(4, 64, generator=gen, dtype=torch.float64)
    loss, metrics = VL.value_loss(values, old, returns, torch.ones(4, 64), 0.2)
    loss.sum().backward()
    v = values.detach()
    v_clipped = old + (v - old).clamp(-0.2, 0.2)
    frozen = ((v - old).abs() > 0.2) & ((v_clipped - returns).abs() > (v - returns).abs())
    assert values.grad is not None
    assert (values.grad[frozen] == 0).all()
    torch.testing.assert_close(values.grad[~frozen], (v - returns)[~frozen])
    assert 0 < frozen.sum() < frozen.numel()  # both kinds occur in this draw
    assert metrics["vf_clipfrac"] == pytest.approx(frozen.double().mean().item())
    # Without clipping the loss is the plain squared error everywhere, and never smaller.
    plain, _ = VL.value_loss(v, old, returns, torch.ones(4, 64), None)
    assert (loss >= plain).all()
    torch.testing.assert_close(plain, 0.5 * (v - returns).square())


def test_empty_mask_and_integer_targets() -> None:
    loss, metrics = VL.value_loss(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3),
                                  torch.zeros(2, 3), 0.2)
    assert loss.abs().max().item() == 0.0 and metrics["vf_clipfrac"] == 0.0
    # Integer returns are promoted: 0.5 * (0.5 - 1)^2 = 0.125.
    loss, _ = VL.value_loss(torch.tensor([[0.5]]), torch.tensor([[0.5]]), torch.tensor([[1]]),
                            torch.ones(1, 1), None)
    assert loss.dtype == torch.float32 and loss.item() == 0.125


def test_value_loss_rejects_bad_clip_and_shapes() -> None:
    good, bad, mask = torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="clip"):
        VL.value_loss(good, good, good, mask, 0.0)
    for name, args in [("values", (bad, good, good, mask)),
                       ("old_values", (good, bad, good, mask)),
                       ("returns", (good, good, bad, mask)),
                       ("mask", (good, good, good, torch.ones(6)))]:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            VL.value_loss(*args, 0.2)


def test_explained_variance_by_hand() -> None:
    # Masked-in R [1, 2, 3, 4] (over two rows, after a prompt, before padding), V [1, 2, 3, 3]:
    #   R - V = [0, 0, 0, 1]: mean 1/4, Var = (3 * 1/16 + 9/16) / 4 = 0.1875
    #   R: mean 2.5, Var = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    #   EV = 1 - 0.1875 / 1.25 = 0.85
    values = torch.tensor([[NAN, 1.0, 2.0], [3.0, 3.0, INF]])
    returns = torch.tensor([[INF, 1.0, 2.0], [3.0, 4.0, NAN]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    assert VL.explained_variance(values, returns, mask) == pytest.approx(0.85)


def test_explained_variance_landmarks() -> None:
    gen = torch.Generator().manual_seed(1)
    returns = torch.randn(3, 8, generator=gen)
    mask = torch.ones(3, 8)
    assert VL.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    # Predicting the batch mean explains nothing; worse than that is negative.
    mean = torch.full_like(returns, returns.mean().item())
    assert VL.explained_variance(mean, returns, mask) == pytest.approx(0.0, abs=1e-6)
    assert VL.explained_variance(-returns, returns, mask) == pytest.approx(-3.0)


def test_explained_variance_is_nan_without_spread() -> None:
    # Var[R] = 0 leaves the ratio undefined: NaN, not a made-up 0 or 1. Three equal returns
    # of 0.1 are a case where the float variance would be a rounding error above 0.
    values = torch.tensor([[0.0, 0.5, 7.0]])
    assert math.isnan(VL.explained_variance(values, torch.full((1, 3), 0.1), torch.ones(1, 3)))
    one_token = torch.tensor([[0, 1, 0]])
    assert math.isnan(VL.explained_variance(values, torch.tensor([[1.0, 2.0, 3.0]]), one_token))
    assert math.isnan(VL.explained_variance(values, values, torch.zeros(1, 3)))
    with pytest.raises(ValueError, match="returns"):
        VL.explained_variance(values, torch.zeros(3), torch.ones(1, 3))
