"""Train-step throughput of the megatron backend, side by side with a baseline in one run.

``backends`` (benchmark 1, one GPU): the megatron and fsdp backends train the same random-
weight model (Qwen2.5-0.5B / 1.5B shapes) on the same batch; tokens/s (real tokens, padding
not counted), MFU, and the ratio megatron / fsdp::

    python bench/megatron_throughput.py backends --shapes qwen2.5-0.5b,qwen2.5-1.5b

``tp`` (benchmark 3, two GPUs): the megatron backend at TP=1 (two data-parallel ranks) and at
TP=2 on the same batch: log-probs of TP=2 against TP=1 (largest difference on response
tokens) and the throughput of each::

    torchrun --nproc-per-node 2 bench/megatron_throughput.py tp --shapes qwen2.5-0.5b

Each train step is one optimizer step over the batch (forward, backward, optimizer), timed
after a warm-up step. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import (
    SHAPES,
    build_model,
    card,
    make_spec,
    peak_flops,
    random_batch,
    train_flops,
)


def param_count(model_dir: Path) -> int:
    from kuberl_trainer.backends.hf_files import read_safetensors_dir

    return sum(t.numel() for t in read_safetensors_dir(model_dir).values())


def time_steps(backend: Any, batch: Any, repeats: int) -> float:
    """Median seconds of ``backend.train_step(batch)`` after one warm-up step."""
    backend.train_step(batch)
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        backend.train_step(batch)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def profile_step(backend: Any, batch: Any, title: str) -> None:
    """Where one train step's time goes: the top CUDA kernels and CPU ops (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        backend.train_step(batch)
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"\n--- profile: {title}")
    print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    # Host syncs stall the launch queue: where they come from (Python frames), most first.
    syncs = [e for e in prof.key_averages(group_by_stack_n=8)
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    print(f"host syncs: {sum(e.count for e in syncs)}; launches: "
          f"{sum(e.count for e in table if e.key == 'cudaLaunchKernel')}")
    for e in sorted(syncs, key=lambda e: -e.count)[:8]:
        frames = [f for f in e.stack if "site-packages/torch/" not in f][:4]
        print(f"  {e.count:>5} x {e.key}: {' <- '.join(frames)}")


def build(spec: Any, rank: int = 0, world: int = 1) -> Any:
    from kuberl_trainer.backends.base import make_backend

    return make_backend(spec, rank=rank, world_size=world, device="cuda")


def release(backend: Any) -> None:
    del backend
    gc.collect()
    torch.cuda.empty_cache()
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass


def backends(args: argparse.Namespace) -> None:
    torch.cuda.set_device(0)
    lo, hi = args.response
    rows = []
    for shape in args.shapes:
        model_dir = build_model(Path(args.out) / shape, shape)
        hidden, layers, *_ = SHAPES[shape]
        batch = random_batch(args.samples, args.prompt, (lo, hi), SHAPES[shape][5])
        lengths = batch.attention_mask.sum(dim=1).tolist()
        tokens = sum(lengths)
        flops = train_flops(param_count(model_dir), layers, hidden, lengths)
        result = {}
        for kind in ("fsdp", "megatron"):
            spec = make_spec(model_dir, backend=kind, samples=args.samples,
                             micro_batch=args.micro_batch)
            backend = build(spec)
            seconds = time_steps(backend, batch, args.repeats)
            if args.profile:
                profile_step(backend, batch, f"{shape} {kind}")
            peak = torch.cuda.max_memory_allocated() / 2**30
            release(backend)
            torch.cuda.reset_peak_memory_stats()
            result[kind] = (seconds, peak)
            print(f"{shape} {kind}: {seconds:.3f} s/step, peak {peak:.1f} GiB", flush=True)
        rows.append((shape, tokens, flops, result))
    print(f"\nbenchmark 1: train step, megatron vs fsdp, 1x {card()}; {args.samples} samples "
          f"of {args.prompt} prompt + {lo}..{hi} response tokens, microBatchSize "
          f"{args.micro_batch}")
    print(f"{'shape':<14} {'backend':<9} {'s/step':>7} {'tokens/s':>9} {'MFU':>6} "
          f"{'peak GiB':>8} {'ratio':>6}")
    for shape, tokens, flops, result in rows:
        base = result["fsdp"][0]
        for kind, (seconds, peak) in result.items():
            mfu = flops / seconds / peak_flops()
            print(f"{shape:<14} {kind:<9} {seconds:>7.3f} {tokens / seconds:>9.0f} "
                  f"{mfu:>6.1%} {peak:>8.1f} {base / seconds:>5.2f}x")


def tp(args: argparse.Namespace) -> None:
    from kuberl_trainer.megatron.packing import step_shards

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    lo, hi = args.response
    lines = []
    for shape in args.shapes:
        model_dir = Path(args.out) / shape / "model"
        if rank == 0:
            build_model(Path(args.out) / shape, shape)
        dist.barrier()
        hidden, layers, *_ = SHAPES[shape]
        batch = random_batch(args.samples, args.prompt, (lo, hi), SHAPES[shape][5])
        lengths = batch.attention_mask.sum(dim=1).tolist()
        flops = train_flops(param_count(model_dir), layers, hidden, lengths)
        logps, seconds = {}, {}
        for size in (1, world):
            spec = make_spec(model_dir, backend="megatron", samples=args.samples,
                             micro_batch=args.micro_batch, tp=size, gpus=world)
            backend = build(spec, rank, world)
            dp_rank, dp_size, _ = backend.data_parallel_coords()
            logp = backend.logprobs(batch)
            if rank == 0:
                logps[size] = logp
            shard = batch.select(step_shards(lengths, dp_size, len(batch))[dp_rank])
            seconds[size] = time_steps(backend, shard, args.repeats)
            release(backend)
        if rank == 0:
            diff = (logps[world] - logps[1]).abs()
            lines.append((shape, sum(lengths), flops, seconds, float(diff.max()),
                          float(diff.sum() / batch.loss_mask.sum())))
    if rank == 0:
        print(f"\nbenchmark 3: TP={world} vs TP=1 (x{world} data parallel), {world}x {card()}; "
              f"{args.samples} samples of {args.prompt} + {lo}..{hi} tokens")
        print(f"{'shape':<14} {'layout':<12} {'s/step':>7} {'tokens/s':>9} {'MFU':>6} "
              f"{'max |dlogp|':>11} {'mean |dlogp|':>12}")
        for shape, tokens, flops, sec, dmax, dmean in lines:
            for size in (1, world):
                layout = f"tp{size} dp{world // size}"
                mfu = flops / sec[size] / (peak_flops() * world)
                extra = f"{dmax:>11.2e} {dmean:>12.2e}" if size == world else ""
                print(f"{shape:<14} {layout:<12} {sec[size]:>7.3f} {tokens / sec[size]:>9.0f} "
                      f"{mfu:>6.1%} {extra}")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["backends", "tp"])
    p.add_argument("--shapes", default="qwen2.5-0.5b",
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", default=(256, 1024),
                   type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="/tmp/kuberl-throughput")
    p.add_argument("--profile", action="store_true", help="also profile one step of each")
    args = p.parse_args()
    for shape in args.shapes:
        if shape not in SHAPES:
            p.error(f"unknown shape {shape}; choose from {sorted(SHAPES)}")
    (backends if args.mode == "backends" else tp)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
