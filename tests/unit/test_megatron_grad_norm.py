"""The sync-free gradient norm (megatron/grad_norm.py) against torch's norm of all the
gradients together, by hand and on random tensors of several shapes."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.backends.megatron.grad_norm import foreach_l2_norm


def test_hand_computed() -> None:
    # sqrt(3^2 + 4^2 + 12^2) = 13
    norm, extra = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int),
                                  [[torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]], False)
    assert extra is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(13.0)


def test_matches_the_norm_of_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in [(7,), (3, 5), (2, 3, 4), (1,)]]
    norm, _ = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [grads], False)
    want = torch.cat([g.reshape(-1) for g in grads]).norm()
    torch.testing.assert_close(norm[0], want)


def test_no_tensors_is_zero_and_per_tensor_is_refused() -> None:
    flag = torch.zeros(1, dtype=torch.int)
    assert foreach_l2_norm(2048, flag, [[]], False)[0].tolist() == [0.0]
    with pytest.raises(NotImplementedError):
        foreach_l2_norm(2048, flag, [[torch.ones(2)]], True)
