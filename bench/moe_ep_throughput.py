"""Expert parallelism's throughput: moe_throughput.py's model (Qwen3-30B-A3B's layer shape,
``--layers`` of them, random bf16) trained by the megatron backend on every GPU of the machine,
with the experts replicated (ep 1: plain data parallelism) and split (ep = the GPU count), side
by side in one run, and a bare HF loop on one of the same GPUs as the anchor (per-GPU rate).

Each arm trains the same RL batch (``--samples`` sequences of 384-1280 tokens, one optimizer
step, each rank its data-parallel share); FLOPs count active parameters as moe_throughput.py
does; MFU is per GPU. Peak memory is the largest rank's. After the ep arm's steps the weight
sync's export (a collective: every expert gathered from its ep rank) must hold every layer's
every expert, finite (bench/megatron_moe_check.py --ep checks the gather bit for bit).

    torchrun --nproc-per-node 2 bench/moe_ep_throughput.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import make_spec, random_batch  # bench/ is on sys.path
from megatron_moe_check import my_rows
from moe_throughput import A3B, active_params, print_table, step_flops, timed, write_model


def arm(model_dir: Path, ep: int, world: int, rank: int, args: argparse.Namespace
        ) -> dict[str, Any]:
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=args.samples, micro_batch=1,
                     max_tokens=args.micro_tokens, lr=1e-5, gpus=world)
    training = spec.training.model_copy(update={
        "parallelism": spec.training.parallelism.model_copy(update={"ep": ep})})
    spec = spec.model_copy(update={"training": training})
    backend = MegatronBackend(spec, rank=rank, world_size=world, device="cuda")
    batch = random_batch(args.samples, prompt=256, response=(128, 1024),
                         vocab=A3B["vocab_size"])
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1)]
    mine = my_rows(backend, batch)
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(lambda: backend.train_step(mine), args.repeats)
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    exact = True
    if ep > 1:
        exported = {n: t for bucket in backend.named_tensor_buckets(1 << 30) for n, t in bucket
                    if ".mlp.experts." in n}
        exact = len(exported) == args.layers * A3B["num_experts"] * 3 and all(
            bool(t.isfinite().all()) for t in exported.values())
    # (the backend's memory is freed once this frame is gone: main collects)
    return {"tokens": sum(lengths), "flops": step_flops(A3B, args.layers, lengths),
            "seconds": seconds, "peak": float(peak), "exact": exact}


def main() -> int:
    from hf_anchor import run_anchor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--anchor-rows", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-moe-throughput"))
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model_dir = args.out / f"a3b-{args.layers}l"
    if int(os.environ.get("RANK", 0)) == 0:
        # Before the process group: transformers' save_pretrained under an initialised one
        # writes only this rank's part of the shards. The other ranks wait in the rendezvous.
        write_model(model_dir, A3B, args.layers, "cuda")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"Qwen3-30B-A3B layer shape x {args.layers} layers: active params "
              f"{active_params(A3B, args.layers) / 1e9:.3f}B per token, {world} GPUs",
              flush=True)
    arms = {}
    for ep in (1, world):
        arms[ep] = arm(model_dir, ep, world, rank, args)
        gc.collect()
        torch.cuda.empty_cache()
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # (the next arm's grid has another ep)
    rows = [(f"megatron ep {ep} (dp {world})", a["tokens"], a["flops"], a["seconds"],
             a["peak"], world) for ep, a in arms.items()]
    ok = rank != 0 or all(a["exact"] for a in arms.values())  # (rank 0 holds the export)
    if rank == 0:
        seq = 2048
        anchor = run_anchor(model_dir, rows=args.anchor_rows, seq=seq, micro_rows=4,
                            repeats=args.repeats, device="cuda")
        rows.append(("bare HF loop (1 GPU)", anchor.tokens,
                     step_flops(A3B, args.layers, [seq] * args.anchor_rows), anchor.seconds,
                     anchor.peak_gib, 1))
        print_table(rows)
        print("PASS" if ok else "FAIL: the ep export lacks experts")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
