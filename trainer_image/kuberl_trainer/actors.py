"""Thin Ray actor groups: training workers (one per GPU, or per node on CPU) and engines.

The actors hold no RL logic: a training worker wraps a Backend, an engine actor runs an engine
HTTP server as a child process on its pod and reports the URL. The driver (the loop) talks to
training workers through Ray and to engines only over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import ray
import torch

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends.base import Backend, TrainBatch, make_backend
from kuberl_trainer.engine_command import engine_command, engine_dtype
from kuberl_trainer.placement import (
    ActorShape,
    Layout,
    colocated_engine_devices,
    cpu_sharing,
    cpu_threads,
    weight_sync_port,
)
from kuberl_trainer.sharding import DataParallelLayout
from kuberl_wire.protocol import ENGINE_SECRET_ENV

SYNC_TIMEOUT_S = 300.0
GIB = float(1 << 30)
WEIGHTS = ("weights",)  # the offloaded kind a sync and a checksum read (backends/offload.py)
ENGINE_LOG_TAIL_LINES = 200  # kept by an engine actor (EngineServer.log_tail)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _distinct_free_ports(count: int) -> list[int]:
    """`count` different free ports (each bound and released in turn: the OS may repeat one)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def node_ip() -> str:
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def log_to_file(path: str | None, what: str) -> None:
    """Send this actor process's stdout and stderr to `path` (appended; a resumed run adds to
    it), or leave them alone when None.

    Locally (`kuberl run` without --address) the run's terminal is for the step table, and
    Ray would forward every line an actor writes there: its routine logs belong in the run's
    output folder instead. Done on the file descriptors, not sys.stdout, so C++ libraries
    (gloo, NCCL), warnings and child processes (an engine server) write there too. In a
    cluster (None) they stay on stdout, where `kubectl logs` finds them.
    """
    if path is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {what} (pid {os.getpid()})", flush=True)


def log_path(log_dir: str | None, name: str) -> str | None:
    """`log_dir`/`name`.log, or None (no log directory: output stays on stdout)."""
    return None if log_dir is None else str(Path(log_dir) / f"{name}.log")


def torch_threads(sharing: int) -> int:
    """Threads for a CPU actor sharing its machine with `sharing - 1` actors of its role;
    KUBERL_TORCH_THREADS overrides (see placement.cpu_threads)."""
    forced = int(os.environ.get("KUBERL_TORCH_THREADS", "0") or 0)
    return forced if forced > 0 else cpu_threads(len(os.sched_getaffinity(0)), sharing)


