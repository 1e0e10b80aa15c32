"""The token mean, PPO clip and entropy against hand-computed values, through the pieces the
backends train on (aggregation, objective, and the entropy of backends/vocab_logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from kuberl_trainer.algos import aggregation
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.vocab_logprobs import token_logprobs_and_entropy

LN = math.log


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregation.aggregate(x, mask, "token-mean")


def ppo_clip(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             eps_clip: float, eps_clip_high: float | None = None, *,
             clip_c: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean PPO loss and its metrics, as the objective computes them."""
    obj = Objective(eps_clip=eps_clip, eps_clip_high=eps_clip_high, clip_c=clip_c)
    partial, metrics = obj.partial_loss(logp, old, adv, mask, entropy=torch.zeros_like(logp))
    return partial / max(obj.units(mask), 1.0), metrics


def entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long)
    return masked_mean(token_logprobs_and_entropy(logits, targets)[1], mask)


def test_masked_mean_by_hand() -> None:
    # Masked-in: 1, 2 (row 0) and 4 (row 1) -> 7 / 3.
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(7 / 3))


def test_masked_mean_ignores_nonfinite_padding_and_empty_mask() -> None:
    x = torch.tensor([[2.0, float("inf"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0]])
    out = masked_mean(x, mask)
    out.backward()
    assert out.item() == 2.0
    assert x.grad is not None and x.grad.tolist() == [[1.0, 0.0, 0.0]]
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


# Four response tokens and one padding token; eps_clip = 0.2 -> ratio kept in [0.8, 1.2].
#   t0: adv +1, ratio 1.5: max(-1.5, -1.2) = -1.2  clipped   (no gradient)
#   t1: adv +1, ratio 0.5: max(-0.5, -0.8) = -0.5  unclipped
#   t2: adv -1, ratio 0.5: max( 0.5,  0.8) =  0.8  clipped   (no gradient)
#   t3: adv -1, ratio 1.5: max( 1.5,  1.2) =  1.5  unclipped
#   t4: padding, old_logp = -inf (must not turn into NaN)
# loss = (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15; clipfrac = 2/4; ratio_mean = 4/4 = 1
# approx_kl = mean(old - new) = -(2 ln 1.5 + 2 ln 0.5) / 4 = -ln(0.75) / 2 = 0.143841
RATIOS = [1.5, 0.5, 0.5, 1.5, 1.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def _logps(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -2.0, dtype=torch.float64)
    new = (old + torch.tensor([[LN(r) for r in ratios]], dtype=torch.float64))
    return new.requires_grad_(True), old


def test_ppo_clip_by_hand() -> None:
    logp, old = _logps(RATIOS)
    old[0, 4] = float("-inf")
    loss, metrics = ppo_clip(logp, old, ADV, MASK, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.15)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["approx_kl"] == pytest.approx(-LN(0.75) / 2)
    # d loss / d logp = -adv * ratio / 4 on unclipped tokens, 0 on clipped ones and padding:
    #   t1: -1 * 0.5 / 4 = -0.125; t3: +1 * 1.5 / 4 = 0.375
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, 0.0, 0.375, 0.0]],
                                                       dtype=torch.float64))


def test_clip_higher_is_asymmetric() -> None:
    # adv +1, ratio 1.25: symmetric 0.2 clips it at 1.2 (loss -1.2, no gradient); with
    # eps_clip_high 0.28 the bound is 1.28, so it stays unclipped (loss -1.25, grad -1.25).
    # adv -1, ratio 0.7: the lower bound 0.8 applies in both cases -> 0.8, no gradient.
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    logp, old = _logps([1.25, 0.7])
    sym, sym_metrics = ppo_clip(logp, old, adv, mask, 0.2)
    assert sym.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert sym_metrics["pg_clipfrac"] == 1.0
    logp, old = _logps([1.25, 0.7])
    high, high_metrics = ppo_clip(logp, old, adv, mask, 0.2, eps_clip_high=0.28)
    high.backward()
    assert high.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert high_metrics["pg_clipfrac"] == 0.5
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25 / 2, 0.0]], dtype=torch.float64))


