"""The offload's host side (backends/pinned_host.py, backends/offload.py) on CPU: the kept
storages packed into one buffer of the summed sizes (not a power of two each, as torch's pinned
allocator would round them), each at an aligned offset, values surviving repeated round trips
through the same buffer. Pinning itself needs CUDA: bench/offload_pinned_check.py."""

from __future__ import annotations

import torch

from kuberl_trainer.backends.offload import Offload, Offloads
from kuberl_trainer.backends.pinned_host import ALIGN, HostBuffer, packed_layout

CPU = torch.device("cpu")
ODD = [1, 513, 4097, (1 << 16) + 3, 7, (1 << 20) + 1]  # bytes; just above powers of two


def test_layout_is_aligned_disjoint_and_exact() -> None:
    offsets, total = packed_layout(ODD)
    assert offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets)
    ends = [o + n for o, n in zip(offsets, ODD, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))  # disjoint
    assert total == ends[-1] < sum(ODD) + ALIGN * len(ODD)  # no rounding beyond alignment
    assert sum(1 << (n - 1).bit_length() for n in ODD) > 1.5 * total  # what rounding cost
    assert packed_layout([]) == ([], 0)
    assert packed_layout([512, 512, 3]) == ([0, 512, 1024], 1027)  # aligned sizes: no gaps


def test_host_buffer_on_cpu_is_plain_memory_of_the_exact_size() -> None:
    buffer = HostBuffer(12345, pin=False)
    assert buffer.tensor.numel() == 12345 and not buffer.pinned and buffer.pinned_bytes == 0
    a, b = buffer.views([0, 512], [5, 100])
    assert a.data_ptr() == buffer.tensor.data_ptr() and b.data_ptr() == a.data_ptr() + 512


def storages_of_odd_sizes() -> list[torch.Tensor]:
    """Tensors of several dtypes whose storages' byte counts are odd or just above 2^k."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in ODD] + [
        torch.randn(1025, generator=g), torch.randn(3, 333, generator=g).to(torch.bfloat16)]


def test_values_round_trip_through_one_buffer_at_their_offsets() -> None:
    tensors = storages_of_odd_sizes()
    want = [t.clone() for t in tensors]
    off = Offload(tensors, device=CPU)
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    assert off.host_bytes == packed_layout(sizes)[1]
    off.offload()
    assert off.buffer is not None and off.buffer.nbytes == off.host_bytes
    assert off.pinned_bytes == 0  # nothing pinned on CPU
    base = off.buffer.tensor.data_ptr()
    assert [h.data_ptr() - base for h in off.host] == off.offsets
    for host, t in zip(off.host, want, strict=True):  # each storage's bytes at its offset
        assert torch.equal(host, t.view(-1).view(torch.uint8))
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    off.onload()
    assert all(torch.equal(t, w) for t, w in zip(tensors, want, strict=True))


def test_the_buffer_is_reused_across_cycles_and_carries_the_new_values() -> None:
    tensors = storages_of_odd_sizes()
    parts = Offloads(device=CPU)
    buffer = None
    for cycle in range(3):
        for t in tensors:
            t.add_(1)  # new values each cycle: a stale copy would show
        want = [t.clone() for t in tensors]
        parts.offload("weights", tensors)
        part = parts.active["weights"]
        assert buffer is None or part.buffer is buffer, cycle  # not allocated again
        buffer = part.buffer
        parts.onload()
        assert all(torch.equal(t, w) for t, w in zip(tensors, want, strict=True)), cycle
    assert parts.pinned_bytes == 0


def test_a_larger_set_of_tensors_gets_a_larger_buffer() -> None:
    """The optimizer's state appears after the first step: its kind's next offload holds
    more, and the buffer held cannot take it."""
    small, more = torch.randn(10), torch.randn(1000)
    want = more.clone()
    parts = Offloads(device=CPU)
    parts.offload("optimizer", [small])
    first = parts.active["optimizer"].buffer
    parts.onload()
    parts.offload("optimizer", [small, more])
    part = parts.active["optimizer"]
    assert part.buffer is not first and part.buffer is not None
    assert part.buffer.nbytes == part.host_bytes == packed_layout([40, 4000])[1]
    parts.onload()
    assert torch.equal(more, want)


def test_reuse_does_not_take_the_buffer_of_an_offload_still_off() -> None:
    t = torch.randn(100)
    want = t.clone()
    first = Offload([t], device=CPU)
    first.offload()
    second = Offload([torch.randn(100)], device=CPU, reuse=first)
    assert second.buffer is None and first.buffer is not None  # still holding t's bytes
    first.onload()
    assert torch.equal(t, want)
