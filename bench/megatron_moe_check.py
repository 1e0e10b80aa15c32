"""The megatron backend's mixture-of-experts path checked on GPUs, for Qwen3-MoE (norm_topk_prob)
and Qwen2-MoE (shared expert, no renormalisation), on small random models:

1. **Logits, fp32**: the backend's own GPTModel (``model.build_gpt``: its TransformerConfig,
   MoE layer spec and routing settings) in float32, loaded from the HF checkpoint, against HF
   transformers' float32 logits on the same tokens.
2. **Round trip**: HF safetensors -> Megatron shards (experts split over ep) -> weight-sync
   export: every tensor, each expert's three matrices included, bit-identical to the file.
3. **Log-probs** (bf16) against HF on a packed batch of unequal lengths, and the grouped
   experts' (``grouped_experts``, the default on Hopper) against megatron's SequentialMLP
   loop on the same weights.
4. **Routing replay** (``routingReplay: rollout``): HF's routes recorded with the routers
   *perturbed* (each token's last expert swapped for its next best, as a test engine does)
   and replayed in the trainer: the mismatch metric reads ~1 (every replayed route differs
   from the trainer's own) and the trainer's log-probs move to HF's perturbed ones (their
   difference falls well below that of the trainer's own routing).
5. **Training**: three steps with +-1 advantages (aux loss on, replay on) move the positive
   tokens' log-probs up and the negative ones' down; ``moe_aux_loss`` is reported (> 0).
6. **Weight sync after a change**: after training, the export equals the trainer's own
   parameters converted to HF names, every expert tensor bit for bit.
7. **routingReplay: training**: two optimizer steps per ``train_step``: the old-log-prob pass
   runs and records the routes, both steps replay them and report the mismatch (the second
   step's policy has moved by one update: small, not zero).

Run under torchrun; world size = ep (tp 1: an MoE model trains with tp 1)::

    torchrun --nproc-per-node 1 bench/megatron_moe_check.py
    torchrun --nproc-per-node 2 bench/megatron_moe_check.py --ep 2
    torchrun --nproc-per-node 2 bench/megatron_moe_check.py --etp 2   # each expert split

Exits non-zero when a check fails. Never part of `make test` (needs GPUs and megatron-core).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import make_spec, random_batch, train_and_measure  # bench/ is on sys.path

SMALL = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
         "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
         "max_position_embeddings": 256}
SAMPLES = 8


def configs() -> dict[str, Any]:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    return {"qwen3-moe": Qwen3MoeConfig(**SMALL, head_dim=64, norm_topk_prob=True,
                                        tie_word_embeddings=False),
            "qwen2-moe": Qwen2MoeConfig(**SMALL, shared_expert_intermediate_size=192,
                                        tie_word_embeddings=True)}


def write_models(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name, config in configs().items():
        if (out / name / "config.json").exists():
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # random routers far from uniform: routing decisions are clear
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
        model.to(torch.bfloat16).save_pretrained(out / name)


def hf_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                attn_implementation="sdpa").cuda().eval()


def hf_logprobs(model: Any, batch: Any, replay: torch.Tensor | None = None,
                perturb: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's log-probs of ``batch`` and the routes it used ``[B, T, layers, k]``."""
    from kuberl_trainer.backends.tokens import response_mask
    from kuberl_wire.hf_routers import RouterControl

    b = batch.to("cuda")
    control = RouterControl(model, model.config.num_hidden_layers)
    with torch.no_grad(), control.active(replay=replay, perturb=perturb):
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    out = F.pad(logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    assert control.recorded is not None
    routes = control.recorded.view(*b.input_ids.shape, *control.recorded.shape[1:])
    return (out * response_mask(b.loss_mask)).cpu(), routes.cpu()


def fp32_logits_diff(backend: Any, model_dir: Path) -> float:
    """Largest |logit| difference between the backend's GPTModel built in fp32 and HF fp32."""
    from kuberl_trainer.backends.hf_files import read_safetensors_dir
    from kuberl_trainer.backends.megatron import hf_layout as L, model as M

    hf_config = M.read_hf_config(model_dir)
    shape = L.DecoderShape.from_hf_config(hf_config)
    module = M.build_gpt(shape, hf_config, backend.par, dtype=torch.float32)
    state = {k: v.float() for k, v in read_safetensors_dir(model_dir).items()}
    M.load_hf(module, state, shape, backend.par)
    module.eval()
    torch.manual_seed(1)
    ids = torch.randint(2, SMALL["vocab_size"], (2, 48), device="cuda")
    pos = torch.arange(48, device="cuda")[None].expand_as(ids)
    mask = torch.triu(torch.ones(48, 48, device="cuda"), diagonal=1).bool()[None, None]
    ref = hf_model(model_dir, torch.float32)
    with torch.no_grad():
        ours = module(ids, pos, attention_mask=mask)[..., :shape.vocab].float()
        want = ref(input_ids=ids).logits.float()
    del module, ref
    return float((ours - want).abs().max())


def check(name: str, model_dir: Path, world: int, rank: int, args: argparse.Namespace
          ) -> dict[str, Any]:
    from kuberl_trainer.backends.hf_files import read_safetensors_dir
    from kuberl_trainer.backends.megatron import grouped_experts, hf_layout as L, model as M
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=SAMPLES, micro_batch=2,
                     gpus=world, lr=1e-4, routerAuxLossCoef=0.01)
    if args.ep != 1 or args.etp is not None:
        training = spec.training.model_copy(update={
            "parallelism": spec.training.parallelism.model_copy(update={"ep": args.ep,
                                                                        "etp": args.etp})})
        spec = spec.model_copy(update={"training": training})
    backend = MegatronBackend(spec, rank=rank, world_size=world, device="cuda")
    row: dict[str, Any] = {"family": name}
    if world == 1:
        row["fp32 max |logit diff|"] = fp32_logits_diff(backend, model_dir)

    exported = backend._hf_state()
    if rank == 0:
        on_disk = read_safetensors_dir(model_dir)
        row["tensors"] = len(on_disk)
        row["round trip exact"] = (sorted(exported) == sorted(on_disk) and all(
            torch.equal(exported[k], on_disk[k]) for k in on_disk))

    batch = random_batch(SAMPLES, prompt=6, response=(3, 40), vocab=SMALL["vocab_size"])
    ref = hf_model(model_dir, torch.bfloat16)
    hf_own, _ = hf_logprobs(ref, batch)
    hf_bent, bent_routes = hf_logprobs(ref, batch, perturb=True)
    del ref
    ours = backend.logprobs(batch)
    grouped_experts.ENABLED = False  # megatron's SequentialMLP loop on the same weights
    looped = backend.logprobs(batch)
    grouped_experts.ENABLED = True
    backend.algo = spec.algorithm.model_copy(update={"routing_replay": "rollout"})
    backend.replay.reset_counts()
    replayed = backend.logprobs(dataclasses.replace(batch, routes=bent_routes))
    mismatch = backend.replay.mismatch(None)
    if world == 1:
        n = float(batch.loss_mask.sum())
        row["logp vs HF (mean)"] = float((ours - hf_own).abs().sum()) / n
        row["grouped vs loop (mean)"] = float((ours - looped).abs().sum()) / n
        row["own vs HF-bent"] = float((ours - hf_bent).abs().sum()) / n
        row["replayed vs HF-bent"] = float((replayed - hf_bent).abs().sum()) / n
        row["replay mismatch"] = mismatch

    train = dataclasses.replace(batch, routes=bent_routes)
    moved, metrics = train_and_measure(backend, train)
    row.update(moved)
    row["moe_aux_loss"] = metrics[-1].get("moe_aux_loss", float("nan"))
    row["step mismatch"] = metrics[-1].get("routing_replay_mismatch", float("nan"))

    exported = backend._hf_state()
    if world == 1:
        local = M.named_local_tensors(backend.model, backend.par, backend.shape.num_layers,
                                      backend.shape.experts)
        mine = L.megatron_to_hf({k: v.cpu() for k, v in local.items()}, backend.shape)
        experts = [k for k in mine if ".mlp.experts." in k]
        row["sync exact after steps"] = (sorted(mine) == sorted(exported) and all(
            torch.equal(mine[k], exported[k]) for k in mine))
        row["expert tensors"] = len(experts)
        row["experts changed"] = sum(
            not torch.equal(exported[k], on_disk[k]) for k in experts)
    del backend
    torch.cuda.empty_cache()

    # routingReplay training: two optimizer steps per train_step, so the backend runs an
    # old-log-prob pass, records its routers' choice there and replays it in both steps.
    two = spec.model_copy(update={
        "training": spec.training.model_copy(update={"global_batch_size": SAMPLES // 2}),
        "algorithm": spec.algorithm.model_copy(update={"routing_replay": "training"})})
    backend = MegatronBackend(two, rank=rank, world_size=world, device="cuda")
    got = backend.train_step(my_rows(backend, batch))
    row["training-mode recomputed"] = got.get("old_logprobs_recomputed", 0.0)
    row["training-mode mismatch"] = got.get("routing_replay_mismatch", float("nan"))
    del backend
    torch.cuda.empty_cache()
    return row


def my_rows(backend: Any, batch: Any) -> Any:
    """This rank's data-parallel share of ``batch`` (what the driver would send it)."""
    from kuberl_trainer.backends.packing import step_shards

    dp_rank, dp_size, _ = backend.data_parallel_coords()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return batch.select(step_shards(lengths, dp_size, len(batch))[dp_rank])


def passed(row: dict[str, Any]) -> bool:
    ok = bool(row["round trip exact"] and row["logp up (+adv)"] > 0
              and row["logp down (-adv)"] < 0 and row["moe_aux_loss"] > 0
              and row["training-mode recomputed"] == 1.0
              and 0.0 <= row["training-mode mismatch"] < 0.5)
    if "fp32 max |logit diff|" in row:
        ok = ok and row["fp32 max |logit diff|"] < 1e-3
        ok = ok and row["grouped vs loop (mean)"] < 0.01 and row["logp vs HF (mean)"] < 0.01
        ok = ok and row["replay mismatch"] > 0.9
        ok = ok and row["replayed vs HF-bent"] < 0.5 * row["own vs HF-bent"]
        ok = ok and row["sync exact after steps"] and row["experts changed"] > 0
    return ok


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (default: tp, 1): ep x etp ranks")
    p.add_argument("--out", default="/tmp/kuberl-moe-check")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    models = Path(args.out) / "models"
    if rank == 0:
        write_models(models)
    dist.barrier()
    rows = []
    for name in configs():
        try:
            rows.append(check(name, models / name, world, rank, args))
        except Exception as exc:
            import traceback

            traceback.print_exc()
            rows.append({"family": name, "error": repr(exc)[:200]})
    # (rank 0 holds the checks' values; every rank reports its own errors)
    ok = all("error" not in r for r in rows) and (rank != 0 or all(passed(r) for r in rows))
    if rank == 0:
        print(f"\nmegatron MoE check: ep={args.ep}, etp={args.etp or 1}, {world} rank(s), on "
              f"{torch.cuda.get_device_name()}")
        for r in rows:
            print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in r.items()))
        print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
