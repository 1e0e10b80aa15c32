"""The fsdp backend's packed micro-batches checked on GPUs, for each supported family (Qwen2
with tied embeddings, Qwen3, Llama 3), on a small random bf16 model:

1. **Log-probs** against HF transformers (bf16, SDPA, padded rows) on a batch of unequal
   lengths: the largest difference on response tokens. The backend packs the rows and runs
   its variable-length attention (and, with ``--fused-kernels liger``, Liger's RoPE, RMSNorm
   and SwiGLU); HF pads and masks, with PyTorch's own ops.
2. **Passes**: how many forward passes each rank ran for the step. With several ranks
   (FSDP2) they must be equal, or the ranks' all-gathers would not pair up. The batch is
   sorted by length and dealt in contiguous shards (as the driver deals them), so with a
   small ``--max-tokens`` the ranks' own counts differ and the split is exercised.
3. **Training**: three optimizer steps with +-1 advantages move the log-probs of the
   positive tokens up and of the negative ones down.

    torchrun --nproc-per-node 1 bench/fsdp_backend_check.py
    torchrun --nproc-per-node 2 bench/fsdp_backend_check.py --max-tokens 96
    torchrun --nproc-per-node 1 bench/fsdp_backend_check.py --fused-kernels liger

Exits non-zero when a check fails. Never part of `make test` (needs GPUs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import make_spec, random_batch, train_and_measure  # bench/ is on sys.path
from megatron_backend_check import COMMON, hf_logprobs, run_family_checks

SAMPLES = 16


def check_family(name: str, model_dir: Path, max_tokens: int | None, kernels: str,
                 world: int, rank: int) -> dict[str, Any]:
    from kuberl_trainer.backends.fsdp import FSDPBackend

    row: dict[str, Any] = {"family": name}
    batch = random_batch(SAMPLES, prompt=6, response=(3, 40), vocab=COMMON["vocab_size"])
    # Shortest first: the driver deals fsdp ranks contiguous shards, so rank 0 gets the short
    # samples and the last rank the long ones, and their own pass counts differ.
    batch = batch.select(batch.attention_mask.sum(dim=1).argsort(stable=True))
    # HF's before the backend is built: fused kernels patch the family's modeling module, so
    # a model built afterwards would run them too and the comparison would not be with the
    # plain path.
    ref = hf_logprobs(model_dir, batch) if rank == 0 else None
    spec = make_spec(model_dir, backend="fsdp", samples=SAMPLES, micro_batch=2, gpus=world,
                     lr=1e-4, max_tokens=max_tokens, fused_kernels=kernels)
    backend = FSDPBackend(spec, rank=rank, world_size=world, device="cuda")
    ours = backend.logprobs(batch)  # every rank the whole batch (a collective under FSDP2)
    if ref is not None:
        row["max |logp - HF|"] = float((ours - ref).abs().max())
        row["mean |logp - HF|"] = float((ours - ref).abs().sum() / batch.loss_mask.sum())

    shard = batch.split(world)[rank]  # what the driver gives an fsdp rank
    own = len(_own_micros(backend, shard))
    passes = len(backend._micros(shard.to("cuda")))
    moved, _ = train_and_measure(backend, shard)
    row["own passes"] = own
    row["passes"] = passes
    row.update(moved)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    merged = dict(rows[0])
    merged["own passes"] = "/".join(str(r["own passes"]) for r in rows)
    merged["passes"] = "/".join(str(r["passes"]) for r in rows)
    merged["passes equal"] = len({r["passes"] for r in rows}) == 1
    merged["trained"] = all(r["logp up (+adv)"] > 0 > r["logp down (-adv)"] for r in rows)
    del backend
    torch.cuda.empty_cache()
    return merged


def _own_micros(backend: Any, shard: Any) -> list[Any]:
    """The micro-batches this rank would cut without matching the other ranks' count."""
    from kuberl_trainer.backends.micro_batches import micro_batches

    return micro_batches(shard, micro_batch_size=backend.micro_batch_size,
                         max_tokens=backend.spec.training.max_tokens_per_micro_batch)


def passed(row: dict[str, Any]) -> bool:
    return bool(row["passes equal"] and row["trained"] and row["max |logp - HF|"] < 0.25)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=None,
                   help="training.maxTokensPerMicroBatch (default: unset)")
    p.add_argument("--fused-kernels", default="none", choices=["none", "liger"],
                   help="training.fusedKernels (log-probs still compared with plain HF)")
    p.add_argument("--out", default="/tmp/kuberl-fsdp-check")
    args = p.parse_args()
    return run_family_checks(
        args.out, lambda name, path, world, rank: check_family(
            name, path, args.max_tokens, args.fused_kernels, world, rank),
        passed, f"fsdp backend check: maxTokensPerMicroBatch {args.max_tokens}, "
        f"fusedKernels {args.fused_kernels}")


if __name__ == "__main__":
    sys.exit(main())
