"""The anchor of benchmark 1: a bare HF transformers training loop, as a user writes it by hand.

No kuberl code runs here: ``AutoModelForCausalLM`` with SDPA attention and bf16 weights, a
fused ``torch.optim.AdamW`` over them, dense rows of 2048 tokens (every token real, no padding,
no packing), HF's own loss (``labels=input_ids``), gradient accumulation over micro-batches,
forward + backward + optimizer step. It is the anchor because it is the simplest fast loop on
the same card and model: the backends' FLOP rate divided by this one says what the backend's
machinery (RL loss, masking, variable lengths, sharding, fp32 master weights) costs or gains
against the loop a user would otherwise write (issue 17).

Compare FLOP rates, not tokens/s: the anchor's rows (2048 tokens) are longer than the RL
batch's, so each of its tokens carries more attention FLOPs. Both use
``gpu_common.train_flops`` (6 x params per token plus causal attention).

``megatron_throughput.py backends`` runs it beside the backends (``--anchor``, on by default);
on its own, e.g. on CPU with a tiny model to check the code path::

    python bench/hf_anchor.py --shape tiny --rows 4 --seq 64 --micro-rows 2 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_common import (  # bench/ on sys.path
    SHAPES,
    build_model,
    peak_flops,
    profiled,
    train_flops,
)


@dataclass
class AnchorResult:
    seconds: float  # median seconds per optimizer step
    rows: int
    seq: int
    flops: float  # model FLOPs per step (gpu_common.train_flops)
    peak_gib: float  # CUDA peak allocated during the timed steps (0 on CPU)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def flop_rate(self) -> float:
        return self.flops / self.seconds


def rows_for(tokens: int, seq: int, micro_rows: int) -> int:
    """Rows of ``seq`` tokens closest to ``tokens`` per step, rounded to whole micro-batches
    (the benchmark batch's ~24.6k real tokens at 2048 per row and 4 per micro-batch: 12)."""
    micros = max(1, round(tokens / (seq * micro_rows)))
    return micros * micro_rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Fused AdamW where this torch has it for these tensors (CUDA bf16: yes), else the
    default (foreach) implementation: what a user gets by asking for the fast one."""
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr)


def run_anchor(model_dir: Path, *, rows: int, params: int | None = None, seq: int = 2048,
               micro_rows: int = 4, repeats: int = 3, warmup: int = 1,
               device: str = "cuda", lr: float = 1e-6, seed: int = 0,
               profile: bool = False) -> AnchorResult:
    """Median seconds of ``repeats`` optimizer steps (after ``warmup``) over ``rows`` random
    rows of ``seq`` tokens of the model at ``model_dir`` (the random-weight model the
    benchmark writes, so the same weights as the backends'); ``params``: its parameter count
    for the FLOPs (pass the caller's, so every row of a table counts them the same way; by
    default the model's distinct parameters, a tied embedding once)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(dev)
    model.train()
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    if params is None:
        params = sum(p.numel() for p in model.parameters())
    optimizer = _adamw([p for p in model.parameters() if p.requires_grad], lr)
    gen = torch.Generator().manual_seed(seed)
    # Token ids from 2 up (0 and 1 are pad and eos in the bench tokenizer): every token real.
    ids = torch.randint(2, model.config.vocab_size, (rows, seq), generator=gen).to(dev)
    try:
        seconds, peak = _measure(model, optimizer, ids, micro_rows, repeats, warmup, profile)
    finally:
        del model, optimizer, ids  # the next benchmark on this card needs the memory
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    flops = train_flops(params, layers, hidden, [seq] * rows)
    return AnchorResult(seconds=seconds, rows=rows, seq=seq, flops=flops, peak_gib=peak)


def _measure(model: Any, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
             micro_rows: int, repeats: int, warmup: int,
             profile: bool = False) -> tuple[float, float]:
    """(median seconds per step, peak GiB allocated while timing) of the loop itself;
    ``profile``: also where one step's GPU time goes (after the warm-up, before timing)."""
    dev, rows = ids.device, len(ids)

    def step() -> None:
        for mb in ids.split(micro_rows):
            # HF's loss is the token mean of its micro-batch: weighted by its share of the
            # rows, the accumulated gradient is the mean over the whole step.
            loss = model(input_ids=mb, labels=mb, use_cache=False).loss
            (loss * (len(mb) / rows)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if profile:
        profiled(step, "bare HF loop")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds = []
    for _ in range(repeats):
        _sync(dev)
        start = time.perf_counter()
        step()
        _sync(dev)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    return statistics.median(seconds), peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-rows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-throughput"))
    args = p.parse_args()
    model_dir = build_model(args.out / args.shape, args.shape)
    r = run_anchor(model_dir, rows=args.rows, seq=args.seq,
                   micro_rows=args.micro_rows, repeats=args.repeats, device=args.device)
    print(f"{args.shape} bare HF loop on {args.device}: {r.rows} x {r.seq} tokens, "
          f"{r.seconds:.3f} s/step, {r.tokens / r.seconds:.0f} tokens/s, "
          f"{r.flop_rate / 1e12:.2f} TFLOP/s, MFU {r.flop_rate / peak_flops():.1%}, "
          f"peak {r.peak_gib:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
