"""The bytes a weight sync reports (SyncStats.bytes, push_colocated's count, the loop's
`weight_sync_bytes` and `weight_sync_bytes_total`) are the bytes of the tensors sent, checked
against a small model's sizes worked out by hand, in each path the trainer takes:

- the distributed sync (disaggregated; gloo here, NCCL on GPUs) into the reference engine's
  real receiver (kuberl_rollout.reference.weights.Receiver, a member of a real gloo group in
  this process), which counts what it received;
- the tensor sync (by value) and the colocated flattened buckets (by reference: shared
  memory on CPU), decoded as an engine decodes them;
- TrainGroup's running count of rank 0's bytes, which the loop's record reads.

Stand-in engines answer the HTTP calls in this process; no Ray, no engine processes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch

from kuberl_rollout.reference.weights import Receiver
from kuberl_trainer import actors
from kuberl_trainer.loops.parts import sync_bytes
from kuberl_trainer.weight_sync.colocated import Poster, push_colocated
from kuberl_trainer.weight_sync.sender import DistributedWeightSender, bucketize, send_tensors
from kuberl_wire import codec
from kuberl_wire.protocol import FLATTENED

URL = "http://127.0.0.1:30000"


def small_model() -> list[tuple[str, torch.Tensor]]:
    """Four tensors of known shapes and dtypes (a mixed-dtype bucket among their buckets)."""
    return [("model.embed_tokens.weight", torch.randn(16, 8).to(torch.bfloat16)),
            ("model.norm.weight", torch.ones(8)),
            ("lm_head.weight", torch.randn(16, 8).to(torch.bfloat16)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(12, 8).to(torch.float16))]


# By hand: 16*8 bf16 (2 bytes) + 8 fp32 (4) + 16*8 bf16 (2) + 12*8 fp16 (2).
MODEL_BYTES = 16 * 8 * 2 + 8 * 4 + 16 * 8 * 2 + 12 * 8 * 2  # 736
# Colocated, every tensor cast to the engines' dtype (bf16) as it is flattened.
MODEL_BYTES_BF16 = (16 * 8 + 8 + 16 * 8 + 12 * 8) * 2  # 720
BUCKET_BYTES = 300  # [embed], [norm, lm_head] (fp32 and bf16: not flattened), [up_proj]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingEngine:
    """What Receiver uses of a ReferenceEngine; counts the bytes it is given to load."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.weight_version = "0"
        self.loaded: list[tuple[str, torch.Size, torch.dtype]] = []
        self.bytes = 0

    def load_weights(self, named: Any) -> int:
        named = list(named)
        for name, t in named:
            self.loaded.append((name, t.shape, t.dtype))
            self.bytes += t.numel() * t.element_size()
        return len(named)

    def synchronize(self) -> None:
        pass


class EngineStandIn:
    """What the senders use of an EngineClient, for one engine in this process: the weight
    calls go to a reference Receiver (distributed) or are decoded as an engine decodes them
    (by tensor); pause, flush and continue succeed."""

    def __init__(self) -> None:
        self.urls = [URL]
        self.engine = CountingEngine()
        self.receiver = Receiver(self.engine, timeout_s=30)  # type: ignore[arg-type]
        self.calls: list[str] = []

    async def post_all(self, path: str, body: Any, *, timeout_s: float | None = None,
                       per_engine: bool = False, in_step: bool = False) -> list[Any]:
        self.calls.append(path)
        one = body[0] if per_engine else body
        if path == "/init_weights_update_group":  # (a rendezvous: it blocks until all join)
            return [await asyncio.to_thread(self.receiver.init_group, one)]
        if path == "/update_weights_from_distributed":  # (receives the bucket's broadcasts)
            return [await asyncio.to_thread(self.receiver.update_from_distributed, one)]
        if path == "/destroy_weights_update_group":
            return [self.receiver.destroy_group(one)]
        if path == "/update_weights_from_tensor":
            flattened = one.get("load_format") == FLATTENED
            for entry in one["serialized_named_tensors"]:
                self.engine.load_weights(codec.decode_named_tensors(entry, flattened=flattened))
            return [{"success": True}]
        assert path in ("/pause_generation", "/continue_generation"), path
        return [{"success": True}]

    async def post(self, url: str, path: str, body: Any, *,
                   timeout_s: float | None = None) -> Any:
        assert url == URL
        return (await self.post_all(path, body, timeout_s=timeout_s))[0]

    async def request(self, url: str, method: str, path: str, body: Any = None, *,
                      timeout_s: float | None = None) -> Any:
        assert (url, method, path) == (URL, "POST", "/flush_cache")
        return None


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened-buckets", "per-tensor"])
def test_a_distributed_sync_reports_the_bytes_the_reference_engine_received(
        flatten: bool) -> None:
    engine = EngineStandIn()
    model = small_model()

    async def sync() -> Any:
        sender = DistributedWeightSender(
            engine, master_address="127.0.0.1", master_port=free_port(),  # type: ignore[arg-type]
            backend="gloo", group_name="kuberl_bytes", timeout_s=30, flatten=flatten)
        await sender.connect()
        try:
            return [await sender.send(bucketize(model, BUCKET_BYTES)) for _ in range(2)]
        finally:
            await sender.close()

    first, second = asyncio.run(sync())
    assert (first.buckets, first.tensors) == (3, 4)
    assert first.bytes == second.bytes == MODEL_BYTES
    # What the engine received: the same tensors, twice, and as many bytes.
    assert engine.engine.loaded == [(n, t.shape, t.dtype) for n, t in model] * 2
    assert engine.engine.bytes == 2 * MODEL_BYTES


