"""Named tensors over JSON for `/update_weights_from_tensor`, and the per-tensor checksum.

Two formats for an entry of `serialized_named_tensors` (one entry per engine TP rank), both
base64 text of a list of `(name, tensor)`:

- **shared** (`encode_shared`, the colocated GPU path): torch's ForkingPickler, as SGLang's
  `MultiprocessingSerializer` writes it. CUDA tensors travel as CUDA IPC handles: the engine on
  the same GPU maps the trainer's memory and copies from it, no bytes cross the wire (the
  sender keeps the tensors alive until the engine has answered). The handle names its GPU by
  UUID, not index, as SGLang's patched torch reductions do (`sglang.srt.utils.patch_torch`):
  the trainer and the engine see different CUDA_VISIBLE_DEVICES, so an index means another
  GPU on each side. The rebuild function is named as torch's own
  (`torch.multiprocessing.reductions.rebuild_cuda_tensor`), which SGLang's safe unpickler
  allows and resolves to its UUID-aware replacement once it has patched torch. CPU tensors
  travel as shared-memory file names (under the `file_system` sharing strategy), which is how
  the CPU tests drive this path.
- **flattened bucket** (SGLang's `load_format: "flattened_bucket"`, what slime sends and
  `encode_flattened` writes, the colocated sync's format): the shared format of
  ``{"flattened_tensor": t, "metadata": [FlattenedTensorMetadata, ...]}``, one IPC handle for
  the whole bucket; `decode_named_tensors(..., flattened=True)` rebuilds the named tensors
  (views of the flat tensor, by byte offsets when it is uint8 as SGLang 0.5.6 writes it, by
  element offsets for an older single-dtype bucket).
- **copy** (`encode_named_tensors`): `torch.save` of CPU tensors, bytes in the body; for
  engines that do not share the trainer's machine.

`decode` tells them apart (a torch.save payload is a zip archive) and never unpickles anything
but tensors: the shared format is read by an unpickler that resolves only torch's tensor and
storage rebuild functions, dtypes and sizes, so a request body cannot run code in the engine.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    payload = [(name, t.detach().to("cpu").contiguous()) for name, t in named]
    buf = io.BytesIO()
    torch.save(payload, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# rebuild_cuda_tensor's argument that names the device (torch's reduce_tensor has kept this
# order for years; SGLang's patch relies on the same position).
_DEVICE_ARG = 6


def _reduce_by_uuid(tensor: torch.Tensor) -> Any:
    rebuild, args = reductions.reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
    return rebuild, args


def _shared_pickle(obj: Any) -> str:
    buf = io.BytesIO()
    with _file_system_sharing():
        pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table[torch.Tensor] = _reduce_by_uuid
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_shared(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The tensors by reference (CUDA IPC handles; shared memory for CPU tensors): they must
    stay alive, unchanged, until the engine has loaded them."""
    return _shared_pickle([(name, t.detach()) for name, t in named])


