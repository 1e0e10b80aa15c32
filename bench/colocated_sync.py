"""Colocated weight sync on one GPU: the fsdp trainer and the reference engine share the card,
the engine reads the trainer's memory by CUDA IPC handle (issue 17: 1 GB in <= 5 ms).

This process builds the fsdp backend (fp32 weights, as it trains) on its GPU and starts
`python -m kuberl_rollout.reference` (bf16) on the same GPU, then times, interleaved in one
run, for each bucket size:

- flat: `colocated.push_colocated`, what the trainer runs: each bucket cast to bf16 into one
  new buffer, one IPC handle and one request per bucket (SGLang's `flattened_bucket`);
- per-tensor: the colocated path before it, one IPC handle per tensor of the fp32 weights in
  place (`sender.send_tensors(shared=True)`), the engine casting as it copies;
- copies: the floor, the GPU work any colocated sync does and nothing else: cast the weights
  into one bf16 buffer, copy that into a second (the engine's weights), as two kernels.

Both syncs include pausing generation, flushing the cache and continuing (SGLang's order);
`control` times those three requests alone, and `engine` is the engine's own logged time per
update summed over a sync's buckets; a last table times the trainer's parts of a flat sync
alone. Before each sync the trainer's weights are negated, so the
engine must get every byte; every timed sync of every variant is checked: the engine's
/get_weights_checksum must equal the trainer's bf16 weights' for every name (exit 1 otherwise).

    PYTHONPATH=operator:trainer_image:rollout_image:wire:bench python3 bench/colocated_sync.py \\
        --shape qwen2.5-0.5b --bucket-mb 64,512,2048 --repeats 5

GB = 1e9 bytes. Needs one GPU. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_common import build_model, card, make_spec  # bench/ on path
from weight_sync import HOST, Engine, engine_update_s

Sync = Callable[[int, str], int]  # (bucket bytes, weight version) -> buckets sent


def trainer_sums(backend: Any) -> dict[str, str]:
    from kuberl_wire.codec import tensor_sha256

    return {name: tensor_sha256(t) for bucket in backend.named_tensor_buckets(
        1 << 28, torch.bfloat16) for name, t in bucket}


class Bench:
    def __init__(self, backend: Any, engine: Engine) -> None:
        from kuberl_trainer.weight_sync.colocated import Poster

        self.backend, self.engine = backend, engine
        self.poster = Poster([engine.url])  # one loop and HTTP session for the run

    def run(self, coro: Any) -> Any:
        return self.poster.loop.run_until_complete(coro)

    def flat(self, bucket_bytes: int, version: str) -> int:
        from kuberl_trainer.weight_sync.colocated import push_colocated

        sent = 0

        def counted() -> Iterator[Any]:
            nonlocal sent
            for bucket in self.backend.named_tensor_buckets(bucket_bytes):
                sent += 1
                yield bucket

        push_colocated(counted(), rank=0, world_size=1, gpu=(HOST, 0),
                       engine_urls=[self.engine.url], engine_devices=[[0]],
                       weight_version=version, poster=self.poster, dtype=torch.bfloat16)
        return sent

    def per_tensor(self, bucket_bytes: int, version: str) -> int:
        from kuberl_trainer.weight_sync.sender import send_tensors

        stats = self.run(send_tensors(self.poster.client,
                                      self.backend.named_tensor_buckets(bucket_bytes),
                                      weight_version=version, shared=True))
        return int(stats.buckets)

    def control_s(self) -> float:
        """Pause, flush and continue alone (no update between them)."""
        from kuberl_trainer.weight_sync.sender import continue_generation, pause_and_flush

        start = time.perf_counter()
        self.run(pause_and_flush(self.poster.client))
        self.run(continue_generation(self.poster.client))
        return time.perf_counter() - start

    def copies_s(self) -> tuple[float, int]:
        """The floor: every weight cast into one bf16 buffer, that copied into another."""
        tensors = [t for bucket in self.backend.named_tensor_buckets(1 << 40) for _, t in bucket]
        numels = [t.numel() for t in tensors]
        flat = torch.empty(sum(numels), dtype=torch.bfloat16, device=tensors[0].device)
        dst = torch.empty_like(flat)
        views = list(flat.split(numels))
        sources = [t.reshape(-1) for t in tensors]
        times = []
        for _ in range(5):
            synchronize()
            start = time.perf_counter()
            torch._foreach_copy_(views, sources)
            dst.copy_(flat)
            synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times), flat.numel() * flat.element_size()

    def parts_s(self, bucket_bytes: int) -> dict[str, float]:
        """The trainer's side of a flat sync, each part alone (median of 5, GPU work
        included): exporting the buckets, flattening them, serializing the buffers, and
        torch's collection of IPC memory the engine has let go of."""
        from kuberl_trainer.weight_sync.colocated import flatten_to
        from kuberl_wire import codec

        def clock(fn: Callable[[], Any]) -> float:
            times = []
            for _ in range(5):
                synchronize()
                start = time.perf_counter()
                fn()
                synchronize()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        buckets = list(self.backend.named_tensor_buckets(bucket_bytes))
        flats = [flatten_to(b, torch.bfloat16) for b in buckets]
        return {
            "export": clock(lambda: list(self.backend.named_tensor_buckets(bucket_bytes))),
            "flatten": clock(lambda: [flatten_to(b, torch.bfloat16) for b in buckets]),
            "encode": clock(lambda: [codec.encode_flattened(*f) for f in flats]),
            "ipc_collect": clock(torch.cuda.ipc_collect if torch.cuda.is_initialized()
                                 else lambda: None),
        }

    def exact(self, version: str) -> bool:
        get = self.poster.client.request
        sums = self.run(get(self.engine.url, "GET", "/get_weights_checksum", timeout_s=900))
        sums = sums.get("checksums", sums)
        got = self.run(get(self.engine.url, "GET", "/get_weight_version"))["weight_version"]
        mine = trainer_sums(self.backend)
        wrong = sorted(n for n, s in mine.items() if sums.get(n) != s)
        if wrong or str(got) != version:
            print(f"  {len(wrong)}/{len(mine)} differ (e.g. {wrong[:3]}), version {got!r} "
                  f"(want {version!r})", flush=True)
        return bool(mine) and not wrong and str(got) == version


