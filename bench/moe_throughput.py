"""Mixture-of-experts training throughput of the megatron backend on one GPU, beside a bare HF
training loop on the same card and weights (the anchor, ``hf_anchor.run_anchor``), plus routing
replay's cost per step and weight sync of every expert tensor after a change (a check).

The model: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value heads of 128, 128
experts of intermediate size 768, top-8, renormalised; vocabulary 151936) with fewer layers
(``--layers``, default 4: ~3.1B parameters, ~0.5B active per token), random bf16 weights.

FLOPs count **active** parameters (what one token passes through), PaLM's convention:

    per token:  6 * N_active + 6 * layers * q_dim * s   (causal attention over a sequence of s)
    N_active = layers * (attention's q, k, v, o + router E * H + top_k * 3 * H * I) + V * H

(the output layer counts, the embedding lookup does not; ``q_dim`` = heads * head_dim = 4096).
MFU = that FLOP rate over the card's dense bf16 peak (gpu_common.PEAK_BF16_FLOPS). The anchor
runs dense 2048-token rows (no padding, HF's own loss, fused AdamW on bf16 weights, no aux
loss); the backend an RL batch of variable lengths (packed, fp32 master weights, aux loss).

    python bench/moe_throughput.py                 # on a GPU
    python bench/moe_throughput.py --dry-run       # the HF parts on CPU with a tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import make_spec, peak_flops, random_batch, train_flops  # bench/ on sys.path

A3B = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
       "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
       "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
       "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "max_position_embeddings": 4096,
       "tie_word_embeddings": False}
TINY = {**A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512}


def write_model(out: Path, shape: dict[str, Any], layers: int, device: str) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if (out / "config.json").exists():
        return out
    config = Qwen3MoeConfig(**shape, num_hidden_layers=layers)
    config.torch_dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out


def active_params(c: dict[str, Any], layers: int) -> int:
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], (
        c["num_key_value_heads"] * c["head_dim"])
    attention = h * q + 2 * h * kv + q * h
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    return layers * (attention + c["num_experts"] * h + experts) + c["vocab_size"] * h


def step_flops(c: dict[str, Any], layers: int, lengths: list[int]) -> float:
    q_dim = c["num_attention_heads"] * c["head_dim"]
    return train_flops(active_params(c, layers), layers, q_dim, lengths)


def random_routes(batch: Any, layers: int, experts: int, k: int) -> torch.Tensor:
    """Distinct random experts for every token and layer: replay's worst case (every route
    differs from the router's own)."""
    b, t = batch.input_ids.shape
    scores = torch.rand(b, t, layers, experts)
    return scores.topk(k, dim=-1).indices


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


Row = tuple[str, int, float, float, float, int]  # name, tokens, FLOPs, s/step, peak GiB, GPUs


def print_table(rows: list[Row]) -> None:
    """The runs side by side, rates per GPU; the last row is the anchor the ratio is to."""
    anchor_rate = rows[-1][2] / rows[-1][3] / rows[-1][5]
    print(f"\n{'run':<29} {'GPUs':>4} {'tokens':>7} {'s/step':>7} {'tokens/s':>9} "
          f"{'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>8} {'/ anchor':>8}")
    for name, tokens, flops, seconds, peak, gpus in rows:
        rate = flops / seconds / gpus
        print(f"{name:<29} {gpus:>4} {tokens:>7} {seconds:>7.3f} {tokens / seconds:>9.0f} "
              f"{rate / 1e12:>11.2f} {rate / peak_flops():>6.1%} {peak:>8.1f} "
              f"{rate / anchor_rate:>7.2f}x")


