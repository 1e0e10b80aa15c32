"""Named tensors over JSON for `/update_weights_from_tensor`, and the per-tensor checksum.

Two formats for an entry of `serialized_named_tensors` (one entry per engine TP rank), both
base64 text of a list of `(name, tensor)`:

- **shared** (`encode_shared`, the colocated GPU path): torch's ForkingPickler, as SGLang's
  `MultiprocessingSerializer` writes it. CUDA tensors travel as CUDA IPC handles: the engine on
  the same GPU maps the trainer's memory and copies from it, no bytes cross the wire (the
  sender keeps the tensors alive until the engine has answered). CPU tensors travel as shared-
  memory file names (under the `file_system` sharing strategy), which is how the CPU tests
  drive this path.
- **copy** (`encode_named_tensors`): `torch.save` of CPU tensors, bytes in the body; for
  engines that do not share the trainer's machine.

`decode` tells them apart (a torch.save payload is a zip archive) and never unpickles anything
but tensors: the shared format is read by an unpickler that resolves only torch's tensor and
storage rebuild functions, dtypes and sizes, so a request body cannot run code in the engine.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import pickle
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    payload = [(name, t.detach().to("cpu").contiguous()) for name, t in named]
    buf = io.BytesIO()
    torch.save(payload, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_shared(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The tensors by reference (CUDA IPC handles; shared memory for CPU tensors): they must
    stay alive, unchanged, until the engine has loaded them."""
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(
            [(name, t.detach()) for name, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Either format (see the module docstring)."""
    raw = base64.b64decode(data, validate=True)
    if raw[:2] == b"PK":  # torch.save writes a zip archive
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    else:
        try:
            loaded = _TensorUnpickler(io.BytesIO(raw)).load()
        except pickle.UnpicklingError as exc:
            raise ValueError(f"serialized_named_tensors: {exc}") from None
    if not isinstance(loaded, list | tuple) or not all(
            isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor) for item in loaded):
        raise ValueError("serialized_named_tensors must decode to a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in loaded]


_REBUILDS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
             "rebuild_storage_filename", "rebuild_storage_empty"}


class _TensorUnpickler(pickle.Unpickler):
    """Resolves only what a ForkingPickler payload of tensors refers to."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.multiprocessing.reductions" and name in _REBUILDS)
            or (module == "torch" and (name in ("Tensor", "Size", "device")
                                       or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.storage" and name in ("UntypedStorage", "TypedStorage")))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not a tensor part; refused")
        return super().find_class(module, name)


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU tensors shared by file name rather than by file descriptor: a descriptor can only
    pass between processes connected by a socket, a name can go in an HTTP body."""
    before = torch_mp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch_mp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes in its own dtype (contiguous, on CPU): two tensors
    hash equal iff dtype-level bytes are equal, whatever device they live on."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
