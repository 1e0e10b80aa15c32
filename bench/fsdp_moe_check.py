"""The fsdp backend's mixture-of-experts path on GPUs (bf16 autocast on one GPU, FSDP2 over
several), for Qwen3-MoE and Qwen2-MoE, on megatron_moe_check.py's small random models:

1. **Weight sync names**: the backend's buckets are the HF checkpoint's tensors, name for name
   (each expert's matrices apart, as SGLang's loaders read them), equal to the file.
2. **Log-probs** against HF transformers (bf16, padded rows) on a batch of unequal lengths.
3. **Rollout replay**: HF's routes recorded with its routers *perturbed* (each token's last
   expert swapped for its next best, as a test engine does) and replayed by the backend: its
   log-probs move to HF's perturbed ones, and the step's ``routing_replay_mismatch`` reads ~1.
4. **Training**: three steps with +-1 advantages (replay on, aux loss 0.01) move the positive
   tokens' log-probs up and the negative ones' down; ``moe_aux_loss`` is reported.
5. **Weight sync after a change**: after training, the buckets equal the trainer's own fused
   parameters split per expert, and every expert tensor differs from the file.
6. **routingReplay: training** (two optimizer steps per rollout): the old-log-prob pass runs
   and records the routes the steps replay.

    torchrun --nproc-per-node 1 bench/fsdp_moe_check.py
    torchrun --nproc-per-node 2 bench/fsdp_moe_check.py     # FSDP2

Exits non-zero when a check fails. Never part of `make test` (needs GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_common import make_spec, random_batch, train_and_measure  # bench/ is on sys.path
from megatron_backend_check import run_family_checks
from megatron_moe_check import SMALL, configs, hf_logprobs, hf_model, write_models

SHARD = 8  # samples a rank trains on


def sync_state(backend: Any) -> dict[str, torch.Tensor]:
    """What weight sync sends (a collective under FSDP2), on the CPU."""
    return {name: t.cpu() for bucket in backend.named_tensor_buckets(1 << 26, torch.bfloat16)
            for name, t in bucket}


def check(name: str, model_dir: Path, world: int, rank: int) -> dict[str, Any]:
    from kuberl_trainer.backends.fsdp import FSDPBackend
    from kuberl_trainer.backends.hf_files import read_safetensors_dir
    from kuberl_wire import expert_names

    samples = SHARD * world
    spec = make_spec(model_dir, backend="fsdp", samples=samples, micro_batch=2, gpus=world,
                     lr=1e-4, routerAuxLossCoef=0.01)
    # (set past validation: make_spec's engines are SGLang's, which cannot return routes)
    spec = spec.model_copy(update={
        "algorithm": spec.algorithm.model_copy(update={"routing_replay": "rollout"})})
    backend = FSDPBackend(spec, rank=rank, world_size=world, device="cuda")
    row: dict[str, Any] = {"family": name}
    on_disk = {k: v.to(torch.bfloat16) for k, v in read_safetensors_dir(model_dir).items()}
    sent = sync_state(backend)
    row["sync names = checkpoint's"] = sorted(sent) == sorted(on_disk)
    row["sync = file"] = row["sync names = checkpoint's"] and all(
        torch.equal(sent[k], on_disk[k]) for k in on_disk)

    batch = random_batch(samples, prompt=6, response=(3, 40), vocab=SMALL["vocab_size"])
    ref = hf_model(model_dir, torch.bfloat16)
    hf_own, own_routes = hf_logprobs(ref, batch)
    hf_bent, bent_routes = hf_logprobs(ref, batch, perturb=True)
    del ref
    n = float(batch.loss_mask.sum())
    ours = backend.logprobs(dataclasses.replace(batch, routes=own_routes))
    replayed = backend.logprobs(dataclasses.replace(batch, routes=bent_routes))
    row["logp vs HF (mean)"] = float((ours - hf_own).abs().sum()) / n
    row["own vs HF-bent"] = float((ours - hf_bent).abs().sum()) / n
    row["replayed vs HF-bent"] = float((replayed - hf_bent).abs().sum()) / n

    train = dataclasses.replace(batch, routes=bent_routes).split(world)[rank]
    moved, metrics = train_and_measure(backend, train)
    row.update(moved)
    row["moe_aux_loss"] = metrics[-1].get("moe_aux_loss", float("nan"))
    row["step mismatch"] = metrics[0].get("routing_replay_mismatch", float("nan"))

    sent = sync_state(backend)
    full = {k: v.detach().to(torch.bfloat16).cpu()
            for k, v in backend.module.state_dict().items()} if world == 1 else None
    if full is not None:
        # (a tied model's state_dict names its one tensor twice; sync sends the first name)
        mine = dict(part for k, v in full.items() for part in expert_names.split(k, v))
        row["sync = trainer after steps"] = set(sent) <= set(mine) and all(
            torch.equal(mine[k], sent[k]) for k in sent)
    experts = [k for k in sent if ".mlp.experts." in k]
    row["experts changed"] = f"{sum(not torch.equal(sent[k], on_disk[k]) for k in experts)}" \
                             f"/{len(experts)}"
    del backend
    torch.cuda.empty_cache()

    two = spec.model_copy(update={
        "training": spec.training.model_copy(update={"global_batch_size": samples // 2}),
        "algorithm": spec.algorithm.model_copy(update={"routing_replay": "training"})})
    backend = FSDPBackend(two, rank=rank, world_size=world, device="cuda")
    got = backend.train_step(dataclasses.replace(batch, routes=None).split(world)[rank])
    row["training-mode recomputed"] = got.get("old_logprobs_recomputed", 0.0)
    row["training-mode mismatch"] = got.get("routing_replay_mismatch", float("nan"))
    del backend
    torch.cuda.empty_cache()
    return row


def passed(row: dict[str, Any]) -> bool:
    done, total = map(int, row["experts changed"].split("/"))
    return bool(row["sync = file"] and row.get("sync = trainer after steps", True)
                and row["replayed vs HF-bent"] < row["own vs HF-bent"] / 3
                and row["step mismatch"] > 0.9
                and row["logp up (+adv)"] > 0 > row["logp down (-adv)"]
                and row["moe_aux_loss"] > 0 and done == total > 0
                and row["training-mode recomputed"] == 1
                and 0 <= row["training-mode mismatch"] < 0.5)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/kuberl-fsdp-moe-check")
    args = p.parse_args()
    return run_family_checks(args.out, check, passed, "fsdp backend MoE check",
                             names=configs, write=write_models)


if __name__ == "__main__":
    sys.exit(main())
