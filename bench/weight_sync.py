"""Weight sync over NCCL, Megatron trainer (GPU 0) -> reference engine (GPU 1), vs. raw NCCL.

For each model shape (random bf16 weights, `gpu_common.build_model`) this process builds the
megatron backend on GPU 0 and starts `python -m kuberl_rollout.reference` on GPU 1, then:

- full sync: `DistributedWeightSender` pushes `MegatronBackend.named_tensor_buckets(bucket)`
  to the engine (HTTP announce + NCCL broadcast per bucket, engine copies into its model), one
  warm-up and `--repeats` timed syncs, each between two `torch.cuda.synchronize()`; each
  interleaved with a "serial" sync, the same with buckets made ready one at a time on the
  caller's thread (`prefetch=False`: the sender before its pipeline);
- raw baseline, same run: the same bytes in the same buckets, each bucket flattened into one
  tensor once, broadcast
  GPU 0 -> GPU 1 over a fresh 2-rank `weight_sync.group` to a spawned helper process that only
  receives into preallocated buffers (no HTTP, no gathering, no copy into a model);
- check: the trainer's weights are negated (exact in bf16) before every timed sync, so the
  engine must receive every byte of each; after each one (outside its timing) the engine's
  /get_weights_checksum must equal the trainer's sha256 for every name sent and its weight
  version the sync's ("exact": all of them; the script exits 1 otherwise).

Prints GB per sync, seconds per sync (median), full and raw GB/s and their ratio (goal >= 0.9),
then seconds per sync extrapolated to Qwen2.5-7B / -32B (bf16) at the largest measured shape's
bandwidth, and writes everything to OUT/weight_sync.json. Needs 2 GPUs and megatron-core:

    PYTHONPATH=operator:trainer_image:rollout_image:wire python3 bench/weight_sync.py \\
        --shapes qwen2.5-0.5b,qwen2.5-1.5b --out /tmp/ws
    ... --bucket-mb 128,512,2048                  # sweep the bucket size

GB = 1e9 bytes. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_common import EXTRAPOLATE, ROOT, SHAPES, build_model, card, make_spec  # bench/ on path

HOST = "127.0.0.1"
GROUP_TIMEOUT_S = 300.0
RAW_GROUP = "kuberl_raw_bench"
Buckets = list[list[torch.Tensor]]


@dataclass
class Row:
    shape: str
    bucket_mb: int
    bytes: int
    buckets: int
    full_s: list[float]
    raw_s: list[float]
    exact: bool
    pause_s: list[float]   # of full_s: pausing generation + flushing caches
    resume_s: list[float]  # of full_s: continuing generation
    serial_s: list[float]  # full syncs with buckets made one at a time (no prefetch)
    # Where a full sync's time goes (`breakdown`): the trainer making every bucket ready
    # (export to HF layout + flatten, GPU work included), the engine's own time per update
    # summed over the last sync's buckets (from receiving the announce's body to loaded), and
    # one HTTP round trip to the engine.
    export_s: float = 0.0
    engine_s: float = 0.0
    rtt_s: float = 0.0

    @property
    def full_gbps(self) -> float:
        return self.bytes / statistics.median(self.full_s) / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.bytes / statistics.median(self.raw_s) / 1e9


# -- devices and ports ---------------------------------------------------------------------


def visible_devices() -> tuple[str, str]:
    """(trainer, engine) as CUDA_VISIBLE_DEVICES entries: the first two this process sees.
    This process keeps its own visibility and uses its device 0; the engine and the raw peer
    are started with only the second device visible."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in env.split(",") if x.strip()] if env else ["0", "1"]
    if len(ids) < 2 or torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs (CUDA_VISIBLE_DEVICES={env or 'unset'}, "
                         f"torch sees {torch.cuda.device_count()})")
    return ids[0], ids[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float,
              alive: Callable[[], bool] = lambda: True) -> Any:
    """fn(*args) in a daemon thread; its result, or RuntimeError when `alive()` turns false
    (the peer died, so a rendezvous or teardown would only wait for its timeout)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True, name=f"bench-{fn.__name__}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive() and (not alive() or time.monotonic() > deadline):
            raise RuntimeError(f"{fn.__name__}: peer gone or no result within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


# -- the engine ----------------------------------------------------------------------------


class Engine:
    """The reference engine as a child process on the second GPU, logging to a file
    (``kind`` "cpu": on the CPU, for a smoke run of a benchmark)."""

    def __init__(self, model_dir: Path, device: str, log: Path, kind: str = "cuda") -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
        paths = [str(ROOT / sub) for sub in ("operator", "trainer_image", "rollout_image", "wire")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model_dir),
               "--host", HOST, "--port", str(self.port), "--device", kind,
               "--dtype", "bfloat16", "--weight-sync-timeout", str(GROUP_TIMEOUT_S)]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health answers 200 (the server starts only once the model is loaded)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode} before serving; "
                                   f"{self.log}:\n{self.tail()}")
            with (contextlib.suppress(urllib.error.URLError, OSError),
                  opener.open(self.url + "/health", timeout=2) as resp):
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready within {timeout_s:g}s; "
                                   f"{self.log}:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


# -- the raw NCCL baseline -----------------------------------------------------------------


def raw_peer(device: str, port: int, jobs: Any, results: Any) -> None:
    """The spawned receiver (rank 1): per job, preallocate the announced buffers, say
    "ready", receive `rounds` broadcasts of every bucket, say "done"; None ends it."""
    # As the engine: only its GPU visible, set before this process's first CUDA call.
    assert not torch.cuda.is_initialized()
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    torch.cuda.set_device(0)
    from kuberl_wire.group import new_group

    group = new_group("nccl", HOST, port, 1, 2, RAW_GROUP, GROUP_TIMEOUT_S)
    try:
        while (job := jobs.get()) is not None:
            metas, rounds = job
            buffers = [[torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                        for shape, dtype in bucket] for bucket in metas]
            torch.cuda.synchronize()
            results.put("ready")
            for _ in range(rounds):
                for bucket in buffers:
                    group.broadcast(bucket, 0)
            torch.cuda.synchronize()
            del buffers
            results.put("done")
    finally:
        group.destroy()


class RawPeer:
    """Rank 0 of a 2-rank NCCL group whose rank 1 is `raw_peer` on the engine's GPU."""

    def __init__(self, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.port = free_port()
        self.proc = ctx.Process(target=raw_peer, args=(device, self.port, self.jobs,
                                                       self.results), daemon=True)
        self.proc.start()
        self.group: Any = None

    def connect(self) -> None:
        """Rendezvous with the peer (both ends block until both have joined)."""
        from kuberl_wire.group import new_group

        self.group = in_thread(new_group, "nccl", HOST, self.port, 0, 2, RAW_GROUP,
                               GROUP_TIMEOUT_S, timeout_s=GROUP_TIMEOUT_S,
                               alive=self.proc.is_alive)

    def _expect(self, what: str, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                got = self.results.get(timeout=1.0)
            except queue.Empty:
                if self.proc.is_alive():
                    continue
                raise RuntimeError(f"raw peer exited ({self.proc.exitcode}) before "
                                   f"{what!r}") from None
            if got != what:
                raise RuntimeError(f"raw peer said {got!r}, expected {what!r}")
            return
        raise TimeoutError(f"raw peer: no {what!r} within {timeout_s:g}s")

    def measure(self, buckets: Buckets, repeats: int) -> list[float]:
        """Seconds of each of `repeats` broadcasts of every bucket (after one warm-up)."""
        metas = [[(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in bucket]
                 for bucket in buckets]
        self.jobs.put((metas, repeats + 1))
        self._expect("ready")
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for bucket in buckets:
                self.group.broadcast(bucket, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        self._expect("done")
        return times[1:]

    def close(self) -> None:
        # Both ends shut the NCCL communicator down together (see sender.close).
        self.jobs.put(None)
        if self.group is not None:
            group, self.group = self.group, None
            with contextlib.suppress(Exception):
                in_thread(group.destroy, timeout_s=60)
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)


# -- the trainer side ----------------------------------------------------------------------


def build_backend(model_dir: Path) -> Any:
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=8, micro_batch=1, gpus=1)
    return MegatronBackend(spec, rank=0, world_size=1, device="cuda")


def free_megatron() -> None:
    """After the backend's last reference is gone: free its memory and Megatron's grid (the
    next shape's backend builds a new one); the default process group stays."""
    from megatron.core import parallel_state

    gc.collect()
    parallel_state.destroy_model_parallel()
    torch.cuda.empty_cache()


@torch.no_grad()
def negate(backend: Any) -> None:
    """New weights for the next syncs (exact in bf16; zeros become -0.0, other bytes too)."""
    for p in backend.model.parameters():
        p.neg_()


def materialize(backend: Any, bucket_bytes: int) -> Buckets:
    """Each bucket's bytes as one flat tensor: the raw baseline is one broadcast per bucket,
    the least NCCL can be asked to do for these bytes."""
    return [[torch.cat([t.detach().reshape(-1) for _, t in bucket])]
            for bucket in backend.named_tensor_buckets(bucket_bytes)]


class FullSync:
    """DistributedWeightSender to one engine, driven from one event loop (as TrainWorker)."""

    def __init__(self, url: str) -> None:
        from kuberl_trainer.engines.client import EngineClient
        from kuberl_trainer.weight_sync.sender import DistributedWeightSender

        self.url = url
        self.runner = asyncio.Runner()
        self.client = EngineClient([url], request_timeout_s=GROUP_TIMEOUT_S + 30)
        self.sender = DistributedWeightSender(self.client, master_address=HOST,
                                              master_port=free_port(), backend="nccl",
                                              timeout_s=GROUP_TIMEOUT_S)
        self.version = 0

    def connect(self) -> None:
        self.runner.run(self.sender.connect())

    def sync(self, backend: Any, bucket_bytes: int, prefetch: bool = True
             ) -> tuple[int, int, float, float, float]:
        """(bytes, buckets, seconds, pause s, resume s) of one full sync, GPU work included;
        ``prefetch`` False: buckets made ready one at a time (the sender before the pipeline)."""
        self.version += 1
        self.sender.prefetch = prefetch
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = self.runner.run(self.sender.send(backend.named_tensor_buckets(bucket_bytes),
                                                 weight_version=str(self.version)))
        torch.cuda.synchronize()
        return (stats.bytes, stats.buckets, time.perf_counter() - start, stats.pause_s,
                stats.resume_s)

    def round_trip_s(self, n: int = 20) -> float:
        """Median seconds of an HTTP request the engine answers at once."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.runner.run(self.client.request(self.url, "GET", "/get_weight_version"))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def exact(self, backend: Any) -> bool:
        """The engine holds the last version and, for every name the trainer sends, the
        trainer's bytes."""
        from kuberl_wire.codec import tensor_sha256

        get = self.client.request
        sums = self.runner.run(get(self.url, "GET", "/get_weights_checksum", timeout_s=900))
        sums = sums.get("checksums", sums)
        version = self.runner.run(get(self.url, "GET", "/get_weight_version"))["weight_version"]
        mine = {n: tensor_sha256(t) for bucket in backend.named_tensor_buckets(1 << 28)
                for n, t in bucket}
        wrong = sorted(n for n, s in mine.items() if sums.get(n) != s)
        if wrong:
            print(f"  {len(wrong)}/{len(mine)} tensors differ, e.g. {wrong[:3]}", flush=True)
        if str(version) != str(self.version):
            print(f"  engine weight_version {version!r}, expected {self.version}", flush=True)
        return bool(mine) and not wrong and str(version) == str(self.version)

    def close(self) -> None:
        try:
            self.runner.run(self.sender.close())
        finally:
            self.runner.run(self.client.close())
            self.runner.close()


# -- one shape -----------------------------------------------------------------------------


def export_s(backend: Any, bucket_bytes: int, repeats: int) -> float:
    """Median seconds to make every bucket ready as the sender does (no sending)."""
    from kuberl_trainer.weight_sync.sender import prepare_bucket

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for bucket in backend.named_tensor_buckets(bucket_bytes):
            prepare_bucket(bucket, torch.device("cuda"), flatten=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


ENGINE_UPDATE = re.compile(r"updated \d+ tensors, [\d.]+ MB in ([\d.]+)s")


def engine_update_s(log: Path, buckets: int) -> float:
    """The engine's own seconds for the last sync: its last ``buckets`` update log lines."""
    found = ENGINE_UPDATE.findall(log.read_text(errors="replace"))
    return sum(float(x) for x in found[-buckets:]) if len(found) >= buckets else float("nan")


def measure(shape: str, sync: FullSync, raw: RawPeer, backend: Any, bucket_mb: int,
            repeats: int, engine_log: Path) -> Row:
    bucket_bytes = bucket_mb << 20
    negate(backend)
    sync.sync(backend, bucket_bytes)  # warm-up (and, the first time, NCCL's communicator)
    runs, serial, checks = [], [], []
    engine_s = float("nan")
    for _ in range(repeats):  # interleaved, so drift on the machine hits both alike
        # New weights before every timed sync (else only the warm-up carries new bytes),
        # and every sync checked (outside the timing): the engine must hold them all.
        negate(backend)
        serial.append(sync.sync(backend, bucket_bytes, prefetch=False)[2])
        checks.append(sync.exact(backend))
        negate(backend)
        runs.append(sync.sync(backend, bucket_bytes))
        engine_s = engine_update_s(engine_log, runs[-1][1])  # this sync's buckets
        checks.append(sync.exact(backend))
    exact = all(checks)
    buckets = materialize(backend, bucket_bytes)
    nbytes = sum(t.numel() * t.element_size() for bucket in buckets for t in bucket)
    if nbytes != runs[0][0] or len(buckets) != runs[0][1]:
        raise RuntimeError(f"raw baseline has {nbytes} B in {len(buckets)} buckets, the sync "
                           f"{runs[0][0]} B in {runs[0][1]}")
    raw_s = raw.measure(buckets, repeats)
    del buckets
    torch.cuda.empty_cache()
    row = Row(shape=shape, bucket_mb=bucket_mb, bytes=nbytes, buckets=runs[0][1],
              full_s=[r[2] for r in runs], raw_s=raw_s, exact=exact,
              pause_s=[r[3] for r in runs], resume_s=[r[4] for r in runs], serial_s=serial,
              export_s=export_s(backend, bucket_bytes, repeats), engine_s=engine_s,
              rtt_s=sync.round_trip_s())
    print(f"  {shape} bucket {bucket_mb} MB: full {row.full_gbps:.2f} GB/s, raw "
          f"{row.raw_gbps:.2f} GB/s, exact {exact}", flush=True)
    return row


def run_shape(shape: str, args: argparse.Namespace, devices: tuple[str, str]) -> list[Row]:
    out = args.out / shape
    model_dir = build_model(out, shape)
    engine = Engine(model_dir, devices[1], out / "engine.log")
    try:
        backend = build_backend(model_dir)  # loads while the engine does
        try:
            engine.wait_ready(args.engine_timeout)
            return sweep(shape, args, devices[1], engine, backend)
        finally:
            del backend
            free_megatron()
    finally:
        engine.stop()


def sweep(shape: str, args: argparse.Namespace, engine_device: str, engine: Engine,
          backend: Any) -> list[Row]:
    with contextlib.ExitStack() as stack:
        sync = FullSync(engine.url)
        stack.callback(quietly, sync.close)  # after raw.close: callbacks run last-in first
        sync.connect()
        raw = RawPeer(engine_device)
        stack.callback(quietly, raw.close)
        raw.connect()
        return [measure(shape, sync, raw, backend, mb, args.repeats, engine.log)
                for mb in args.bucket_mb]


def quietly(fn: Callable[[], None]) -> None:
    """Teardown that reports its failure instead of hiding the error that caused it."""
    try:
        fn()
    except Exception as exc:
        print(f"warning: {getattr(fn, '__qualname__', fn)} failed: {exc!r}", flush=True)


# -- report --------------------------------------------------------------------------------


def report(rows: list[Row], args: argparse.Namespace) -> dict[str, Any]:
    n_gpu = torch.cuda.device_count()
    cards = f"{card()} (trainer) -> {torch.cuda.get_device_name(1) if n_gpu > 1 else '?'}"
    version = torch.cuda.nccl.version() if torch.cuda.is_available() else "?"
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    print(f"\nweight sync GPU 0 -> GPU 1 over NCCL: {cards}; torch {torch.__version__}, "
          f"NCCL {nccl}; median of {args.repeats} syncs after 1 warm-up; GB = 1e9 B")
    print(f"{'shape':<14} {'GB/sync':>8} {'bucket MB':>10} {'buckets':>8} {'full s':>8} "
          f"{'full GB/s':>10} {'raw s':>8} {'raw GB/s':>9} {'full/raw':>9} {'exact':>6} "
          f"{'pause ms':>9} {'resume ms':>10} {'serial s':>9} {'serial/full':>12}")
    for r in rows:
        print(f"{r.shape:<14} {r.bytes / 1e9:>8.3f} {r.bucket_mb:>10} {r.buckets:>8} "
              f"{statistics.median(r.full_s):>8.3f} {r.full_gbps:>10.2f} "
              f"{statistics.median(r.raw_s):>8.3f} {r.raw_gbps:>9.2f} "
              f"{r.full_gbps / r.raw_gbps:>9.2f} {r.exact!s:>6} "
              f"{statistics.median(r.pause_s) * 1e3:>9.1f} "
              f"{statistics.median(r.resume_s) * 1e3:>10.1f} "
              f"{statistics.median(r.serial_s):>9.3f} "
              f"{statistics.median(r.serial_s) / statistics.median(r.full_s):>12.2f}")
    print("goal: full/raw >= 0.8; serial/full > 1: what making buckets ready ahead saves")
    print("\nwhere a full sync's time goes (ms; export: the trainer making every bucket ready, "
          "GPU included; engine: its own time per update, summed; rtt: one HTTP round trip)")
    print(f"{'shape':<14} {'bucket MB':>10} {'buckets':>8} {'full':>8} {'pause+resume':>13} "
          f"{'export':>8} {'engine':>8} {'rtt':>6} {'raw':>6}")
    for r in rows:
        ms = 1e3
        print(f"{r.shape:<14} {r.bucket_mb:>10} {r.buckets:>8} "
              f"{statistics.median(r.full_s) * ms:>8.1f} "
              f"{(statistics.median(r.pause_s) + statistics.median(r.resume_s)) * ms:>13.1f} "
              f"{r.export_s * ms:>8.1f} {r.engine_s * ms:>8.1f} {r.rtt_s * ms:>6.2f} "
              f"{statistics.median(r.raw_s) * ms:>6.1f}")
    base = max(rows, key=lambda r: (r.bytes, r.full_gbps))
    print(f"\nextrapolated (bf16, 2 B/parameter) at {base.shape}'s fastest bucket "
          f"({base.bucket_mb} MB): full {base.full_gbps:.2f} GB/s, raw {base.raw_gbps:.2f} GB/s")
    print(f"{'model':<14} {'params':>8} {'GB/sync':>8} {'full s':>8} {'raw s':>8}")
    extrapolated = {}
    for name, params in EXTRAPOLATE.items():
        nbytes = 2 * params
        full, raw = nbytes / base.full_gbps / 1e9, nbytes / base.raw_gbps / 1e9
        extrapolated[name] = {"params": params, "bytes": nbytes, "full_s": full, "raw_s": raw}
        print(f"{name:<14} {params / 1e9:>7.2f}B {nbytes / 1e9:>8.2f} {full:>8.2f} {raw:>8.2f}")
    return {"card": cards, "torch": torch.__version__, "nccl": nccl, "repeats": args.repeats,
            "rows": [asdict(r) | {"full_gbps": r.full_gbps, "raw_gbps": r.raw_gbps,
                                  "ratio": r.full_gbps / r.raw_gbps} for r in rows],
            "extrapolated_from": {"shape": base.shape, "bucket_mb": base.bucket_mb},
            "extrapolated": extrapolated}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-0.5b",
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help=f"comma list of {', '.join(sorted(SHAPES))}")
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-weight-sync"))
    p.add_argument("--repeats", type=int, default=3, help="timed syncs after one warm-up")
    p.add_argument("--bucket-mb", default=[512], type=lambda s: [int(x) for x in s.split(",")],
                   help="bucket size in MiB, or a comma list to sweep (e.g. 128,512,2048)")
    p.add_argument("--engine-timeout", type=float, default=300.0,
                   help="seconds the engine may take to load and answer /health")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        p.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if args.repeats < 1 or not args.bucket_mb or min(args.bucket_mb) < 1:
        p.error("--repeats and --bucket-mb must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = visible_devices()
    torch.cuda.set_device(0)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for shape in args.shapes:
        rows += run_shape(shape, args, devices)
    result = report(rows, args)
    (args.out / "weight_sync.json").write_text(json.dumps(result, indent=2))
    exact = all(r.exact for r in rows)
    print(f"\nweights exact on the engine after every sync: {exact}; "
          f"results in {args.out / 'weight_sync.json'}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
