"""The colocated sync's flattened buckets, read by the pinned SGLang's own code: its
MultiprocessingSerializer (with its safe unpickler) and its model runner's flattened-bucket
update, which hands the model the reconstructed tensors."""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import torch

from kuberl_trainer.weight_sync.colocated import flatten_to
from kuberl_wire import codec, protocol
from tests.sglang_contract.test_requests import build


def sglang_flattened_update() -> Any:
    """ModelRunner._update_weights_from_flattened_bucket as the wheel ships it, compiled on
    its own: importing model_runner needs CUDA-only extensions."""
    import sglang
    from sglang.srt.weight_sync import tensor_bucket

    path = Path(sglang.__file__).parent / "srt" / "model_executor" / "model_runner.py"
    tree = ast.parse(path.read_text(), str(path))
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    method = next(n for n in runner.body if isinstance(n, ast.FunctionDef)
                  and n.name == "_update_weights_from_flattened_bucket")
    scope = {"FlattenedTensorMetadata": tensor_bucket.FlattenedTensorMetadata,
             "FlattenedTensorBucket": tensor_bucket.FlattenedTensorBucket}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), scope)
    return scope["_update_weights_from_flattened_bucket"]


def test_sglang_loads_a_colocated_bucket_as_the_trainers_tensors_in_the_engines_dtype() -> None:
    from sglang.srt.utils import MultiprocessingSerializer

    named = [("model.embed_tokens.weight", torch.randn(8, 4)),
             ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4).T),  # not contiguous
             ("model.norm.weight", torch.randn(4))]
    flat, metadata = flatten_to(named, torch.bfloat16)
    entry = codec.encode_flattened(flat, metadata)
    build("UpdateWeightsFromTensorReqInput", protocol.update_weights_from_tensor(
        [entry], weight_version="1", flush_cache=False, load_format=protocol.FLATTENED))

    loaded: list[list[tuple[str, torch.Tensor]]] = []
    runner = types.SimpleNamespace(model=types.SimpleNamespace(
        load_weights=lambda tensors: loaded.append(list(tensors))))
    ok, _ = sglang_flattened_update()(runner, MultiprocessingSerializer.deserialize(entry))
    assert ok and len(loaded) == 1
    assert [name for name, _ in loaded[0]] == [name for name, _ in named]
    for (_, want), (_, got) in zip(named, loaded[0], strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got, want.to(torch.bfloat16))
