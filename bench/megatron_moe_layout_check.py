"""The megatron backend's MoE model checked against HF transformers in float32, on a small random
Qwen3-MoE and Qwen2-MoE each: the backend's TransformerConfig, layer spec and routing settings
(``model.transformer_config``, ``layer_spec``), the HF checkpoint loaded through
``hf_layout``/``moe_layout``, and the routing-replay hook (``moe_runtime.Replay``).

1. **Logits**: megatron's vs HF's on the same tokens (largest |difference|).
2. **Recorded routes**: the experts megatron's routers chose are HF's, token for token.
3. **Replay**: HF's routes with its routers *perturbed* (each token's last expert swapped for
   its next best), replayed in megatron: megatron's logits become HF's perturbed ones, and
   the mismatch metric counts every replayed route (1.0).
4. **Aux loss in the backward**: with the policy loss multiplied by 0, the router still gets a
   gradient (the load-balancing loss's, through megatron's MoEAuxLossAutoScaler), and the
   ``moe_aux_loss`` metric reads about 1 (Switch's loss at near balance).
5. **Export round trip**: the model's parameters back to HF names (per-expert), bit-equal.

Runs where megatron-core is installed, on a GPU or on CPU (``--cpu``: gloo, megatron's
all-gather dispatcher instead of the all-to-all, which needs CUDA streams)::

    python bench/megatron_moe_layout_check.py            # GPU
    python bench/megatron_moe_layout_check.py --cpu      # no GPU, megatron-core on PYTHONPATH

Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import ROOT  # noqa: F401  (bench/ on sys.path; puts the packages on it)

SMALL = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
TOKENS = 32


def configs() -> dict[str, Any]:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    return {"qwen3-moe": Qwen3MoeConfig(**SMALL, head_dim=32, norm_topk_prob=True),
            "qwen2-moe": Qwen2MoeConfig(**SMALL, shared_expert_intermediate_size=48)}


def build(config: Any, device: str) -> tuple[Any, Any, Any]:
    """(HF model, megatron GPTModel loaded from it, its DecoderShape), float32."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoModelForCausalLM

    from kuberl_trainer.backends.megatron import hf_layout as L, model as M

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(device).eval()
    with torch.no_grad():  # routers far from uniform: no near-ties for float noise to flip
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    d = config.to_dict()
    shape = L.DecoderShape.from_hf_config(d)
    par = M.Parallel()
    c = M.transformer_config(shape, d, par, torch.float32, aux_loss_coef=0.01)
    if device == "cpu":
        c.use_cpu_initialization = True
        c.bias_activation_fusion = False       # (a jit-fused CUDA path)
        c.moe_token_dispatcher_type = "allgather"  # (the all-to-all needs CUDA streams)
    M._router_gemm_without_te()
    mg = GPTModel(config=c, transformer_layer_spec=M.layer_spec(shape),
                  vocab_size=L.padded_vocab(shape.vocab, 1), max_sequence_length=64,
                  position_embedding_type="rope", **M.rope_settings(d),
                  share_embeddings_and_output_weights=shape.tied, parallel_output=True)
    mg.to(device)
    M.load_hf(mg, {k: v.detach() for k, v in hf.state_dict().items()}, shape, par)
    return hf, mg.eval(), shape


def check(name: str, config: Any, device: str) -> dict[str, Any]:
    from kuberl_trainer.backends.megatron import hf_layout as L, model as M, moe_runtime as MR
    from kuberl_trainer.backends.megatron.moe_layout import normalise_hf
    from kuberl_wire.hf_routers import RouterControl

    hf, mg, shape = build(config, device)
    replay = MR.Replay(mg, shape.num_layers)
    ids = torch.randint(2, shape.vocab, (1, TOKENS), device=device)
    pos = torch.arange(TOKENS, device=device)[None]
    causal = torch.triu(torch.ones(TOKENS, TOKENS, device=device), diagonal=1).bool()[None, None]
    every = torch.ones(1, TOKENS, device=device)
    control = RouterControl(hf, shape.num_layers)

    def ours() -> torch.Tensor:
        return mg(ids, pos, attention_mask=causal)[..., :shape.vocab].reshape(1, TOKENS, -1)

    with torch.no_grad():
        with control.active(perturb=True):
            bent = hf(input_ids=ids).logits
        assert control.recorded is not None
        bent_routes = control.recorded.view(1, TOKENS, *control.recorded.shape[1:])
        with control.active():  # (the perturbed run's later layers saw other hidden states)
            want = hf(input_ids=ids).logits
        assert control.own is not None
        hf_own = control.own.view(1, TOKENS, *control.own.shape[1:])
        replay.set_micro_batch(None, every, record=True)
        own = ours()
        recorded = replay.take_recorded(every)
        replay.set_micro_batch(bent_routes, every, record=False)
        replayed = ours()
    row: dict[str, Any] = {"family": name}
    row["max |logit - HF|"] = float((own - want).abs().max())
    row["routes = HF's"] = bool((recorded.sort(-1).values == hf_own.sort(-1).values).all())
    row["replayed - HF bent"] = float((replayed - bent).abs().max())
    row["own - HF bent"] = float((own - bent).abs().max())
    row["mismatch"] = replay.mismatch(None)

    mg.train()
    replay.clear()
    MR.scale_aux_loss(mg, float(mg.config.moe_aux_loss_coeff), float(TOKENS))
    (mg(ids, pos, attention_mask=causal).float().sum() * 0.0).backward()
    router = MR.routers(mg)[0]
    row["aux-only router grad"] = float(router.weight.grad.abs().sum())
    row["moe_aux_loss"] = MR.aux_loss_metric(1, shape.num_layers, None)

    local = M.named_local_tensors(mg, M.Parallel(), shape.num_layers, shape.experts)
    back = L.megatron_to_hf(local, shape)
    hf_state = normalise_hf({k: v.detach() for k, v in hf.state_dict().items()})
    if shape.tied:
        hf_state.pop("lm_head.weight", None)
    row["export exact"] = sorted(back) == sorted(hf_state) and all(
        torch.equal(back[k], hf_state[k]) for k in hf_state)
    return row


def passed(row: dict[str, Any]) -> bool:
    return bool(row["max |logit - HF|"] < 1e-4 and row["routes = HF's"]
                and row["replayed - HF bent"] < 1e-4 and row["own - HF bent"] > 1e-3
                and row["mismatch"] == 1.0 and row["aux-only router grad"] > 0
                and 0.5 < row["moe_aux_loss"] < 2.0 and row["export exact"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    rows = [check(name, config, device) for name, config in configs().items()]
    ok = all(passed(r) for r in rows)
    where = "CPU" if args.cpu else torch.cuda.get_device_name()
    print(f"\nmegatron MoE layout check (float32) on {where}")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
