"""Train-step throughput of the megatron backend, side by side with a baseline in one run.

``backends`` (benchmark 1, one GPU): the megatron and fsdp backends train the same random-
weight model (Qwen2.5-0.5B / 1.5B shapes) on the same batch; tokens/s (real tokens, padding
not counted), MFU, and the ratio megatron / fsdp. Beside them, the anchor (`hf_anchor.py`): a
bare HF transformers loop (SDPA, bf16 weights, fused AdamW) on dense 2048-token rows, about as
many tokens per step; each backend's FLOP rate divided by the anchor's is the last column::

    python bench/megatron_throughput.py backends --shapes qwen2.5-0.5b,qwen2.5-1.5b
    ... --sync-sites        # also: the call site of every host sync in one step of each backend
    ... --dry-run           # CPU: a tiny model, fsdp and the anchor, every code path in seconds

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
    profiled,
    random_batch,
    train_flops,
)
from hf_anchor import rows_for, run_anchor
from sync_sites import SyncSites


def param_count(model_dir: Path) -> int:
    from kuberl_trainer.backends.hf_files import read_safetensors_dir

    return sum(t.numel() for t in read_safetensors_dir(model_dir).values())


def synchronize() -> None:
    if torch.cuda.is_available():  # (the CPU dry run has nothing to wait for)
        torch.cuda.synchronize()


def time_step(backend: Any, batch: Any) -> float:
    synchronize()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    backend.train_step(batch)
    synchronize()
    return time.perf_counter() - start


def time_steps(backend: Any, batch: Any, repeats: int) -> float:
    """Median seconds of ``backend.train_step(batch)`` after one warm-up step."""
    backend.train_step(batch)
    return statistics.median(time_step(backend, batch) for _ in range(repeats))


def sync_sites(backend: Any, batch: Any, title: str) -> None:
    """Every host sync of one train step, by call site (sync_sites.py); the step's seconds
    under the capture are slower than the timed ones (a Python stack per sync)."""
    synchronize()  # (the harness's own syncs stay outside the capture)
    start = time.perf_counter()
    with SyncSites() as sites:
        backend.train_step(batch)
    synchronize()
    seconds = time.perf_counter() - start
    print(f"\n--- syncs in one train step: {title}: {sites.total} "
          f"({seconds:.3f} s under the capture)")
    print(sites.table() if sites.total else "(none reported)", flush=True)


def profile_step(backend: Any, batch: Any, title: str) -> None:
    """Where one train step's time goes: the top CUDA kernels and CPU ops (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        backend.train_step(batch)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
    table = prof.key_averages()
    profiled(lambda: backend.train_step(batch), title)
    print(f"\n--- profile: {title}")
    print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    # Host syncs stall the launch queue: where they come from (Python frames), most first.
    # (These frames came back empty on torch 2.11: --sync-sites names every call site.)
    syncs = [e for e in prof.key_averages(group_by_stack_n=8)
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    print(f"host syncs: {sum(e.count for e in syncs)}; launches: "
          f"{sum(e.count for e in table if e.key == 'cudaLaunchKernel')}")
    for e in sorted(syncs, key=lambda e: -e.count)[:8]:
        frames = [f for f in e.stack if "site-packages/torch/" not in f][:4]
        print(f"  {e.count:>5} x {e.key}: {' <- '.join(frames)}")


def build(spec: Any, rank: int = 0, world: int = 1, device: str = "cuda") -> Any:
    from kuberl_trainer.backends.factory import make_backend

    return make_backend(spec, rank=rank, world_size=world, device=device)


LIGER = "+liger"  # fsdp with training.fusedKernels liger; Liger patches module-level
# functions of the model's family, so a run with it belongs in a process of its own
# (``--no-anchor``)


def release(backend: Any) -> None:
    del backend
    gc.collect()
    torch.cuda.empty_cache()  # (a no-op where CUDA was never initialised)
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def backends(args: argparse.Namespace) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    lo, hi = args.response
    rows = []
    for shape in args.shapes:
        model_dir = build_model(Path(args.out) / shape, shape)
        hidden, layers, *_ = SHAPES[shape]
        batch = random_batch(args.samples, args.prompt, (lo, hi), SHAPES[shape][5])
        lengths = batch.attention_mask.sum(dim=1).tolist()
        tokens = sum(lengths)
        params = param_count(model_dir)
        flops = train_flops(params, layers, hidden, lengths)
        result = {}
        for kind in args.backends:
            name, liger = kind.removesuffix(LIGER), kind.endswith(LIGER)
            spec = make_spec(model_dir, backend=name, samples=args.samples,
                             micro_batch=args.micro_batch, max_tokens=args.max_tokens,
                             fused_kernels="liger" if liger else "none")
            backend = build(spec, device=args.device)
            seconds = time_steps(backend, batch, args.repeats)
            if args.profile:
                profile_step(backend, batch, f"{shape} {kind}")
            if args.sync_sites:
                sync_sites(backend, batch, f"{shape} {kind}")
            peak = peak_gib()
            release(backend)
            reset_peak()
            result[kind] = (seconds, peak)
            print(f"{shape} {kind}: {seconds:.3f} s/step, peak {peak:.1f} GiB", flush=True)
        anchor = None
        if args.anchor:
            n = args.anchor_rows or rows_for(tokens, args.anchor_seq, args.anchor_micro_rows)
            micro = args.anchor_micro_rows
            while anchor is None:
                # A user writing the loop by hand takes the largest micro-batch that fits
                # (HF's loss keeps float32 logits of the whole micro-batch): halve on OOM.
                try:
                    anchor = run_anchor(model_dir, params=params, rows=n, seq=args.anchor_seq,
                                        micro_rows=micro, repeats=args.repeats,
                                        device=args.device, profile=args.profile)
                except torch.OutOfMemoryError:
                    if micro == 1:
                        raise
                    micro //= 2
                    gc.collect()
                    torch.cuda.empty_cache()
            reset_peak()
            print(f"{shape} bare HF loop: {anchor.seconds:.3f} s/step, {anchor.rows} x "
                  f"{anchor.seq} tokens, micro-batches of {micro} rows, peak "
                  f"{anchor.peak_gib:.1f} GiB", flush=True)
        rows.append((shape, tokens, flops, result, anchor))
    print(f"\nbenchmark 1: train step, {' vs '.join(args.backends)}, 1x {card()}; "
          f"{args.samples} samples of {args.prompt} prompt + {lo}..{hi} response tokens, "
          f"microBatchSize {args.micro_batch}, maxTokensPerMicroBatch {args.max_tokens}")
    if args.anchor:
        print(f"anchor: bare HF transformers loop (SDPA, bf16 weights, AdamW), dense rows of "
              f"{args.anchor_seq} tokens, micro-batches of the most rows up to "
              f"{args.anchor_micro_rows} that fit (printed above); "
              "'/ anchor': FLOP rate over the anchor's (model FLOPs: 6 x params per token + "
              "causal attention)")
    print(f"{'shape':<14} {'backend':<9} {'s/step':>7} {'tokens':>7} {'tokens/s':>9} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} {'vs fsdp':>7} {'/ anchor':>8}")
    for shape, tokens, flops, result, anchor in rows:
        base = result["fsdp"][0] if "fsdp" in result else float("nan")
        ref = anchor.flop_rate if anchor is not None else float("nan")
        for kind, (seconds, peak) in result.items():
            rate = flops / seconds
            print(f"{shape:<14} {kind:<9} {seconds:>7.3f} {tokens:>7} {tokens / seconds:>9.0f} "
                  f"{rate / 1e12:>8.2f} {rate / peak_flops():>6.1%} {peak:>8.1f} "
                  f"{base / seconds:>6.2f}x {rate / ref:>7.2f}x")
        if anchor is not None:
            rate = anchor.flop_rate
            print(f"{shape:<14} {'hf-anchor':<9} {anchor.seconds:>7.3f} {anchor.tokens:>7} "
                  f"{anchor.tokens / anchor.seconds:>9.0f} {rate / 1e12:>8.2f} "
                  f"{rate / peak_flops():>6.1%} {anchor.peak_gib:>8.1f} {'':>7} {1.0:>7.2f}x")


def tp(args: argparse.Namespace) -> None:
    from kuberl_trainer.backends.packing import step_shards

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    lo, hi = args.response
    lines = []
    # TP=1 keeps a whole model's weights, gradients and optimizer shard on each GPU: at 7B
    # that does not fit beside the activations, so --tp-only leaves it out.
    sizes = (world,) if args.tp_only else (1, world)
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
        for size in sizes:
            spec = make_spec(model_dir, backend="megatron", samples=args.samples,
                             micro_batch=args.micro_batch, tp=size, gpus=world,
                             max_tokens=args.max_tokens)
            backend = build(spec, rank, world)
            dp_rank, dp_size, _ = backend.data_parallel_coords()
            logp = backend.logprobs(batch)
            if rank == 0:
                logps[size] = logp
            shard = batch.select(step_shards(lengths, dp_size, len(batch))[dp_rank])
            seconds[size] = time_steps(backend, shard, args.repeats)
            release(backend)
        if rank == 0:
            diff = ((logps[world] - logps[1]).abs() if len(sizes) == 2
                    else torch.full((1,), float("nan")))
            lines.append((shape, sum(lengths), flops, seconds, float(diff.max()),
                          float(diff.sum() / batch.loss_mask.sum())))
    if rank == 0:
        print(f"\nbenchmark 3: TP={world} vs TP=1 (x{world} data parallel), {world}x {card()}; "
              f"{args.samples} samples of {args.prompt} + {lo}..{hi} tokens")
        print(f"{'shape':<14} {'layout':<12} {'s/step':>7} {'tokens/s':>9} {'MFU':>6} "
              f"{'max |dlogp|':>11} {'mean |dlogp|':>12}")
        for shape, tokens, flops, sec, dmax, dmean in lines:
            for size in sizes:
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
    p.add_argument("--max-tokens", type=int, default=None,
                   help="training.maxTokensPerMicroBatch (default: unset, microBatchSize "
                   "rows of the longest sample)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-only", action="store_true",
                   help="tp: time only TP = world size (no TP=1 comparison)")
    p.add_argument("--out", default="/tmp/kuberl-throughput")
    p.add_argument("--profile", action="store_true", help="also profile one step of each")
    p.add_argument("--sync-sites", action="store_true",
                   help="backends: also list the call site of every host sync in one step of "
                        "each backend (torch's sync debug mode; sync_sites.py)")
    p.add_argument("--backends", default=["fsdp", "megatron"],
                   type=lambda s: [x for x in s.split(",") if x],
                   help="backends: which to train (comma list of fsdp, megatron, fsdp+liger: "
                   "fsdp with training.fusedKernels liger, alone with --no-anchor)")
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True,
                   help="backends: also time the bare HF loop (hf_anchor.py) on the same card")
    p.add_argument("--anchor-seq", type=int, default=2048, help="tokens per anchor row")
    p.add_argument("--anchor-rows", type=int, default=0,
                   help="anchor rows per step; 0: as many tokens as the benchmark batch")
    p.add_argument("--anchor-micro-rows", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="backends on CPU: the tiny shape, fsdp and the anchor, small batches "
                        "(checks the code paths, measures nothing)")
    args = p.parse_args()
    if args.dry_run:
        if args.mode != "backends":
            p.error("--dry-run is for backends")
        args.shapes, args.backends, args.device = ["tiny"], ["fsdp"], "cpu"
        args.samples, args.prompt, args.response, args.micro_batch = 4, 8, (4, 16), 2
        args.repeats, args.anchor_seq, args.anchor_micro_rows = 1, 32, 2
        args.out = args.out + "-dry-run"
    for shape in args.shapes:
        if shape not in SHAPES:
            p.error(f"unknown shape {shape}; choose from {sorted(SHAPES)}")
    unknown = [b for b in args.backends if b not in ("fsdp", "megatron", "fsdp" + LIGER)]
    if unknown or not args.backends:
        p.error(f"--backends: {unknown or 'none'}; choose from fsdp, megatron, fsdp{LIGER}")
    (backends if args.mode == "backends" else tp)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