def megatron_rows(model_dir: Path, c: dict[str, Any], layers: int, args: argparse.Namespace
                  ) -> dict[str, Any]:
    from kuberl_trainer.backends.megatron import grouped_experts, hf_layout as L, model as M
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=args.samples, micro_batch=1,
                     max_tokens=args.micro_tokens, lr=1e-5)
    backend = MegatronBackend(spec, rank=0, world_size=1, device="cuda")
    batch = random_batch(args.samples, prompt=256, response=(128, 1024), vocab=c["vocab_size"])
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1)]
    out: dict[str, Any] = {"tokens": sum(lengths), "flops": step_flops(c, layers, lengths)}
    torch.cuda.reset_peak_memory_stats()
    out["off"] = timed(lambda: backend.train_step(batch), args.repeats)
    out["peak"] = torch.cuda.max_memory_allocated() / 2**30
    grouped_experts.ENABLED = False  # megatron's own SequentialMLP loop, same backend
    out["sequential"] = timed(lambda: backend.train_step(batch), args.repeats)
    grouped_experts.ENABLED = True
    backend.algo = spec.algorithm.model_copy(update={"routing_replay": "rollout"})
    # The router's own routes, recorded (what routingReplay: training does): replaying them
    # keeps the experts' load as it was, so the time difference is the hook's own cost.
    backend._record = True
    backend._logprobs(backend.model, batch)
    backend._record = False
    own = dataclasses.replace(batch, routes=backend.recorded.cpu())
    rand = dataclasses.replace(batch, routes=random_routes(
        batch, layers, c["num_experts"], c["num_experts_per_tok"]))
    for key, routed in (("replay", own), ("replay random", rand)):
        metrics: dict[str, float] = {}

        def replay_step(routed: Any = routed, metrics: dict[str, float] = metrics) -> None:
            metrics.update(backend.train_step(routed))

        out[key] = timed(replay_step, args.repeats)
        out[key + " mismatch"] = metrics.get("routing_replay_mismatch", float("nan"))
        out["aux"] = metrics.get("moe_aux_loss", float("nan"))
    backend.algo = spec.algorithm
    out["off again"] = timed(lambda: backend.train_step(batch), args.repeats)  # (warm now)
    # Weight sync after the weights changed: the export against the trainer's parameters.
    start = time.perf_counter()
    local = M.named_local_tensors(backend.model, backend.par, backend.shape.num_layers,
                                  backend.shape.experts)
    mine = L.megatron_to_hf(local, backend.shape)
    seen, equal, experts = set(), True, 0
    for bucket in backend.named_tensor_buckets(1 << 30):
        for name, t in bucket:
            seen.add(name)
            equal = equal and torch.equal(t, mine[name])
            experts += ".mlp.experts." in name
    torch.cuda.synchronize()
    out["sync s"] = time.perf_counter() - start
    out["sync exact"] = equal and seen == set(mine)
    out["expert tensors"] = experts
    return out  # (the caller frees the backend's memory once this frame is gone)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--anchor-rows", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-moe-throughput"))
    p.add_argument("--dry-run", action="store_true", help="tiny shape, HF anchor on CPU only")
    args = p.parse_args()
    from hf_anchor import run_anchor

    c = TINY if args.dry_run else A3B
    device = "cpu" if args.dry_run else "cuda"
    model_dir = write_model(args.out / ("tiny" if args.dry_run else f"a3b-{args.layers}l"), c,
                            args.layers, device)
    print(f"Qwen3-30B-A3B layer shape x {args.layers} layers: active params "
          f"{active_params(c, args.layers) / 1e9:.3f}B per token", flush=True)
    rows: list[tuple[str, int, float, float, float]] = []
    ok = True
    if not args.dry_run:
        m = megatron_rows(model_dir, c, args.layers, args)
        gc.collect()
        torch.cuda.empty_cache()  # the anchor needs the card
        rows.append(("megatron ep1", m["tokens"], m["flops"], m["off"], m["peak"]))
        rows.append(("megatron ep1 SequentialMLP", m["tokens"], m["flops"], m["sequential"],
                     m["peak"]))
        rows.append(("megatron ep1 (again, warm)", m["tokens"], m["flops"], m["off again"],
                     m["peak"]))
        rows.append(("megatron ep1 + replay own", m["tokens"], m["flops"], m["replay"],
                     m["peak"]))
        rows.append(("megatron ep1 + replay random", m["tokens"], m["flops"],
                     m["replay random"], m["peak"]))
        ok = bool(m["sync exact"]) and m["expert tensors"] == (
            args.layers * c["num_experts"] * 3)
        base = min(m["off"], m["off again"])
        print(f"routing replay of the router's own routes: {m['replay'] - base:+.3f} "
              f"s/step ({m['replay'] / base - 1:+.1%}), mismatch "
              f"{m['replay mismatch']:.3f} (the policy moved between steps); of uniformly "
              f"random routes: {m['replay random'] - base:+.3f} s/step, mismatch "
              f"{m['replay random mismatch']:.3f}; moe_aux_loss {m['aux']:.4f}", flush=True)
        print(f"weight sync after training: {m['expert tensors']} expert tensors, exact="
              f"{m['sync exact']}, {m['sync s']:.2f} s (export + compare)", flush=True)
    rows_n = 2 if args.dry_run else args.anchor_rows
    seq = 64 if args.dry_run else 2048
    a = run_anchor(model_dir, rows=rows_n, seq=seq, micro_rows=2 if args.dry_run else 4,
                   repeats=1 if args.dry_run else args.repeats, device=device)
    rows.append(("bare HF loop", a.tokens, step_flops(c, args.layers, [seq] * rows_n),
                 a.seconds, a.peak_gib))
    print_table([(*row, 1) for row in rows])
    print("PASS" if ok else "FAIL: weight sync of the experts is not exact")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
