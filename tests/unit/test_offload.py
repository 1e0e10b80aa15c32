"""backends/offload.Offload on CPU tensors (the storage mechanics are the same on GPU; there
the freed bytes go back to the device): values, identities and training survive a round trip."""

from __future__ import annotations

import copy

import torch
from torch import nn

from kuberl_trainer.backends.offload import Offload, Offloads, optimizer_state

CPU = torch.device("cpu")


def test_values_views_and_identity_survive_and_storage_is_freed() -> None:
    buffer = torch.randn(100)
    a, b = buffer[:60].view(6, 10), buffer[60:]  # views of one storage (Megatron's buffers)
    param = nn.Parameter(torch.randn(4, 4))
    before = (buffer.clone(), param.detach().clone())
    off = Offload([a, b, param], device=CPU)
    assert off.bytes == 100 * 4 + 16 * 4  # one storage counted once
    off.offload()
    assert buffer.untyped_storage().nbytes() == 0 and param.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(buffer, before[0]) and torch.equal(param.detach(), before[1])
    assert a.data_ptr() == buffer.data_ptr() and torch.equal(b, before[0][60:])


def test_discarded_storage_comes_back_zeroed_and_kept_storage_shared_wins() -> None:
    grads = torch.ones(50)
    shared = torch.full((8,), 3.0)
    off = Offload([shared], discard=[grads, shared], device=CPU)
    off.offload()
    off.onload()
    assert torch.equal(grads, torch.zeros(50))
    assert torch.equal(shared, torch.full((8,), 3.0))  # in both lists: kept


def test_training_after_a_round_trip_matches_training_without_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, twin)]
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(4):
        for m, opt in zip((model, twin), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        off = Offload([*model.parameters(), *optimizer_state(opts[0])], device=CPU)
        assert step == 0 or off.bytes > sum(p.numel() * 4 for p in model.parameters())
        off.offload()
        off.onload()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_cpu_tensors_are_left_alone_by_default() -> None:
    t = torch.randn(10)
    off = Offload([t])  # only GPU tensors count unless a device is named
    off.offload()
    assert off.bytes == 0 and t.untyped_storage().nbytes() == 40


def test_offloads_reuse_host_buffers_and_skip_a_kind_already_off() -> None:
    weights, state = torch.randn(64), torch.randn(32)
    parts = Offloads(device=CPU)
    assert parts.offload("weights", [weights]) == 64 * 4
    buffer = parts.active["weights"].buffer
    assert buffer is not None
    assert parts.offload("weights", [weights]) == 0  # already off: not twice
    assert parts.offload("optimizer", [state]) == 32 * 4
    parts.onload()
    assert not parts.active and weights.untyped_storage().nbytes() == 64 * 4
    parts.offload("weights", [weights])
    assert parts.active["weights"].buffer is buffer  # the same pinned buffer, not a new one
    assert parts.active["weights"].host[0].data_ptr() == buffer.tensor.data_ptr()
    parts.onload()


def test_onload_of_one_kind_leaves_the_others_off() -> None:
    """A colocated sync reads the weights only: Adam's state stays in host memory, or it would
    take the room the engines' KV cache is about to resume into."""
    weights, state = torch.randn(64), torch.randn(32)
    want_w, want_s = weights.clone(), state.clone()
    parts = Offloads(device=CPU)
    parts.offload("optimizer", [state])
    parts.offload("weights", [weights])
    parts.onload(["weights"])
    assert list(parts.active) == ["optimizer"] and torch.equal(weights, want_w)
    assert state.untyped_storage().nbytes() == 0
    parts.onload()
    assert not parts.active and torch.equal(state, want_s)
