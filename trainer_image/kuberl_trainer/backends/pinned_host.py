"""One host buffer, pinned at exactly its size, that holds many storages' bytes side by side.

torch's pinned-memory allocator (CachingHostAllocator) rounds every request up to the next
power of two (no rounding threshold by default; `pinned_use_cuda_host_register` changes how the
rounded size is pinned, not the size). One pinned tensor per storage would pin up to twice the
data: a 7B model's 272 MB MLP matrices take 512 MiB each, 85 GiB of weights and Adam state
~162 GiB. One buffer from that allocator would round the sum likewise (85 GiB to 128 GiB). So
the buffer here is plain host memory that `cudaHostRegister` pins: exactly the bytes asked for.

`packed_layout` is the arithmetic (pure; tested on CPU); `HostBuffer` owns the memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

ALIGN = 512  # each storage starts at a multiple: DMA-friendly copies, <512 B lost per storage


def packed_layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Each size's offset in one buffer (in order, each at a multiple of `align`) and the
    buffer's size: the end of the last one, not rounded further."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + size
    return offsets, end


class HostBuffer:
    """`nbytes` of host memory; pinned (page-locked, for asynchronous copies with the GPU)
    when `pin`. The pin lasts as long as this object: dropping it unregisters the memory
    before it is freed."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        # The whole allocation is registered, from its start: torch's is_pinned (and so any
        # check of a view of it) asks CUDA about the storage's base address.
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.pinned = pin and nbytes > 0
        if self.pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            ptr = self.tensor.data_ptr()
            torch.cuda.check_error(cudart.cudaHostRegister(ptr, nbytes, 0))
            # (not at interpreter exit: the process's end frees it, and CUDA may be gone)
            weakref.finalize(self, _unregister, ptr, self.tensor).atexit = False

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes if self.pinned else 0

    def views(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[Tensor]:
        """Byte tensors over the buffer, one per (offset, size)."""
        return [self.tensor[o:o + n] for o, n in zip(offsets, sizes, strict=True)]


def _unregister(ptr: int, raw: Tensor) -> None:
    """Unpin `ptr`: `raw`, the memory under it, is an argument so that the finalizer holds it
    until this has run."""
    torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
