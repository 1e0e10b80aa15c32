"""algorithm.policyLoss: custom through the megatron backend on a GPU: a user's copy of PPO clip
(tests/user_losses.py:ppo_clip, written from the formula) trains as the built-in ppo on the same
batch, with TIS, a k3 KL term and an entropy bonus around it, under micro-batches of 1 and of
all the rows: the same loss, clip fraction, ratio, KL, entropy and gradient norm, and the same
weights after the step; and the custom run's metrics do not depend on the micro-batch size.
(The CPU twin, through fsdp: tests/unit/test_custom_loss.py.)

    torchrun --nproc-per-node 1 bench/megatron_custom_loss_check.py

Qwen2 (tied embeddings), small and random, bf16. Exits non-zero when a check fails.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_common import make_spec, random_batch  # bench/ is on sys.path
from megatron_backend_check import COMMON, write_models

EPS_LOW, EPS_HIGH = 0.2, 0.28
BUILT_IN = {"epsClip": EPS_LOW, "epsClipHigh": EPS_HIGH}
CUSTOM = {"policyLoss": "custom", "lossFunction": "tests.user_losses:ppo_clip",
          "lossArgs": {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}}
AROUND = {"tisCap": 1.1, "klCoef": 0.1, "klLossType": "k3", "entropyCoef": 0.01}
SAMPLES = 8
KEYS = ("loss", "pg_loss", "ratio_mean", "ratio_max", "grad_norm", "tis_truncated_fraction",
        "kl_ref", "entropy")
REL = 1e-5  # (fp32 loss math on bf16 activations: the two paths may round apart)


def backend(model_dir: Any, mbs: int, **algorithm: Any) -> Any:
    from kuberl_trainer.backends.megatron.backend import MegatronBackend

    spec = make_spec(model_dir, backend="megatron", samples=SAMPLES, micro_batch=mbs, lr=1e-4,
                     **algorithm, **AROUND)
    return MegatronBackend(spec, rank=0, world_size=1, device="cuda")


def off_policy(b: Any) -> Any:
    """A batch whose pi_old, engine and reference log-probs lie up to 0.4 from the policy's:
    ratios of 0.67-1.5, so PPO clips some tokens and TIS truncates some weights."""
    batch = random_batch(SAMPLES, prompt=6, response=(3, 40), vocab=COMMON["vocab_size"])
    now = b.logprobs(batch).cpu()
    gen = torch.Generator().manual_seed(1)

    def near() -> torch.Tensor:
        return (now + (torch.rand(now.shape, generator=gen) * 0.8 - 0.4)) * batch.loss_mask

    return dataclasses.replace(batch, old_logprobs=near(), rollout_logprobs=near(),
                               ref_logprobs=near())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    out = "/tmp/kuberl-custom-loss-check/models"
    write_models(Path(out))
    model = f"{out}/qwen2-tied"
    rows, ok = [], True
    batch = None
    for mbs in (1, SAMPLES):
        built_in, custom = backend(model, mbs, **BUILT_IN), backend(model, mbs, **CUSTOM)
        batch = batch or off_policy(built_in)
        ours, theirs = built_in.train_step(batch), custom.train_step(batch)
        w_ours, w_theirs = built_in._hf_state(), custom._hf_state()
        worst = max(rel(theirs[k], ours[k]) for k in KEYS)
        clip = rel(theirs["loss_clipfrac"], ours["pg_clipfrac"])
        same_weights = all(torch.equal(w_ours[k], w_theirs[k]) for k in w_ours)
        rows.append({"micro-batch": mbs, "clipfrac": ours["pg_clipfrac"],
                     "tis truncated": ours["tis_truncated_fraction"],
                     "worst rel diff (metrics)": worst, "clipfrac rel diff": clip,
                     "weights equal after step": same_weights, "custom": theirs})
        ok &= (worst < REL and clip < REL and same_weights and 0 < ours["pg_clipfrac"] < 1
               and 0 < ours["tis_truncated_fraction"] < 1)
        del built_in, custom
        torch.cuda.empty_cache()
    across = max(rel(rows[0]["custom"][k], rows[1]["custom"][k])
                 for k in ("loss", "pg_loss", "loss_clipfrac"))
    ok &= across < 1e-2
    print(f"\nmegatron custom loss check (qwen2, bf16), on {torch.cuda.get_device_name()}")
    keys = [k for k in rows[0] if k != "custom"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k])
                                for k in keys) + " |")
    print(f"custom, micro-batches of 1 vs {SAMPLES}: worst rel diff of loss, pg_loss, "
          f"clipfrac {across:.2e}")
    print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
