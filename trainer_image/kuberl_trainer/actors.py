"""The training ranks on Ray: one TrainWorker per GPU (per node on CPU), each wrapping a
Backend, and the groups the loop drives them through. They hold no RL logic; the engines'
actors are in engine_actors.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from kuberl_api import spec_from_driver
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.base import Backend, TrainBatch
from kuberl_trainer.backends.factory import make_backend, preload_backend
from kuberl_trainer.backends.step_metrics import combine_ranks
from kuberl_trainer.engines.command import engine_dtype
from kuberl_trainer.placement import (
    Layout,
    colocated_engine_devices,
    cpu_sharing,
    weight_sync_port,
)
from kuberl_trainer.ray_actors import (
    free_port,
    in_bundle,
    log_path,
    log_to_file,
    node_ip,
    reserve,
    torch_threads,
)
from kuberl_trainer.sharding import DataParallelLayout

SYNC_TIMEOUT_S = 300.0
WEIGHT_SYNC_GROUP = "kuberl_weight_sync"


def weight_sync_group_name(formed: int) -> str:
    """The name of rank 0's `formed`-th weight-sync group: each its own, as they share one
    rendezvous server (kuberl_wire.group)."""
    return WEIGHT_SYNC_GROUP if formed == 1 else f"{WEIGHT_SYNC_GROUP}_{formed}"

GIB = float(1 << 30)
WEIGHTS = ("weights",)  # the offloaded kind a sync and a checksum read (backends/offload.py)


class TrainWorker:
    """One training process: joins the trainers' default process group, owns a Backend.
    `log_dir`: where its output goes, as `<role>-<rank>.log` (see log_to_file)."""

    role = "train"  # the log file's name

    def __init__(self, spec_json: str, rank: int, world_size: int, sharing: int = 1,
                 log_dir: str | None = None) -> None:
        log_to_file(log_path(log_dir, f"{self.role}-{rank}"),
                    f"{type(self).__name__} rank {rank}/{world_size}")
        self.spec = spec_from_driver(spec_json)
        self.rank, self.world_size = rank, world_size
        # The actor starts while the engines load: its imports now, the rest in `setup`.
        # Nothing here touches the GPU (bench/gpu_early_actor.py): colocated engines size
        # their memory pool from what is free as they start, this actor's life included.
        preload_backend(self.spec)
        self.sharing = sharing
        self.device = "cpu"  # (decided in `setup`: asking CUDA initialises its driver)
        self._sender: Any = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._rendezvous: Any = None  # rank 0's weight-sync rendezvous server (a TCPStore)
        self._groups = 0  # weight-sync groups formed so far
        self._poster: Any = None  # a colocated sync's rank 0 HTTP side (colocated.Poster)
        self._publisher: Any = None  # sync: adapter, rank 0 (weight_sync/adapter.py)
        # Where each step's adapter goes (sync: adapter): set by the group before a sync
        self.adapter_root: str | None = None
        self._sync_dtype: torch.dtype | None = None
        self._weights_off = self._offloaded = False
        self._memory: dict[str, float] = {}  # GPU memory metrics (GiB), with train_step's

    def on_gpu(self) -> bool:
        return self.spec.training.gpus_per_node > 0

    def build_backend(self) -> Backend:
        return make_backend(self.spec, rank=self.rank, world_size=self.world_size,
                            device=self.device)

    def address(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        self.device = "cuda" if self.on_gpu() and torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(torch_threads(self.sharing))
        if self.world_size > 1:
            backend = "nccl" if self.device == "cuda" else "gloo"
            torch.distributed.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank, world_size=self.world_size)
        self.backend = self.build_backend()
        # Which device each rank got (Ray sets CUDA_VISIBLE_DEVICES per actor): the first
        # thing to look at when two actors should, or should not, share a GPU.
        print(f"{type(self).__name__} rank {self.rank}/{self.world_size} on {self.device} "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
              flush=True)

    # Colocated memory handoff (memory_handoff.py): the loop offloads and onloads explicitly
    # (timed, in its order); every other call onloads first what it needs, so a call out of
    # that order is slower, never wrong.

    def offload(self, optimizer: bool, weights: bool) -> int:
        """Free this rank's GPU memory (Backend.offload); returns the bytes freed."""
        self._weights_off |= weights
        self._offloaded = True
        return self.backend.offload(optimizer=optimizer, weights=weights)

    def onload(self, kinds: tuple[str, ...] | None = None) -> None:
        """Back on the GPU: everything offloaded, or only `kinds` (WEIGHTS for the calls that
        read weights alone: a colocated sync must not bring Adam's state back beside the
        engines' cache)."""
        if self._offloaded and self.device == "cuda":
            # what this rank held from the GPU while the engines had it (once per offload)
            self._memory["gpu_resident_gib_max"] = torch.cuda.memory_reserved() / GIB
        self._offloaded = False
        self.backend.onload(kinds)
        if kinds is None or "weights" in kinds:
            self._weights_off = False

    def train_step(self, batch: TrainBatch, sft: TrainBatch | None = None) -> dict[str, float]:
        self.onload()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        metrics = self.backend.train_step(batch, sft)
        if self.device == "cuda":
            self._memory["gpu_train_peak_gib_max"] = torch.cuda.max_memory_reserved() / GIB
        return metrics | self._memory

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        self.onload()
        return self.backend.ref_logprobs(batch)

    def data_parallel_coords(self) -> tuple[int, int, bool]:
        return self.backend.data_parallel_coords()

    def push_weights(self, engine_urls: list[str], weight_version: int,
                     bucket_bytes: int, sync_port: int = 0,
                     max_buckets: int | None = None) -> tuple[float, int]:
        """Rank 0 broadcasts its weights to every engine (the group's rendezvous on
        `sync_port`, or a free port when 0); returns seconds spent and the bytes this rank
        sent (SyncStats.bytes; colocated, the buffers it handed over; 0 on a rank that sends
        nothing). Every rank must iterate the buckets: with sharded weights (FSDP2) each
        full tensor is gathered collectively, so the other ranks take part and drop what
        they gathered. `max_buckets`: only the first ones (every rank stops at the same
        bucket)."""
        started = time.perf_counter()
        if self._weights_off:
            self.onload(WEIGHTS)
        if self.spec.adapter_sync:
            sent = self._push_adapter(engine_urls, weight_version)
            return time.perf_counter() - started, sent
        colocated = self.spec.placement == "colocate" and self.device == "cuda"
        # Colocated buckets come in the training dtype: each is cast to the engines' as it
        # is flattened into one buffer (colocated.flatten_to), one copy instead of two. Over
        # the wire, the engines' dtype is fewer bytes.
        buckets = itertools.islice(self.backend.named_tensor_buckets(
            bucket_bytes, None if colocated else self.sync_dtype()), max_buckets)
        if colocated:
            # Trainer and engine share GPUs, and NCCL refuses two ranks on one device: pass a
            # CUDA IPC handle per bucket through /update_weights_from_tensor instead, as
            # SGLang takes them, each engine TP rank's from the training rank on its GPU; the
            # engine copies straight from the trainer's memory. Collective: every rank.
            from kuberl_trainer.weight_sync.colocated import push_colocated

            tp = self.spec.rollout.gpus_per_engine
            sent = push_colocated(
                buckets, rank=self.rank, world_size=self.world_size,
                gpu=(node_ip(), int(ray.get_gpu_ids()[0])), engine_urls=engine_urls,
                engine_devices=[colocated_engine_devices(i, tp, self.spec.training.gpus_per_node)
                                for i in range(len(engine_urls))],
                weight_version=str(weight_version), dtype=self.sync_dtype(),
                poster=self._colocated_poster(engine_urls) if self.rank == 0 else None)
            return time.perf_counter() - started, sent
        if self.rank != 0:
            for _ in buckets:
                pass
            return time.perf_counter() - started, 0
        stats = self._weight_sender(engine_urls, sync_port).run_until_complete(
            self._sender.send(buckets, weight_version=str(weight_version)))
        return time.perf_counter() - started, int(stats.bytes)

    def _push_adapter(self, engine_urls: list[str], version: int) -> int:
        """sync: adapter (weight_sync/adapter.py): the adapter written as version `version`'s
        PEFT directory (every rank gathers; rank 0 writes) and loaded by every engine; the
        adapter's bytes (rank 0; 0 elsewhere)."""
        from kuberl_trainer.backends.fsdp import FSDPBackend
        from kuberl_trainer.weight_sync.adapter import delivered, write_atomically

        backend = self.backend
        assert isinstance(backend, FSDPBackend) and self.adapter_root is not None
        if self.rank != 0:
            backend.export_adapter(Path())  # (this rank's part of the gathers: nothing written)
            return 0
        path = write_atomically(Path(self.adapter_root), version, backend.export_adapter)
        sent = sum(f.stat().st_size for f in path.iterdir())
        if delivered():
            publisher = self._adapter_publisher(engine_urls)
            assert self._aio is not None
            self._aio.run_until_complete(publisher.publish(engine_urls, version))
        return sent

    def _adapter_publisher(self, engine_urls: list[str]) -> Any:
        """Rank 0's AdapterPublisher, kept for the run (it knows what each engine holds);
        its HTTP client follows the fleet's engines."""
        from kuberl_trainer.engines.client import EngineClient
        from kuberl_trainer.weight_sync.adapter import AdapterPublisher

        if self._publisher is None:
            self._aio = asyncio.new_event_loop()
            self._publisher = AdapterPublisher(
                EngineClient(engine_urls, request_timeout_s=SYNC_TIMEOUT_S),
                Path(str(self.adapter_root)), self.spec.adapter_slots)
        elif _engines_changed(self._publisher.client, engine_urls):
            assert self._aio is not None
            self._aio.run_until_complete(self._publisher.client.close())
            self._publisher.client = EngineClient(engine_urls, request_timeout_s=SYNC_TIMEOUT_S)
        return self._publisher

    def set_adapter_root(self, root: str) -> None:
        self.adapter_root = root

    def adapters_loaded(self) -> int:
        """The most adapters an engine reported holding after the last adapter sync."""
        return 0 if self._publisher is None else int(self._publisher.reported)

    def sync_dtype(self) -> torch.dtype:
        """The dtype weight sync sends (and `checksums` hashes): the engines' own."""
        if self._sync_dtype is None:
            from kuberl_wire.dtypes import str_to_dtype

            self._sync_dtype = str_to_dtype(engine_dtype(self.spec))
        return self._sync_dtype

    def _colocated_poster(self, engine_urls: list[str]) -> Any:
        """Rank 0's HTTP side of a colocated sync (event loop and HTTP session), kept while
        the engines stay the same, so a sync opens no new connections (colocated.py)."""
        from kuberl_trainer.weight_sync.colocated import Poster

        if self._poster is not None and _engines_changed(self._poster.client, engine_urls):
            self._poster.close()  # an engine was replaced
            self._poster = None
        if self._poster is None:
            self._poster = Poster(engine_urls)
        return self._poster

    def _weight_sender(self, engine_urls: list[str],
                       sync_port: int) -> asyncio.AbstractEventLoop:
        """The trainer-to-engines group is built once and kept: an NCCL communicator takes
        seconds to set up, a broadcast over it milliseconds. Formed again, under a new name
        on the same rendezvous server, when an engine was replaced or the group broke (an
        engine died in the middle of a broadcast: the sender aborted it)."""
        from kuberl_trainer.engines.client import EngineClient
        from kuberl_trainer.weight_sync.sender import DistributedWeightSender
        from kuberl_wire.group import host_store

        if self._sender is not None and (_engines_changed(self._sender.client, engine_urls)
                                         or self._sender.group is None):
            self._drop_weight_sender()  # a group without the engine that is gone
        if self._sender is None:
            if self._rendezvous is None:  # (one per rank 0: its port, fixed in a cluster)
                self._rendezvous = host_store(node_ip(), sync_port or free_port(),
                                              SYNC_TIMEOUT_S)
            self._groups += 1  # (no key of an earlier group is read by this one)
            self._aio = asyncio.new_event_loop()
            client = EngineClient(engine_urls, request_timeout_s=SYNC_TIMEOUT_S + 30)
            self._sender = DistributedWeightSender(
                client, master_address=node_ip(), master_port=self._rendezvous.port,
                store=self._rendezvous, backend="nccl" if self.device == "cuda" else "gloo",
                group_name=weight_sync_group_name(self._groups), timeout_s=SYNC_TIMEOUT_S,
                tp_sizes=[self.spec.rollout.gpus_per_engine] * len(engine_urls),
                abortable=self.spec.rollout.engine == "reference")
            self._aio.run_until_complete(self._sender.connect())
        assert self._aio is not None
        return self._aio

    def _drop_weight_sender(self) -> None:
        """Leave the group of an engine that is gone (or of a broken update) without a
        collective teardown, which could wait for the dead member: this end aborted, the
        engines that can told to leave theirs (SGLang's keep theirs: it has no abort, and its
        destroy is collective), the HTTP client closed."""
        sender, self._sender = self._sender, None
        assert sender is not None and self._aio is not None
        self._aio.run_until_complete(sender.abandon())
        self._aio.close()

    def checksums(self) -> dict[str, str]:
        """sha256 of every weight as the engines receive it (for sync checks); collective."""
        from kuberl_wire.codec import tensor_sha256

        self.onload(WEIGHTS)
        return {name: tensor_sha256(t) for bucket in self.backend.named_tensor_buckets(
            1 << 26, self.sync_dtype()) for name, t in bucket}

    def save(self, path: str) -> None:
        self.onload()
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.onload()
        self.backend.load(path)