@pytest.mark.parametrize("shared", [False, True], ids=["by-value", "by-reference"])
def test_a_tensor_sync_reports_the_bytes_of_the_tensors_sent(shared: bool) -> None:
    engine = EngineStandIn()
    stats = asyncio.run(send_tensors(engine, bucketize(small_model(), BUCKET_BYTES),  # type: ignore[arg-type]
                                     weight_version="1", shared=shared))
    assert (stats.buckets, stats.tensors, stats.bytes) == (3, 4, MODEL_BYTES)
    assert engine.engine.bytes == MODEL_BYTES


def test_a_colocated_sync_reports_its_buffers_in_the_engines_dtype() -> None:
    """One training rank (shared memory stands in for CUDA IPC on CPU): the bytes are those
    of the flat buffers the engine reads, every tensor cast to the engines' bf16."""
    engine = EngineStandIn()
    poster = Poster.__new__(Poster)  # (rank 0's HTTP side, on the stand-in)
    poster.loop, poster.client = asyncio.new_event_loop(), engine  # type: ignore[assignment]
    try:
        sent = push_colocated(bucketize(small_model(), BUCKET_BYTES), rank=0, world_size=1,
                              gpu=("127.0.0.1", 0), engine_urls=[URL], engine_devices=[[0]],
                              weight_version="1", poster=poster, dtype=torch.bfloat16)
    finally:
        poster.loop.close()
    assert sent == MODEL_BYTES_BF16
    assert engine.engine.bytes == MODEL_BYTES_BF16
    assert {dtype for _, _, dtype in engine.engine.loaded} == {torch.bfloat16}


class Worker:
    """A TrainWorker actor handle whose push_weights answers (seconds, bytes) at once."""

    def __init__(self, answers: Sequence[tuple[float, int] | Exception]) -> None:
        self.answers = list(answers)
        self.push_weights = SimpleNamespace(remote=self._push)

    def _push(self, *args: object) -> tuple[float, int] | Exception:
        return self.answers.pop(0)


def test_the_step_record_carries_rank_zeros_bytes_of_the_syncs_that_succeeded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainGroup counts rank 0's bytes (the other ranks send none) once a sync succeeds;
    the loop's record takes the step's share and the running total from that count."""
    def get(refs: list[Any]) -> list[Any]:  # (ray.get of the answers above)
        failed = [r for r in refs if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        return refs

    monkeypatch.setattr(ray, "get", get)  # (what actors calls it as)
    group = actors.TrainGroup.__new__(actors.TrainGroup)
    group.sync_port, group.synced_bytes = 0, 0
    group.spec = SimpleNamespace(adapter_sync=False)  # type: ignore[assignment]
    group.workers = [Worker([(0.5, MODEL_BYTES), RuntimeError("engine died"),
                             (0.25, MODEL_BYTES)]),
                     Worker([(0.5, 0), (0.1, 0), (0.25, 0)])]
    parts: Any = SimpleNamespace(train=group)
    assert group.push_weights([URL], 0, 1 << 20) == 0.5  # (the start-up sync)
    before = group.synced_bytes
    with pytest.raises(RuntimeError, match="engine died"):
        group.push_weights([URL], 1, 1 << 20)
    assert group.push_weights([URL], 1, 1 << 20) == 0.25  # (made again: it counts once)
    assert sync_bytes(parts, before) == {"weight_sync_bytes": MODEL_BYTES,
                                         "weight_sync_bytes_total": 2 * MODEL_BYTES}