class TrainWorker:
    """One training process: joins the trainers' default process group, owns a Backend.
    `log_dir`: where its output goes, as `<role>-<rank>.log` (see log_to_file)."""

    role = "train"  # the log file's name

    def __init__(self, spec_json: str, rank: int, world_size: int, sharing: int = 1,
                 log_dir: str | None = None) -> None:
        log_to_file(log_path(log_dir, f"{self.role}-{rank}"),
                    f"{type(self).__name__} rank {rank}/{world_size}")
        self.spec = RLJobSpec.model_validate_json(spec_json)
        self.rank, self.world_size = rank, world_size
        self.device = "cuda" if torch.cuda.is_available() and self.on_gpu() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(torch_threads(sharing))
        self._sender: Any = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._poster: Any = None  # a colocated sync's rank 0 HTTP side (colocated.Poster)
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
        seconds to set up, a broadcast over it milliseconds."""
        from kuberl_trainer.engine_client import EngineClient
        from kuberl_trainer.weight_sync.sender import DistributedWeightSender

        if self._sender is not None and _engines_changed(self._sender.client, engine_urls):
            self._drop_weight_sender()  # an engine was replaced: a group without it
        if self._sender is None:
            self._aio = asyncio.new_event_loop()
            client = EngineClient(engine_urls, request_timeout_s=SYNC_TIMEOUT_S + 30)
            self._sender = DistributedWeightSender(
                client, master_address=node_ip(), master_port=sync_port or free_port(),
                backend="nccl" if self.device == "cuda" else "gloo",
                group_name="kuberl_weight_sync", timeout_s=SYNC_TIMEOUT_S,
                tp_sizes=[self.spec.rollout.gpus_per_engine] * len(engine_urls))
            self._aio.run_until_complete(self._sender.connect())
        assert self._aio is not None
        return self._aio

    def _drop_weight_sender(self) -> None:
        """Forget the group of an engine that is gone. Its members that are still there leave
        it when they join the next one (an engine's init replaces the group of that name);
        this end is torn down aside, since a collective teardown may wait for the dead one."""
        sender, self._sender = self._sender, None
        assert sender is not None and self._aio is not None
        group, sender.group = sender.group, None
        if group is not None:
            threading.Thread(target=group.destroy, daemon=True,
                             name="old-weight-sync-group").start()
        self._aio.run_until_complete(sender.client.close())

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


class EngineServer:
    """Runs one engine HTTP server as a child process of this actor (on the actor's pod): the
    whole engine, or node `node_rank` of an engine spanning `spec.engine_nodes` nodes.
    `log_file`: where the actor's and the server's output go (see log_to_file)."""

    def __init__(self, spec_json: str, index: int, seed: int, sharing: int = 1,
                 log_file: str | None = None, node_rank: int = 0) -> None:
        part = f" node {node_rank}" if node_rank else ""
        log_to_file(log_file, f"engine {index}{part}")
        self.spec = RLJobSpec.model_validate_json(spec_json)
        self.index, self.seed, self.sharing, self.node_rank = index, seed, sharing, node_rank
        self.name = f"engine {index}{part}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.tail: deque[str] = deque(maxlen=ENGINE_LOG_TAIL_LINES)

    def start(self, model_path: str, dist_init_addr: str = "",
              secret: str = "") -> tuple[str, str]:
        """Start the server; returns (its URL, the engine's dist-init address). Node rank 0
        of a multi-node engine picks that address (a free port on its node); the others are
        given it. `secret`: the key the reference engine's nodes authenticate each other with
        (shared by one engine's parts, passed in the environment, never on a command line)."""
        port, nccl_port, dist_port = _distinct_free_ports(3)
        if self.spec.engine_nodes > 1 and self.node_rank == 0:
            dist_init_addr = f"{node_ip()}:{dist_port}"
        cmd = self._command(model_path, port, nccl_port, dist_init_addr)
        env = dict(os.environ)
        if secret:
            env[ENGINE_SECRET_ENV] = secret
        if self.spec.placement == "colocate" and self.spec.rollout_gpus:
            devices = colocated_engine_devices(self.index, self.spec.rollout.gpus_per_engine,
                                               self.spec.training.gpus_per_node)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        device = cmd[cmd.index("--device") + 1] if "--device" in cmd else "its GPUs"
        print(f"{self.name} ({self.spec.rollout.engine}) on {device} "
              f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
              f"{' '.join(cmd)}", flush=True)
        # The server's output goes through this actor to its stdout (its log file, or the
        # pod's log), keeping the last lines for log_tail: a server that dies in a cluster is
        # explained by them too, where the driver cannot read the pod's log.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env)
        threading.Thread(target=self._forward, args=(self.proc.stdout,), daemon=True,
                         name=f"engine-{self.index}-{self.node_rank}-output").start()
        self.url = f"http://{node_ip()}:{port}"
        return self.url, dist_init_addr

    def _command(self, model_path: str, port: int, nccl_port: int,
                 dist_init_addr: str = "") -> list[str]:
        return engine_command(self.spec, model_path=model_path, port=port, nccl_port=nccl_port,
                              seed=self.seed, torch_threads=torch_threads(self.sharing),
                              node_rank=self.node_rank, dist_init_addr=dist_init_addr)

    def _forward(self, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        for line in iter(pipe.readline, b""):
            view = memoryview(line)
            while view:
                view = view[os.write(1, view):]
            self.tail.append(line.decode(errors="replace").rstrip("\r\n"))

    def log_tail(self, lines: int = ENGINE_LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines the server wrote (stdout and stderr)."""
        return list(self.tail)[-lines:]

    def poll(self) -> int | None:
        """The child's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after grace_s (at once with 0: a hung server would not
        handle the SIGTERM anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            if grace_s > 0:
                self.proc.terminate()
            else:
                self.proc.kill()
            try:
                self.proc.wait(timeout=grace_s or 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


PLACEMENT_TIMEOUT_S = 600.0


def reserve(bundles: list[dict[str, float]], what: str) -> Any:
    """Reserve `bundles` at once (a gang: all or nothing) as one placement group.

    PACK keeps consecutive ranks on the same node where they fit, so data-parallel neighbours
    talk over NVLink and an engine's GPUs never straddle nodes (a bundle is one node).
    """
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"could not place {len(bundles)} {what} actor(s) of {bundles[0]} within "
            f"{PLACEMENT_TIMEOUT_S:.0f}s; the Ray cluster offers {ray.cluster_resources()}"
        ) from None
    return pg


def in_bundle(shape: ActorShape, pg: Any, index: int) -> dict[str, Any]:
    """Actor options: `shape`'s resources, taken from bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {**shape.options(), "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


def placed(shape: ActorShape, count: int, what: str) -> list[dict[str, Any]]:
    """Per-actor options for `count` actors of `shape`, each in a bundle of its own."""
    pg = reserve([shape.bundle() for _ in range(count)], what)
    return [in_bundle(shape, pg, i) for i in range(count)]


class RankGroup:
    """Actors of TrainWorker (or a subclass) driven together: the colocated handoff's
    moves (memory_handoff.Ranks)."""

    workers: list[Any]

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
    split its cores. `log_dir`: where their output goes (train-<rank>.log)."""

    def __init__(self, spec: RLJobSpec, layout: Layout, *, one_machine: bool = False,
                 log_dir: Path | None = None) -> None:
        n = layout.train_workers
        self.sync_port = weight_sync_port(spec, one_machine)
        # Bytes of the weight syncs that succeeded so far (the start-up sync's too): what
        # the loop's weight_sync_bytes(_total) are read from.
        self.synced_bytes = 0
        # A shared critic's share of each bundle is reserved here with its training worker's.
        self.pg = reserve([layout.train_bundle() for _ in range(n)], "training")
        self.workers = start_workers(TrainWorker, spec, [
            in_bundle(layout.train_actor, self.pg, rank) for rank in range(n)],
            sharing=cpu_sharing(spec, layout, n, one_machine), log_dir=log_dir)
        coords: list[tuple[int, int, bool]] = ray.get(
            [w.data_parallel_coords.remote() for w in self.workers])
        # Megatron packs micro-batches, so its ranks finish together when their token counts
        # match; fsdp keeps contiguous shards (its equivalence tests pin that order).
        self.layout = DataParallelLayout(tuple((r, n, bool(rep)) for r, n, rep in coords),
                                         step_size=spec.global_batch_size,
                                         balance=spec.training.backend == "megatron")

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
        return float(seconds)

    def checksums(self) -> dict[str, str]:
        sums: list[dict[str, str]] = ray.get([w.checksums.remote() for w in self.workers])
        return sums[0]


def start_workers(worker: type, spec: RLJobSpec, options: list[dict[str, Any]], *,
                  sharing: int, log_dir: Path | None = None) -> list[Any]:
    """One `worker` actor per entry of `options` (ranks in order), joined into one
    torch.distributed group (rank 0's address) with their backends built; their output goes
    to files in `log_dir` when given."""
    cls: Any = ray.remote(worker)
    spec_json = spec.model_dump_json(by_alias=True)
    n = len(options)
    logs = None if log_dir is None else str(log_dir.resolve())  # an actor's cwd need not be ours
    workers = [cls.options(**opts).remote(spec_json, rank, n, sharing, logs)
               for rank, opts in enumerate(options)]
    addr, port = ray.get(workers[0].address.remote())
    ray.get([w.setup.remote(addr, port) for w in workers])
    return workers


def combine_rank_metrics(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """One dict from the ranks' (each a mean over its equal shard): means of means, except
    extremes (``*_max``, ``*_min``), which stay extremes."""
    out = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


class EngineGroup:
    """The engine actors and their servers' URLs (node rank 0's, for an engine spanning
    nodes: the one that serves HTTP). `log_dir`: where each engine's output goes
    (engine-<index>.log, engine-<index>-node-<rank>.log for the other nodes of one), read back
    by `log_tail` to explain an engine's death."""

    def __init__(self, spec: RLJobSpec, layout: Layout, seed: int, *,
                 one_machine: bool = False, log_dir: Path | None = None) -> None:
        self._spec_json = spec.model_dump_json(by_alias=True)
        self._model_path, self._seed, self._nodes = spec.model.path, seed, layout.engine_nodes
        nodes = layout.engine_nodes
        # Bundle e * nodes + r holds node r of engine e: PACK puts an engine's nodes side by
        # side, and a bundle as large as a node takes a node of its own.
        self._opts = placed(layout.engine_actor, layout.engines * nodes, "engine")
        self._sharing = cpu_sharing(spec, layout, layout.engines * nodes, one_machine)
        self.logs: list[list[Path | None]] = [
            [None if log_dir is None else log_dir / _engine_log_name(e, r) for r in range(nodes)]
            for e in range(layout.engines)]
        self.parts: list[list[Any]] = [[self._actor(e, r) for r in range(nodes)]
                                       for e in range(layout.engines)]
        secrets_ = [secrets.token_hex(16) if nodes > 1 else "" for _ in self.parts]
        heads: list[tuple[str, str]] = ray.get([
            parts[0].start.remote(spec.model.path, "", key)
            for parts, key in zip(self.parts, secrets_, strict=True)])
        # The other nodes join node rank 0's TP group at the address it picked.
        ray.get([part.start.remote(spec.model.path, addr, key)
                 for parts, (_, addr), key in zip(self.parts, heads, secrets_, strict=True)
                 for part in parts[1:]])
        self.urls: list[str] = [url for url, _ in heads]
        self._failed_part: dict[str, int] = {}  # engine URL -> the node first seen dead

    def _actor(self, e: int, r: int) -> Any:
        """The actor of node `r` of engine `e`, in its own placement bundle."""
        log = self.logs[e][r]
        return ray.remote(EngineServer).options(**self._opts[e * self._nodes + r]).remote(
            self._spec_json, e, self._seed + e, self._sharing,
            None if log is None else str(log.resolve()), r)

    def restart(self, url: str) -> str:
        """Start the engine serving `url` again in its place (the same actors, or new ones in
        the same placement bundles where an actor died with its pod); returns its new URL.
        It serves the base model until the next weight sync."""
        e = self.urls.index(url)
        for r, part in enumerate(self.parts[e]):
            try:  # dead or hung: nothing to shut down gracefully
                ray.get(part.stop.remote(0), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(part)  # (its bundle is free again once it is gone)
                self.parts[e][r] = self._actor(e, r)
        key = secrets.token_hex(16) if self._nodes > 1 else ""
        head = self.parts[e][0]
        new, addr = ray.get(head.start.remote(self._model_path, "", key))
        ray.get([part.start.remote(self._model_path, addr, key) for part in self.parts[e][1:]])
        self.urls[e] = new
        self._failed_part.pop(url, None)
        return str(new)

    def kill(self, url: str) -> None:
        """Kill every server process of the engine serving `url` (hung: no grace); `restart`
        starts it again."""
        e = self.urls.index(url)
        for part in self.parts[e]:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(part.stop.remote(0), timeout=60)

    def dead(self) -> dict[str, int]:
        """Engines a server process of which exited (any node's), with the exit code."""
        polls = [p.poll.remote() for parts in self.parts for p in parts]  # all at once
        codes: list[Any] = [_exit_code(ref) for ref in polls]
        nodes = len(self.parts[0])
        out: dict[str, int] = {}
        for e, url in enumerate(self.urls):
            for rank, code in enumerate(codes[e * nodes:(e + 1) * nodes]):
                if code is not None:
                    out[url] = code
                    self._failed_part.setdefault(url, rank)
                    break
        return out

    def actor_of(self, url: str) -> Any:
        """The actor whose output explains the engine at `url`: the node whose server exited
        first, else node rank 0."""
        e = self.urls.index(url)
        return self.parts[e][self._failed_part.get(url, 0)]

    def log_of(self, url: str) -> Path | None:
        """The log file explaining the engine serving `url` (as actor_of; None in a cluster:
        pod logs)."""
        if url not in self.urls:
            return None
        e = self.urls.index(url)
        return self.logs[e][self._failed_part.get(url, 0)]

    def stop(self) -> None:
        ray.get([p.stop.remote() for parts in self.parts for p in parts])


def _exit_code(poll: Any) -> int | None:
    """The exit code an engine actor's `poll` returned for its server; -1 when the actor
    itself is gone (its pod was lost, say)."""
    try:
        code: int | None = ray.get(poll, timeout=30)
        return code
    except ray.exceptions.RayActorError:
        return -1


def _engine_log_name(index: int, node_rank: int) -> str:
    return f"engine-{index}.log" if node_rank == 0 else f"engine-{index}-node-{node_rank}.log"