@torch.no_grad()
def negate(backend: Any) -> None:
    for p in backend.module.parameters():
        p.neg_()


def synchronize() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def timed(sync: Sync, bucket_bytes: int, version: str) -> tuple[float, int]:
    synchronize()
    start = time.perf_counter()
    buckets = sync(bucket_bytes, version)
    synchronize()
    return time.perf_counter() - start, buckets


def measure(bench: Bench, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    variants: dict[str, Sync] = {"flat": bench.flat, "per-tensor": bench.per_tensor}
    rows, n = [], 0
    for mb in sizes:
        times: dict[str, list[float]] = {v: [] for v in variants}
        engine: dict[str, float] = {}
        exact: dict[str, bool] = {}
        buckets: dict[str, int] = {}
        for sync in variants.values():  # warm-up: IPC maps, allocator, connections
            n += 1
            negate(bench.backend)
            timed(sync, mb << 20, str(n))
        for r in range(repeats):
            for name, sync in variants.items():
                n += 1
                negate(bench.backend)
                seconds, buckets[name] = timed(sync, mb << 20, str(n))
                times[name].append(seconds)
                # every timed sync checked (outside its timing): new weights each time
                exact[name] = exact.get(name, True) and bench.exact(str(n))
                if r == repeats - 1:
                    engine[name] = engine_update_s(bench.engine.log, buckets[name])
        for name in variants:
            rows.append({"bucket_mb": mb, "variant": name, "buckets": buckets[name],
                         "seconds": statistics.median(times[name]), "all_s": times[name],
                         "engine_s": engine[name], "exact": exact[name]})
            print(f"  {mb} MB {name}: {rows[-1]['seconds'] * 1e3:.1f} ms, exact {exact[name]}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--bucket-mb", default=[64, 512, 2048],
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-colocated-sync"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of this script (shared memory stands in for IPC)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a GPU (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    from kuberl_trainer.backends.factory import make_backend

    out = args.out / args.shape
    model_dir = build_model(out, args.shape)
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    engine = Engine(model_dir, device, out / "engine.log", kind=args.device)
    try:
        spec = make_spec(model_dir, backend="fsdp", samples=8, micro_batch=1)
        backend = make_backend(spec, rank=0, world_size=1, device=args.device)
        engine.wait_ready(300)
        bench = Bench(backend, engine)
        rows = measure(bench, args.bucket_mb, args.repeats)
        control = statistics.median(bench.control_s() for _ in range(10))
        copies, nbytes = bench.copies_s()
        parts = {mb: bench.parts_s(mb << 20) for mb in args.bucket_mb}
        bench.poster.close()
    finally:
        engine.stop()
    print(f"\n{card()}, {args.shape}: {nbytes / 1e9:.2f} GB in bf16; pause+flush+continue "
          f"{control * 1e3:.1f} ms; copies alone {copies * 1e3:.2f} ms\n")
    print("| bucket MB | variant | buckets | sync ms | engine ms | sync - control ms | "
          "copies / sync | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['bucket_mb']} | {row['variant']} | {row['buckets']} | "
              f"{row['seconds'] * 1e3:.1f} | {row['engine_s'] * 1e3:.1f} | "
              f"{(row['seconds'] - control) * 1e3:.1f} | {copies / row['seconds']:.2f} | "
              f"{row['exact']} |")
    print("\nthe trainer's side of a flat sync, each part alone (ms)\n")
    print("| bucket MB | export | flatten | encode | ipc_collect |")
    print("|---|---|---|---|---|")
    for mb, part in parts.items():
        print(f"| {mb} | " + " | ".join(f"{part[k] * 1e3:.2f}" for k in
                                       ("export", "flatten", "encode", "ipc_collect")) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "colocated_sync.json").write_text(json.dumps(
        {"card": card(), "shape": args.shape, "bytes": nbytes, "control_s": control,
         "copies_s": copies, "parts_s": parts, "rows": rows}, indent=1))
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