def _engines_changed(client: Any, engine_urls: list[str]) -> bool:
    """Whether a kept HTTP client (and what was built for its engines) no longer matches the
    engines of this sync: one was replaced (EngineClient keeps URLs without a trailing /)."""
    return bool(client.urls != [u.rstrip("/") for u in engine_urls])



class RankGroup:
    """Actors of TrainWorker (or a subclass) driven together: the colocated handoff's
    moves (memory_handoff.Ranks).

    Made in two steps, so that their processes start (and import torch) while the engines
    start rather than after them: `spawn` creates the actors and returns at once; `setup`
    joins them into one torch.distributed group and builds their backends (colocated, only
    once the engines have made room on the GPUs: memory_handoff.py)."""

    workers: list[Any]

    def spawn(self, worker: type, spec: RLJobSpec, options: list[dict[str, Any]], *,
              sharing: int, log_dir: Path | None = None) -> None:
        """One `worker` actor per entry of `options` (ranks in order), not waited for; their
        output goes to files in `log_dir` when given."""
        cls: Any = ray.remote(worker)
        spec_json = spec.model_dump_json(by_alias=True)
        n = len(options)
        logs = None if log_dir is None else str(log_dir.resolve())  # (an actor's cwd differs)
        self.workers = [cls.options(**opts).remote(spec_json, rank, n, sharing, logs)
                        for rank, opts in enumerate(options)]

    def setup(self) -> None:
        """The ranks joined into one torch.distributed group (rank 0's address), each with
        its backend built; raises what an actor raised while starting."""
        addr, port = ray.get(self.workers[0].address.remote())
        ray.get([w.setup.remote(addr, port) for w in self.workers])

    def offload(self, *, optimizer: bool, weights: bool) -> int:
        """Every rank frees its GPU memory; the bytes freed, summed."""
        freed: list[int] = ray.get([w.offload.remote(optimizer, weights)
                                    for w in self.workers])
        return sum(freed)

    def onload(self) -> None:
        ray.get([w.onload.remote() for w in self.workers])


