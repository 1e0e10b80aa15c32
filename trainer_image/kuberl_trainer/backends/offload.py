"""Freeing a training rank's GPU memory between phases and restoring it (colocated placement).

While colocated engines generate, a training rank's weights, optimizer state and gradient
buffers would sit on the GPU the engines' pool needs. `Offload` keeps a set of tensors' bytes in
pinned host memory and frees their GPU storage, then brings them back.

It works on storages, not tensors: each storage is copied to the host and resized to 0 bytes
(the caching allocator gets the block back, and `torch.cuda.empty_cache()` returns it to the
device for the engine process), then resized and refilled. Every tensor, view and wrapper that
uses the storage (an nn.Parameter, the local shard inside an FSDP2 DTensor, Megatron's params
and grads, which are views of one contiguous buffer) keeps its identity, so optimizers, DDP
hooks and FSDP's bookkeeping need not know. (`module.to("cpu")` would replace parameters and
break such references; torch_memory_saver, which SGLang uses, pauses CUDA virtual memory
instead and needs its own CUDA build: the images here have none.) Storages whose contents need
not survive (gradient buffers, zeroed before the next use) are freed without a copy.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import Tensor

from kuberl_trainer.backends.pinned_host import HostBuffer, packed_layout


def _local(t: Tensor) -> Tensor:
    """The tensor holding a DTensor's local shard, or `t` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class Offload:
    """`keep`: tensors whose values must survive; `discard`: tensors whose storage may come
    back with any contents (they are zeroed). Only tensors on `device` count (a CPU rank has
    nothing to free), unless `device` is given explicitly for a test. `reuse`: an earlier
    Offload of the same tensors, not offloaded now, whose host buffer this one takes over
    (pinning tens of GB anew every step would cost seconds).

    The kept storages' bytes go into one host buffer (pinned_host.HostBuffer), each at an
    aligned offset: host memory pinned is the data plus < 512 B a storage, where a pinned
    tensor per storage would be rounded up to a power of two each."""

    def __init__(self, keep: Iterable[Tensor], discard: Iterable[Tensor] = (), *,
                 device: torch.device | None = None, reuse: Offload | None = None) -> None:
        self.keep = self._storages(keep, device)
        kept = {s.data_ptr() for s, _ in self.keep}
        self.discard = [(s, d) for s, d in self._storages(discard, device)
                        if s.data_ptr() not in kept]
        self.nbytes = [s.nbytes() for s, _ in self.keep] + [s.nbytes() for s, _ in self.discard]
        self.offsets, self.host_bytes = packed_layout(self.nbytes[:len(self.keep)])
        self.pin = any(d.type == "cuda" for _, d in self.keep)
        self.buffer: HostBuffer | None = None  # kept from one offload to the next
        if reuse is not None and not reuse.offloaded:
            self.buffer, reuse.buffer = reuse.buffer, None
        self.host: list[Tensor] = []  # while offloaded: each kept storage's bytes
        self.offloaded: bool = False

    @staticmethod
    def _storages(tensors: Iterable[Tensor], device: torch.device | None
                  ) -> list[tuple[torch.UntypedStorage, torch.device]]:
        seen: dict[int, tuple[torch.UntypedStorage, torch.device]] = {}
        for t in tensors:
            local = _local(t)
            on = local.device.type == "cuda" if device is None else local.device == device
            if on and local.untyped_storage().nbytes():
                storage = local.untyped_storage()
                seen.setdefault(storage.data_ptr(), (storage, local.device))
        return list(seen.values())

    @property
    def bytes(self) -> int:
        """GPU bytes this frees."""
        return sum(self.nbytes)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this holds pinned (its buffer, kept between offloads; 0 on CPU)."""
        return 0 if self.buffer is None else self.buffer.pinned_bytes

    def _host_buffer(self) -> HostBuffer:
        """The buffer to offload into: the one held when it is big enough and pinned alike
        (the same tensors: the same sizes, every step), else a new one of the exact size."""
        buffer = self.buffer
        if buffer is None or buffer.nbytes < self.host_bytes or buffer.pinned != self.pin:
            self.buffer = buffer = None  # the old one unpinned and freed before the new one
            self.buffer = buffer = HostBuffer(self.host_bytes, pin=self.pin)
        return buffer

    def offload(self) -> None:
        if self.offloaded:
            return
        sizes = self.nbytes[:len(self.keep)]
        self.host = self._host_buffer().views(self.offsets, sizes) if self.keep else []
        for (storage, device), host in zip(self.keep, self.host, strict=True):
            host.copy_(_byte_view(storage, device), non_blocking=True)
        _synchronize(self.keep + self.discard)  # the copies must land before the frees
        for storage, _ in self.keep + self.discard:
            storage.resize_(0)
        self.offloaded = True
        release_cached()

    def onload(self) -> None:
        if not self.offloaded:
            return
        sizes = iter(self.nbytes)
        for (storage, device), host in zip(self.keep, self.host, strict=True):
            storage.resize_(next(sizes))
            _byte_view(storage, device).copy_(host, non_blocking=True)
        for storage, device in self.discard:
            storage.resize_(next(sizes))
            _byte_view(storage, device).zero_()
        _synchronize(self.keep + self.discard)
        self.host = []  # (the buffer stays, for the next offload of these tensors)
        self.offloaded = False


def release_cached() -> None:
    """Hand the caching allocator's free blocks back to the device, where the engine process
    can use them. Blocks a colocated weight sync exported by CUDA IPC stay held until the
    engine has closed its handles: collect those first."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _synchronize(storages: list[tuple[torch.UntypedStorage, torch.device]]) -> None:
    for device in {d for _, d in storages if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors of a torch optimizer's per-parameter state (Adam's moments, step counts)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, Tensor)]


class Offloads:
    """A backend's offloaded parts by kind ("optimizer", "weights", "grads"): a kind already
    off is not offloaded twice, `onload` restores them all (newest first), and each kind's
    pinned host buffer is reused from one offload to the next."""

    def __init__(self, *, device: torch.device | None = None) -> None:
        self.device = device  # (tests: count CPU tensors; see Offload)
        self.active: dict[str, Offload] = {}  # insertion order: offload order
        self.last: dict[str, Offload] = {}

    def offload(self, kind: str, keep: Iterable[Tensor], discard: Iterable[Tensor] = ()) -> int:
        """Free `kind`'s tensors (see Offload); the bytes freed (0 when already off)."""
        if kind in self.active:
            return 0
        part = Offload(keep, discard, device=self.device, reuse=self.last.get(kind))
        part.offload()
        self.active[kind] = self.last[kind] = part
        return part.bytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes pinned for this backend's offloads, on or off (their buffers stay)."""
        return sum(part.pinned_bytes for part in self.last.values())

    def onload(self, kinds: Collection[str] | None = None) -> None:
        """Restore every kind that is off, or only those of `kinds`."""
        for kind in reversed(list(self.active)):
            if kinds is None or kind in kinds:
                self.active.pop(kind).onload()
