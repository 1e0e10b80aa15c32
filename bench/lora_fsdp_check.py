"""training.lora on the fsdp backend across ranks: FSDP2 on GPUs (DDP over gloo on CPU), for
each family of bench/megatron_backend_check.py (Qwen2 with tied embeddings, Qwen3, Llama 3).

Per family, on a rank-8 adapter (alpha 16) over every linear layer:

1. **base**: after three optimizer steps, every weight the export sends that LoRA does not
   target is bit-for-bit what it was before training;
2. **merge**: every targeted weight sent equals W + (alpha/r) B A computed here from the
   gathered adapter (largest difference);
3. **reference**: ref log-probs (the adapter off) against a plain backend's log-probs of
   model.path (largest difference: 0 expected, the same ops);
4. **resume**: a fresh backend loading the saved checkpoint holds the same adapter, and the
   next step's metrics are the same (to a relative 1e-3: attention's backward on GPUs);
5. **offload**: the export after an offload and onload of weights and optimizer is the one
   before.

    torchrun --nproc-per-node 2 bench/lora_fsdp_check.py             # FSDP2 on 2 GPUs
    torchrun --nproc-per-node 2 bench/lora_fsdp_check.py --device cpu  # DDP over gloo

Exits non-zero when a check fails. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import random_batch  # bench/ is on sys.path
from megatron_backend_check import COMMON, families, write_models

SAMPLES, RANK, ALPHA = 16, 8, 16.0


def lora_spec(model_dir: Path, world: int, gpus: bool, **lora: Any) -> Any:
    """gpu_common.make_spec's job (one optimizer step a rollout), on ``world`` GPUs of one
    node or ``world`` CPU nodes, with ``lora`` as training.lora (none: a plain job)."""
    from kuberl_api.spec import RLJobSpec

    place = {"gpusPerNode": world} if gpus else {"nodes": world, "gpusPerNode": 0}
    return RLJobSpec.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"prompts": "/unused.jsonl", "rolloutBatchSize": SAMPLES,
                 "nSamplesPerPrompt": 1},
        "training": {"backend": "fsdp", "microBatchSize": 2, **place,
                     **({"lora": lora} if lora else {})},
        "rollout": {} if gpus else {"engine": "reference"},
        "algorithm": {"lr": 1e-3, "klCoef": 0.01},
    })


def export(backend: Any) -> dict[str, torch.Tensor]:
    """What weight sync sends, float32 on the host (collective)."""
    return {n: t.float().cpu() for bucket in backend.named_tensor_buckets(1 << 26)
            for n, t in bucket}


def full(t: torch.Tensor) -> torch.Tensor:
    gather = getattr(t, "full_tensor", None)
    return (gather() if callable(gather) else t).detach().float().cpu()


def adapter(backend: Any) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in backend.module.named_parameters() if p.requires_grad}


def check_family(name: str, model_dir: Path, out: Path, device: str, world: int,
                 rank: int) -> dict[str, Any]:
    from kuberl_trainer.backends.fsdp import FSDPBackend

    gpus = device == "cuda"
    spec = lora_spec(model_dir, world, gpus, rank=RANK, alpha=ALPHA)
    batch = random_batch(SAMPLES, prompt=6, response=(3, 40), vocab=COMMON["vocab_size"])
    shard = batch.split(world)[rank]
    backend = FSDPBackend(spec, rank=rank, world_size=world, device=device)
    row: dict[str, Any] = {"family": name, "mode": backend.mode}
    before = export(backend)
    for _ in range(3):
        metrics = backend.train_step(shard)
    row["adapter norm"] = metrics["lora_adapter_norm"]
    after = export(backend)
    params = adapter(backend)
    worst, untouched, targeted = 0.0, True, 0
    for key, weight in before.items():
        a = params.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.default.weight")
        if a is None or not key.endswith(".weight"):
            untouched &= torch.equal(after[key], weight)
            continue
        b = params[f"base_model.model.{key.removesuffix('.weight')}.lora_B.default.weight"]
        worst = max(worst, float((after[key] - (weight + (ALPHA / RANK) * (b @ a))).abs().max()))
        targeted += 1
    row["targeted"] = targeted
    row["base unchanged"] = untouched
    row["max |merged - hand|"] = worst

    plain = FSDPBackend(lora_spec(model_dir, world, gpus), rank=rank, world_size=world,
                        device=device)
    ref = backend.ref_logprobs(batch)
    row["max |ref - base|"] = float((ref - plain.logprobs(batch)).abs().max())
    del plain

    ckpt = out / "ckpt" / name
    backend.save(ckpt)
    again = FSDPBackend(spec, rank=rank, world_size=world, device=device)
    again.load(ckpt)
    same = adapter(again)
    row["resumed adapter equal"] = all(torch.equal(same[n], v) for n, v in params.items())
    # (the same step from the same state; on GPUs attention's backward may add in another
    # order, so equal to a relative 1e-3)
    one, two = backend.train_step(shard), again.train_step(shard)
    row["resumed step equal"] = all(abs(one[k] - two[k]) <= 1e-3 * max(abs(one[k]), 1e-6)
                                    for k in one)
    del again

    sent = export(backend)
    backend.offload(optimizer=True, weights=True)
    backend.onload()
    back = export(backend)
    row["offload round trip"] = all(torch.equal(back[n], v) for n, v in sent.items())
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    del backend
    if gpus:
        torch.cuda.empty_cache()
    return {**rows[0], "ranks agree": all(r == rows[0] for r in rows)}


def passed(row: dict[str, Any]) -> bool:
    return bool(row["base unchanged"] and row["targeted"] > 0
                and row["max |merged - hand|"] < 1e-4 and row["max |ref - base|"] < 1e-5
                and row["resumed adapter equal"] and row["resumed step equal"]
                and row["offload round trip"] and row["ranks agree"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="/tmp/kuberl-lora-check")
    args = p.parse_args()
    gpus = args.device == "cuda"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    out = Path(args.out)
    if rank == 0:
        write_models(out / "models")
    dist.barrier()
    rows = [check_family(name, out / "models" / name, out, args.device, world, rank)
            for name in families()]
    ok = all(passed(r) for r in rows)
    if rank == 0:
        print(f"\nLoRA on the fsdp backend, {world} rank(s), {args.device}")
        keys = list(rows[0])
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k])
                             for k in keys))
        print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
