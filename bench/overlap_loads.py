"""The loads bench/overlap_probe.py runs beside the reference engine, one process each.

    python bench/overlap_loads.py train --model-dir DIR --device cuda [--threads 1] [--cpus 16-31]
    python bench/overlap_loads.py gpu-matmul --device cuda
    python bench/overlap_loads.py cpu-spin --procs 16

Each pins itself to ``--cpus`` first (before torch starts any thread, so every thread it makes
inherits the set), asks the kernel to kill it when its parent dies, warms up, prints ``READY``
and then one ``STEP <time.monotonic()>`` line per step until killed. CLOCK_MONOTONIC is one
clock for every process of the host, so the probe counts the steps that fell inside each timed
rollout. A step is:

- train: one micro-batch's forward + backward (the trainer's work per micro-batch: float32
  weights, bf16 autocast on CUDA, as the fsdp backend's single rank), with an AdamW step
  (torch's fused kernel on CUDA, as backends/optim.py) every ``--accum`` micro-batches (the
  trainer makes one optimizer step per rollout); ``loss.item()`` ends each, a host sync per
  micro-batch, as the trainer's metrics make.
- gpu-matmul: ``--per-sync`` bf16 ``--size``-square matmuls then one synchronize: the GPU
  busy, the host nearly idle (a launch every millisecond or so, then a blocking wait).
- cpu-spin: a fixed amount of pure-Python arithmetic in each of ``--procs`` processes (no
  memory traffic to speak of, no GPU); each process prints its own STEP lines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

PR_SET_PDEATHSIG = 1
# Looked up once, at import: die_with_parent also runs as a Popen preexec_fn, between fork and
# exec, where loading a library could deadlock on a lock another thread held at the fork.
_PRCTL: Any = None
with contextlib.suppress(OSError, AttributeError):
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """SIGKILL this process when the process that started it exits (Linux's prctl): a probe
    killed with SIGKILL leaves no load spinning on a shared machine."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def parse_cpus(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (taskset's list form)."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def step_done() -> None:
    # One write() per line: lines from several processes on one pipe never interleave.
    os.write(1, f"STEP {time.monotonic():.6f}\n".encode())


def ready() -> None:
    os.write(1, b"READY\n")


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 local_files_only=True)
    torch.nn.Module.to(model, device)  # (HF's own `to` wrapper confuses type checkers)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": False}
    opt = torch.optim.AdamW(params, lr=1e-6, **fused)  # type: ignore[arg-type]
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, vocab, (args.micro_batch, args.seq_len), generator=gen)
               for _ in range(4)]

    def autocast() -> Any:
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def micro_batch(i: int) -> None:
        ids = batches[i % len(batches)].to(device, non_blocking=True)
        with autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if (i + 1) % args.accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss.item()

    micro_batch(args.accum - 1)  # warm-up: kernels, allocator, the optimizer's state
    micro_batch(0)
    ready()
    i = 1
    while True:
        micro_batch(i)
        step_done()
        i += 1


def gpu_matmul(args: argparse.Namespace) -> None:
    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(args.size, args.size, device=device, dtype=dtype)
    b = torch.randn(args.size, args.size, device=device, dtype=dtype)
    out = torch.empty_like(a)

    def step() -> None:
        for _ in range(args.per_sync):
            torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()
    ready()
    while True:
        step()
        step_done()


def spin(work: int) -> None:
    die_with_parent()
    while True:
        n = 0
        for i in range(work):
            n += i * i
        step_done()


def cpu_spin(args: argparse.Namespace) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=spin, args=(args.work,), daemon=True) for _ in range(args.procs)]
    for p in procs:
        p.start()
    ready()
    for p in procs:
        p.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["train", "gpu-matmul", "cpu-spin"])
    p.add_argument("--cpus", default=None, help="CPU list to pin to first (taskset's form)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-dir", default=None, help="train: the HF model directory")
    p.add_argument("--threads", type=int, default=0,
                   help="train: torch.set_num_threads (0: torch's default)")
    p.add_argument("--micro-batch", type=int, default=8, help="train: sequences per step")
    p.add_argument("--seq-len", type=int, default=72, help="train: tokens per sequence")
    p.add_argument("--accum", type=int, default=64,
                   help="train: micro-batches per optimizer step")
    p.add_argument("--size", type=int, default=8192, help="gpu-matmul: matrix side")
    p.add_argument("--per-sync", type=int, default=20,
                   help="gpu-matmul: matmuls per synchronize (one step)")
    p.add_argument("--procs", type=int, default=1, help="cpu-spin: busy processes")
    p.add_argument("--work", type=int, default=2_000_000,
                   help="cpu-spin: loop iterations per step (~0.1 s on a server core)")
    args = p.parse_args()
    die_with_parent()
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    {"train": train, "gpu-matmul": gpu_matmul, "cpu-spin": cpu_spin}[args.kind](args)
    sys.exit(0)


if __name__ == "__main__":
    main()