def encode_flattened(flat: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> str:
    """A flattened bucket by reference (``flat`` must stay alive, unchanged, until the engine
    has loaded it). Each metadata entry travels as a ``types.SimpleNamespace`` of the six
    fields: SGLang's unpickler admits the ``types`` module and its model runner copies those
    fields into its own class, while naming SGLang's class would need SGLang in the trainer
    (slime's payloads name it; the decoder below reads both)."""
    metas = [types.SimpleNamespace(**dataclasses.asdict(m)) for m in metadata]
    return _shared_pickle({"flattened_tensor": flat.detach(), "metadata": metas})


def decode_named_tensors(data: str | bytes, *, flattened: bool = False
                         ) -> list[tuple[str, torch.Tensor]]:
    """Any of the formats (see the module docstring); ``flattened``: the payload is a
    flattened bucket (``load_format: "flattened_bucket"``)."""
    raw = base64.b64decode(data, validate=True)
    if raw[:2] == b"PK":  # torch.save writes a zip archive
        if flattened:
            raise ValueError("a flattened_bucket payload is a MultiprocessingSerializer "
                             "pickle, not torch.save bytes")
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    else:
        try:
            loaded = _TensorUnpickler(io.BytesIO(raw)).load()
        except pickle.UnpicklingError as exc:
            raise ValueError(f"serialized_named_tensors: {exc}") from None
    if flattened:
        return _unflatten(loaded)
    if not isinstance(loaded, list | tuple) or not all(
            isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor) for item in loaded):
        raise ValueError("serialized_named_tensors must decode to a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in loaded]


@dataclass
class FlattenedTensorMetadata:
    """The fields of SGLang's class of the same name (sglang.srt.weight_sync.tensor_bucket),
    which a flattened bucket's pickle names: the unpickler builds this one in its place."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


def _unflatten(loaded: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(loaded, dict) or set(loaded) != {"flattened_tensor", "metadata"}:
        raise ValueError("a flattened_bucket entry must decode to {flattened_tensor, metadata}")
    flat, metas = loaded["flattened_tensor"], loaded["metadata"]
    if isinstance(metas, list):
        metas = [_as_metadata(m) if isinstance(m, types.SimpleNamespace) else m for m in metas]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(
            metas, list) or not all(isinstance(m, FlattenedTensorMetadata) for m in metas):
        raise ValueError("flattened_tensor must be a 1-D tensor and metadata a list of "
                         "FlattenedTensorMetadata")
    out = []
    for m in metas:
        part = flat[m.start_idx:m.end_idx]
        # SGLang 0.5.6 concatenates every tensor's bytes (uint8, any mix of dtypes); earlier
        # buckets held one dtype's elements.
        if flat.dtype == torch.uint8 != m.dtype:
            # A view needs the offset aligned to the dtype's size; SGLang's view raises on a
            # misaligned one, a copy of those bytes reads it right.
            itemsize = torch.empty(0, dtype=m.dtype).element_size()
            part = (part if m.start_idx % itemsize == 0 else part.clone()).view(m.dtype)
        else:
            part = part.to(m.dtype)
        out.append((str(m.name), part.reshape(m.shape)))
    return out


def _as_metadata(entry: types.SimpleNamespace) -> FlattenedTensorMetadata | None:
    """A namespace of FlattenedTensorMetadata's fields (`encode_flattened`) as the class;
    None (refused by the caller) when its fields are not exactly those."""
    fields = {f.name for f in dataclasses.fields(FlattenedTensorMetadata)}
    if set(vars(entry)) != fields:
        return None
    return FlattenedTensorMetadata(**vars(entry))


def _is_torch_device(name: str) -> bool:
    """"cuda:1", "cpu": a device torch names; anything else is a GPU UUID."""
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor, taking the device as an index or a GPU UUID (SGLang's
    patched reductions, and ours: `_reduce_by_uuid`)."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str) and not _is_torch_device(device):
        found = [i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise ValueError(f"tensor on GPU {device}, which this process cannot see "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        args = (*args[:_DEVICE_ARG], found[0], *args[_DEVICE_ARG + 1:])
    rebuilt: torch.Tensor = reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return rebuilt


_REBUILDS = {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
             "rebuild_storage_empty"}
# torch's name (our payloads, and SGLang's once its patch has replaced torch's function) and
# the patched function's own name (payloads pickled in a process that ran SGLang's patch).
_CUDA_REBUILDS = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                  ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}


class _TensorUnpickler(pickle.Unpickler):
    """Resolves only what a ForkingPickler payload of tensors (and a flattened bucket's
    metadata) refers to."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CUDA_REBUILDS:
            return _rebuild_cuda_tensor
        if (module, name) == SGLANG_METADATA:
            return FlattenedTensorMetadata
        if (module, name) == ("types", "SimpleNamespace"):  # encode_flattened's metadata
            return types.SimpleNamespace
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
    return hashlib.sha256(flat.numpy().data).hexdigest()  # (its buffer: no bytes copy)