class TrainGroup(RankGroup):
    """The training workers, driven together: data-parallel shards of every batch.
    `one_machine`: every actor shares the driver's machine (a local run), so CPU workers
    split its cores. `log_dir`: where their output goes (train-<rank>.log). Usable once
    `setup` has returned (RankGroup)."""

    layout: DataParallelLayout

    def __init__(self, spec: RLJobSpec, layout: Layout, *, one_machine: bool = False,
                 log_dir: Path | None = None) -> None:
        n = layout.train_workers
        self.spec = spec
        self.sync_port = weight_sync_port(spec, one_machine)
        # Bytes of the weight syncs that succeeded so far (the start-up sync's too): what
        # the loop's weight_sync_bytes(_total) are read from.
        self.synced_bytes = 0
        # sync: adapter: told each adapter version the engines hold (the head's client names
        # it in every request from then on), and how many an engine held at most
        self.published: Callable[[int], None] | None = None
        self.adapters_loaded = 0
        # A shared critic's share of each bundle is reserved here with its training worker's.
        self.pg = reserve([layout.train_bundle() for _ in range(n)], "training")
        self.spawn(TrainWorker, spec, [
            in_bundle(layout.train_actor, self.pg, rank) for rank in range(n)],
            sharing=cpu_sharing(spec, layout, n, one_machine), log_dir=log_dir)

    def setup(self) -> None:
        super().setup()
        coords: list[tuple[int, int, bool]] = ray.get(
            [w.data_parallel_coords.remote() for w in self.workers])
        # Megatron packs micro-batches, so its ranks finish together when their token counts
        # match; fsdp keeps contiguous shards (its equivalence tests pin that order).
        self.layout = DataParallelLayout(tuple((r, n, bool(rep)) for r, n, rep in coords),
                                         step_size=self.spec.global_batch_rows,
                                         balance=self.spec.training.backend == "megatron")

    def save(self, path: str) -> None:
        ray.get([w.save.remote(path) for w in self.workers])

    def load(self, path: str) -> None:
        ray.get([w.load.remote(path) for w in self.workers])

    def train(self, batch: TrainBatch, sft: TrainBatch | None = None) -> dict[str, float]:
        """One rollout's optimizer steps; ``sft``: the step's demonstrations (sftCoef)."""
        sfts: list[TrainBatch | None] = [None] * len(self.workers)
        if sft is not None:
            sfts = list(self.layout.per_worker(sft.split(self.layout.dp_size)))
        _, shards = self.layout.shards(batch)
        results: Sequence[dict[str, float]] = ray.get(
            [w.train_step.remote(s, d) for w, s, d in zip(self.workers, shards, sfts,
                                                           strict=True)])
        return combine_rank_metrics(self.layout.reported(results))

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` reference log-probs of the whole batch (a collective over the ranks,
        each on its shard)."""
        rows, shards = self.layout.shards(batch)
        parts: Sequence[torch.Tensor | None] = ray.get(
            [w.ref_logprobs.remote(s) for w, s in zip(self.workers, shards, strict=True)])
        present = [p for p in parts if p is not None]
        if len(present) != len(parts):
            raise RuntimeError("the training backend has no reference model (klCoef is 0)")
        return self.layout.gather(present, rows, batch.input_ids.shape)

    def push_weights(self, engine_urls: list[str], version: int, bucket_bytes: int,
                     max_buckets: int | None = None) -> float:
        """Every rank's part of a weight sync; returns rank 0's seconds. The bytes rank 0
        sent are added to `synced_bytes` once the sync has succeeded."""
        done: list[tuple[float, int]] = ray.get(
            [w.push_weights.remote(engine_urls, version, bucket_bytes, self.sync_port,
                                   max_buckets) for w in self.workers])
        seconds, sent = done[0]
        self.synced_bytes += sent
        if self.spec.adapter_sync:  # (the engines hold version `version` now: name it)
            self.adapters_loaded = int(ray.get(self.workers[0].adapters_loaded.remote()))
            from kuberl_trainer.weight_sync.adapter import delivered

            if self.published is not None and delivered():
                self.published(version)
        return float(seconds)

    def set_adapter_root(self, root: Path) -> None:
        """Where rank 0 writes each step's adapter for the engines (sync: adapter)."""
        ray.get([w.set_adapter_root.remote(str(root.resolve())) for w in self.workers])

    def checksums(self) -> dict[str, str]:
        sums: list[dict[str, str]] = ray.get([w.checksums.remote() for w in self.workers])
        return sums[0]


def combine_rank_metrics(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """One dict from the ranks' (each over its equal shard of samples): token-means weighted
    by the ranks' response tokens, extremes (``*_max``, ``*_min``) kept extremes
    (``backends.step_metrics.combine_ranks``)."""
    return combine_ranks(results)