def test_dual_clip_caps_negative_advantage() -> None:
    # adv -1, ratio 5: PPO gives max(5, 1.2) = 5; dual clip with c = 3 caps it at 3
    # (no gradient). adv +1, ratio 1.0: untouched, -1.
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    logp, old = _logps([5.0, 1.0])
    loss, metrics = ppo_clip(logp, old, adv, torch.ones(1, 2), 0.2, clip_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 - 1.0) / 2)
    assert metrics["pg_clipfrac_lower"] == 0.5
    assert logp.grad is not None and logp.grad[0, 0].item() == 0.0
    plain, _ = ppo_clip(*_logps([5.0, 1.0]), adv, torch.ones(1, 2), 0.2)
    assert plain.item() == pytest.approx((5.0 - 1.0) / 2)


def test_on_policy_is_vanilla_policy_gradient() -> None:
    # ratio 1 everywhere: loss = -mean(adv) over the mask, gradient = -adv / n, nothing clipped.
    adv = torch.tensor([[0.5, -2.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    logp = torch.full((1, 3), -1.0, dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_clip(logp, logp.detach().clone(), adv, mask, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 - 2.0) / 2)
    assert {k: metrics[k] for k in ("pg_clipfrac", "ratio_mean", "approx_kl")} == {
        "pg_clipfrac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 1.0, 0.0]], dtype=torch.float64))


def test_clipped_tokens_get_no_gradient_at_random() -> None:
    # Invariant: a token has gradient iff its ratio is inside the bound on the side the
    # advantage pushes (adv > 0: ratio < 1 + high; adv < 0: ratio > 1 - low).
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    logp = (old + 0.5 * torch.randn(4, 32, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    loss, _ = ppo_clip(logp, old, adv, torch.ones(4, 32), 0.2, eps_clip_high=0.3)
    loss.backward()
    ratio = (logp - old).exp().detach()
    free = ((adv > 0) & (ratio < 1.3)) | ((adv < 0) & (ratio > 0.8))
    assert logp.grad is not None
    assert (logp.grad[~free] == 0).all() and (logp.grad[free] != 0).all()


def test_ppo_clip_rejects_bad_ranges() -> None:
    logp, old = _logps([1.0])
    with pytest.raises(ValueError, match="positive"):
        ppo_clip(logp, old, torch.ones(1, 1), torch.ones(1, 1), 0.0)
    with pytest.raises(ValueError, match="clip_c"):
        ppo_clip(logp, old, torch.ones(1, 1), torch.ones(1, 1), 0.2, clip_c=1.0)


def test_entropy_by_hand() -> None:
    # t0: uniform over 4 -> ln 4 = 1.386294
    # t1: logits [0, ln 3, -inf, -inf] -> p = [1/4, 3/4, 0, 0]
    #     H = 1/4 ln 4 + 3/4 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # t2: padding with huge logits (ignored)
    # mean over the 2 masked-in tokens = (1.386294 + 0.562335) / 2 = 0.974315
    neg_inf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],
                            [0.0, LN(3), neg_inf, neg_inf],
                            [1e4, -1e4, 0.0, 0.0]]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    h = entropy(logits, mask)
    expected = (LN(4) + 0.25 * LN(4) + 0.75 * LN(4 / 3)) / 2
    assert h.item() == pytest.approx(expected, rel=1e-6)
    h.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 0] == 0).all()  # uniform is the maximum: zero gradient


def test_entropy_is_stable_for_large_and_low_precision_logits() -> None:
    # Naive softmax overflows on 1000; two equal logits have entropy ln 2 whatever their size.
    big = torch.tensor([[[1000.0, 1000.0]]])
    assert entropy(big, torch.ones(1, 1)).item() == pytest.approx(LN(2))
    one_hot = torch.tensor([[[0.0, -1e9, -1e9]]], dtype=torch.bfloat16)
    h = entropy(one_hot, torch.ones(1, 1))
    assert h.dtype == torch.float32 and h.item() == 0.0
