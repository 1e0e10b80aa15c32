"""Weight-sync planning and encoding: bucket plans, dtype names, the tensor codec, request
bodies. Pure (torch tensors only, no processes or network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kuberl_trainer.weight_sync.sender import _with_last, bucketize, tensor_meta
from kuberl_wire import codec, protocol
from kuberl_wire.dtypes import dtype_to_str, str_to_dtype
from kuberl_wire.plan import TensorMeta, iter_buckets, plan_buckets


def meta(name: str, nbytes: int) -> TensorMeta:
    return TensorMeta(name=name, dtype="uint8", shape=(nbytes,), nbytes=nbytes)


def names(buckets: list[list[TensorMeta]]) -> list[list[str]]:
    return [[m.name for m in b] for b in buckets]


def test_buckets_fill_up_to_the_limit_in_order() -> None:
    metas = [meta("a", 40), meta("b", 60), meta("c", 1), meta("d", 99), meta("e", 100)]
    assert names(plan_buckets(metas, 100)) == [["a", "b"], ["c", "d"], ["e"]]


def test_a_tensor_larger_than_the_limit_gets_its_own_bucket() -> None:
    metas = [meta("a", 10), meta("big", 250), meta("b", 10), meta("c", 10)]
    assert names(plan_buckets(metas, 100)) == [["a"], ["big"], ["b", "c"]]


def test_every_tensor_appears_once_and_no_bucket_exceeds_the_limit_unless_alone() -> None:
    sizes = [7, 93, 1, 0, 100, 101, 55, 45, 46, 3]
    metas = [meta(f"t{i}", s) for i, s in enumerate(sizes)]
    buckets = plan_buckets(metas, 100)
    assert [m for b in buckets for m in b] == metas
    for b in buckets:
        assert sum(m.nbytes for m in b) <= 100 or len(b) == 1


def test_empty_input_and_bad_limits() -> None:
    assert plan_buckets([], 100) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([meta("a", 1)], 0)
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([meta("a", 1), meta("a", 2)], 10)


def test_iter_buckets_streams_without_consuming_ahead() -> None:
    seen: list[int] = []

    def gen() -> Iterator[int]:
        for i in range(6):
            seen.append(i)
            yield i

    it = iter_buckets(gen(), lambda _: 50, 100)
    assert next(it) == [0, 1]
    assert seen == [0, 1, 2]  # one item of lookahead closes the first bucket
    assert list(it) == [[2, 3], [4, 5]]


def test_bucketize_uses_tensor_bytes() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(20, dtype=torch.bfloat16)),
             ("c", torch.zeros(5))]
    assert [[n for n, _ in b] for b in bucketize(named, 80)] == [["a", "b"], ["c"]]
    assert tensor_meta("b", named[1][1]) == TensorMeta("b", "bfloat16", (20,), 40)


def test_with_last_marks_only_the_final_bucket() -> None:
    assert list(_with_last(iter([[1], [2], [3]]))) == [([1], False), ([2], False), ([3], True)]
    assert list(_with_last(iter([]))) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    name = dtype_to_str(dtype)
    assert str_to_dtype(name) is dtype
    assert str_to_dtype(str(dtype)) is dtype  # "torch.bfloat16" is accepted too
    assert getattr(torch, name) is dtype  # what SGLang does with the string


def test_unknown_dtype_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float128'"):
        str_to_dtype("float128")
    with pytest.raises(ValueError, match="no weight-sync name"):
        dtype_to_str(torch.complex64)


def test_codec_round_trip_and_checksums() -> None:
    named = [("w", torch.randn(3, 4)), ("b", torch.randn(4).to(torch.bfloat16))]
    decoded = codec.decode_named_tensors(codec.encode_named_tensors(named))
    assert [n for n, _ in decoded] == ["w", "b"]
    for (_, a), (_, b) in zip(named, decoded, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert codec.tensor_sha256(a) == codec.tensor_sha256(b)
    assert codec.tensor_sha256(named[0][1]) != codec.tensor_sha256(named[0][1] + 1)
    # Non-contiguous views hash like their contiguous copy.
    t = torch.arange(12.0).reshape(3, 4)
    assert codec.tensor_sha256(t.T) == codec.tensor_sha256(t.T.contiguous())


def test_codec_rejects_payloads_that_are_not_named_tensors() -> None:
    import base64
    import io

    buf = io.BytesIO()
    torch.save({"not": "a list"}, buf)
    with pytest.raises(ValueError, match="list of"):
        codec.decode_named_tensors(base64.b64encode(buf.getvalue()))


def test_shared_codec_passes_tensors_by_reference() -> None:
    """The colocated format (ForkingPickler, as SGLang's MultiprocessingSerializer): views
    keep their shape, strides and dtype, and the decoded tensor is the sender's memory (here
    shared memory; on GPUs, the trainer's CUDA memory through an IPC handle)."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    named = [("view", base[:, 1:3]), ("b", torch.ones(2, dtype=torch.bfloat16))]
    decoded = codec.decode_named_tensors(codec.encode_shared(named))
    assert [n for n, _ in decoded] == ["view", "b"]
    for (_, a), (_, b) in zip(named, decoded, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    base.add_(100)  # a write on the sender's side shows on the receiver's: no copy was made
    assert torch.equal(decoded[0][1], base[:, 1:3])


def test_shared_codec_refuses_anything_but_tensors() -> None:
    """A pickle that names anything beyond torch's tensor rebuilders is refused before it can
    run: the engine never executes code from a request body."""
    import base64
    import os
    import pickle

    for payload in (pickle.dumps(os.system), pickle.dumps(eval)):
        with pytest.raises(ValueError, match="not a tensor part; refused"):
            codec.decode_named_tensors(base64.b64encode(payload))
    with pytest.raises(ValueError, match="list of"):
        codec.decode_named_tensors(base64.b64encode(pickle.dumps({"a": 1})))


def test_shared_codec_admits_every_part_a_cuda_tensor_pickles_to() -> None:
    """A CUDA tensor pickles (torch.multiprocessing.reductions.reduce_tensor) as
    rebuild_cuda_tensor(tensor class, size, stride, offset, storage class, dtype, device, IPC
    handle, ...). Without a GPU this writes that exact shape for an empty tensor (no handle,
    which rebuild_cuda_tensor answers with an empty storage) so the unpickler has to resolve
    every global a real colocated payload names."""
    import base64
    import io
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    class CudaShaped(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if not isinstance(obj, torch.Tensor):
                return NotImplemented
            storage = obj._typed_storage()
            return (rebuild_cuda_tensor, (type(obj), obj.size(), obj.stride(), 0,
                                          type(storage), obj.dtype, "cpu", None, 0, 0, False,
                                          None, None, None, False))

    buf = io.BytesIO()
    CudaShaped(buf, pickle.HIGHEST_PROTOCOL).dump([("w", torch.empty(0, dtype=torch.bfloat16))])
    assert b"rebuild_cuda_tensor" in buf.getvalue()
    [(name, tensor)] = codec.decode_named_tensors(base64.b64encode(buf.getvalue()))
    assert name == "w" and tensor.dtype == torch.bfloat16 and tensor.shape == (0,)


def test_update_request_carries_names_dtypes_shapes_in_order() -> None:
    metas = [TensorMeta("x", "float32", (2, 3), 24), TensorMeta("y", "bfloat16", (4,), 8)]
    body = protocol.update_weights_from_distributed(metas, group_name="g", weight_version="7")
    assert body == {"names": ["x", "y"], "dtypes": ["float32", "bfloat16"],
                    "shapes": [[2, 3], [4]], "group_name": "g", "flush_cache": True,
                    "weight_version": "7"}
    assert "weight_version" not in protocol.update_weights_from_distributed(
        metas, group_name="g", weight_version=None)


def test_a_flattened_bucket_is_received_as_views_of_one_buffer_in_order() -> None:
    from kuberl_rollout.reference.weights import _flat_buffer

    flat, views = _flat_buffer([[2, 3], [4], [1, 1, 2]], [torch.bfloat16] * 3, "cpu")
    assert flat.numel() == 12 and flat.dtype == torch.bfloat16
    flat.copy_(torch.arange(12, dtype=torch.bfloat16))
    assert [v.shape for v in views] == [(2, 3), (4,), (1, 1, 2)]
    assert [v.flatten().tolist() for v in views] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]
    with pytest.raises(ValueError, match="one dtype"):
        _flat_buffer([[1], [1]], [torch.bfloat16, torch.float32], "cpu")



def test_a_colocated_bucket_is_cast_into_one_buffer_the_engine_reads_as_the_tensors() -> None:
    """flatten_to + encode_flattened, decoded as the engine decodes a flattened_bucket entry:
    the tensors come back in order, with their shapes, in the engines' dtype, as views of one
    shared buffer (by reference: a write to the buffer shows on the engine's side), and the
    byte offsets are SGLang's (each tensor's bytes, one after the other)."""
    from kuberl_trainer.weight_sync.colocated import flatten_to

    base = torch.randn(4, 6)
    named = [("w", base), ("t", base[:, :3].T), ("b", torch.randn(5)), ("e", torch.empty(0, 2))]
    flat, metadata = flatten_to(named, torch.bfloat16)
    assert flat.dtype == torch.uint8 and flat.numel() == 2 * (24 + 12 + 5)
    assert [(m.start_idx, m.end_idx, m.numel) for m in metadata] == [
        (0, 48, 48), (48, 72, 24), (72, 82, 10), (82, 82, 0)]
    decoded = codec.decode_named_tensors(codec.encode_flattened(flat, metadata), flattened=True)
    assert [n for n, _ in decoded] == ["w", "t", "b", "e"]
    for (_, want), (_, got) in zip(named, decoded, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got, want.to(torch.bfloat16))
    flat.view(torch.bfloat16)[:1].fill_(7.0)
    assert decoded[0][1][0, 0].item() == 7.0


def test_flattened_metadata_with_other_fields_is_refused() -> None:
    """The namespaces encode_flattened writes are read only with exactly the six fields."""
    import types

    bad = {"flattened_tensor": torch.zeros(4, dtype=torch.uint8),
           "metadata": [types.SimpleNamespace(name="w", shape=torch.Size([2]))]}
    payload = codec._shared_pickle(bad)  # as encode_flattened pickles, short of two fields
    with pytest.raises(ValueError, match="FlattenedTensorMetadata"):
        codec.decode_named_tensors(payload, flattened=True)
