"""The megatron backend checked on GPUs, for each supported family (Qwen2 with tied embeddings,
Qwen3, Llama 3), on a small random bf16 model:

1. **Round trip**: HF safetensors -> Megatron shards -> the weight-sync export: every tensor
   bit-identical to the file, and no tensor missing or extra.
2. **Log-probs** against HF transformers (bf16, SDPA) on the same packed batch of unequal
   lengths: the largest difference on response tokens.
3. **Training**: three optimizer steps on a fixed batch with +-1 advantages move the
   log-probs of the positive tokens up and of the negative ones down.
4. **Resume**: a backend saved after one step and loaded into a fresh one takes the next step
   exactly as the original does (same loss, bit-identical weights after).

Run under torchrun; the world size is tp * pp * dp:

    torchrun --nproc-per-node 1 bench/megatron_backend_check.py
    torchrun --nproc-per-node 2 bench/megatron_backend_check.py --tp 2
    torchrun --nproc-per-node 2 bench/megatron_backend_check.py --pp 2
    torchrun --nproc-per-node 2 bench/megatron_backend_check.py            # dp 2

Exits non-zero when a check fails. Never part of `make test` (needs GPUs and megatron-core).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import family_configs, make_spec, random_batch  # bench/ is on sys.path

COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
          "max_position_embeddings": 256}
SAMPLES = 8


def families() -> dict[str, Any]:
    return family_configs(COMMON)


def write_models(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name, config in families().items():
        if (out / name / "config.json").exists():
            continue
        torch.manual_seed(0)
        config.torch_dtype = "bfloat16"
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out / name)


def hf_logprobs(model_dir: Path, batch: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from kuberl_trainer.backends.tokens import response_mask

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        b = batch.to("cuda")
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        # The plain computation (full float32 log-softmax), independent of the trainer's.
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        out = F.pad(logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    return (out * response_mask(b.loss_mask)).cpu()


def my_rows(backend: Any, batch: Any) -> Any:
    """This rank's data-parallel share of ``batch`` (what the driver would send it)."""
    from kuberl_trainer.backends.packing import step_shards

    dp_rank, dp_size, _ = backend.data_parallel_coords()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return batch.select(step_shards(lengths, dp_size, len(batch))[dp_rank])


def check_family(name: str, model_dir: Path, args: argparse.Namespace, world: int,
                 rank: int) -> dict[str, Any]:
    from kuberl_trainer.backends.hf_files import read_safetensors_dir
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=SAMPLES, micro_batch=2,
                     tp=args.tp, pp=args.pp, gpus=world, lr=1e-4)
    backend = MegatronBackend(spec, rank=rank, world_size=world, device="cuda")
    row: dict[str, Any] = {"family": name}

    exported = backend._hf_state()
    if rank == 0:
        on_disk = read_safetensors_dir(model_dir)
        row["tensors"] = len(on_disk)
        row["round trip exact"] = (sorted(exported) == sorted(on_disk) and all(
            torch.equal(exported[k], on_disk[k]) for k in on_disk))

    batch = random_batch(SAMPLES, prompt=6, response=(3, 40), vocab=COMMON["vocab_size"])
    ours = backend.logprobs(batch)
    _, _, reports = backend.data_parallel_coords()
    gathered = [None] * world
    dist.all_gather_object(gathered, ours if reports else None)
    if rank == 0:
        ours = next(g for g in gathered if g is not None)
        ref = hf_logprobs(model_dir, batch)
        row["max |logp - HF|"] = float((ours - ref).abs().max())
        row["mean |logp - HF|"] = float((ours - ref).abs().sum() / batch.loss_mask.sum())

    shard = my_rows(backend, batch)
    before = backend.logprobs(shard)
    backend.train_step(shard)
    ckpt = Path(args.out) / "ckpt" / name
    backend.save(ckpt)
    fresh = MegatronBackend(spec, rank=rank, world_size=world, device="cuda")
    fresh.load(ckpt)
    m_orig = backend.train_step(shard)
    m_fresh = fresh.train_step(shard)
    orig_w, fresh_w = backend._hf_state(), fresh._hf_state()
    backend.train_step(shard)
    after = backend.logprobs(shard)
    if reports:
        adv = shard.advantages
        up = float(((after - before) * (adv > 0)).sum() / (adv > 0).sum())
        down = float(((after - before) * (adv < 0)).sum() / (adv < 0).sum())
        row.update({"logp up (+adv)": up, "logp down (-adv)": down})
        row["resume loss equal"] = m_orig["loss"] == m_fresh["loss"]
    if rank == 0:
        row["resume weights exact"] = all(torch.equal(orig_w[k], fresh_w[k]) for k in orig_w)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    merged: dict[str, Any] = {}
    for r in rows:
        merged.update({k: v for k, v in r.items() if k not in merged})
    del backend, fresh
    torch.cuda.empty_cache()
    return merged


def passed(row: dict[str, Any]) -> bool:
    return bool(row["round trip exact"] and row["resume weights exact"]
                and row["resume loss equal"] and row["logp up (+adv)"] > 0
                and row["logp down (-adv)"] < 0 and row["max |logp - HF|"] < 0.25)


def run_family_checks(out: str, check: Callable[[str, Path, int, int], dict[str, Any]],
                      passed: Callable[[dict[str, Any]], bool], title: str, *,
                      names: Callable[[], Any] | None = None,
                      write: Callable[[Path], None] | None = None) -> int:
    """Under torchrun: write the models once (``write``, named by ``names``; default: the
    dense ``families``), ``check(name, dir, world, rank)`` each, print the rows as a table
    on rank 0 with ``title``; 0 when all passed."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    models = Path(out) / "models"
    if rank == 0:
        (write or write_models)(models)
    dist.barrier()
    rows = [check(name, models / name, world, rank)
            for name in (names or families)()]
    ok = all(passed(r) for r in rows)
    if rank == 0:
        print(f"\n{title}, {world} rank(s), on {torch.cuda.get_device_name()}")
        keys = list(rows[0])
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k])
                             for k in keys))
        print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--out", default="/tmp/kuberl-megatron-check")
    args = p.parse_args()
    return run_family_checks(
        args.out, lambda name, path, world, rank: check_family(name, path, args, world, rank),
        passed, f"megatron backend check: tp={args.tp} pp={args.pp}")


if __name__ == "__main__":
    sys.exit(main())
