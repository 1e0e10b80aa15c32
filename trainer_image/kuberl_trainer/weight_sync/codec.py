"""Named tensors over JSON for `/update_weights_from_tensor`, and the per-tensor checksum.

Format (reference engine, `load_format` null): each entry of `serialized_named_tensors` is the
base64 text of `torch.save(list[tuple[str, Tensor]])` with CPU tensors; one entry per engine TP
rank (the reference engine has one). Decoding uses `torch.load(weights_only=True)`, which
refuses arbitrary pickled objects, so a request body can't run code in the engine.

Real SGLang expects something else in the same field: `MultiprocessingSerializer` bytes, i.e.
torch's ForkingPickler, which passes CUDA tensors as IPC handles (no copy) in colocated mode.
TODO(colocated GPU): an `encode_ipc` for SGLang engines; the reference engine keeps the copy
format because CUDA IPC needs a GPU and ForkingPickler payloads are unsafe to unpickle.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Sequence

import torch


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    payload = [(name, t.detach().to("cpu").contiguous()) for name, t in named]
    buf = io.BytesIO()
    torch.save(payload, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    raw = base64.b64decode(data, validate=True)
    loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(loaded, list | tuple) or not all(
            isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor) for item in loaded):
        raise ValueError("serialized_named_tensors must decode to a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in loaded]


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes in its own dtype (contiguous, on CPU): two tensors
    hash equal iff dtype-level bytes are equal, whatever device they live on."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
