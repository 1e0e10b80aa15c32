"""On-policy distillation on the tiny job's addition task: which learning rates are stable.

The student is the tiny model after 300 SFT steps, the teacher the same model after 800
(built and cached by tests/integration/local_run.py's `tiny_job`). For each learning rate it
runs the real pieces without Ray - a reference engine subprocess, RolloutManager, the fsdp
backend, weight sync over HTTP - and every 8 steps measures, on one fixed set of 128 prompts x
8 samples, the exact reward and the reverse KL(student || teacher). Prints a table.

    .venv/bin/python bench/distill_lr.py --lrs 1e-4,2e-4,5e-4 --steps 48
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run(lr: float, steps: int, every: int) -> list[tuple[int, float, float]]:
    from transformers import AutoTokenizer

    from kuberl_api.spec import RLJobSpec
    from kuberl_trainer.backends.fsdp import FSDPBackend
    from kuberl_trainer.engines.client import EngineClient
    from kuberl_trainer.rollout.grading import load_grader
    from kuberl_trainer.rollout.manager import RolloutManager
    from kuberl_trainer.rollout.prompts import PromptSource
    from kuberl_trainer.weight_sync.sender import send_tensors
    from tests.integration.local_run import TEACHER_SFT_STEPS, tiny_job

    student, teacher = tiny_job(), tiny_job(TEACHER_SFT_STEPS)
    data = str(student / "data" / "train.jsonl")
    body: dict[str, Any] = {
        "model": {"path": str(student / "model")},
        "data": {"prompts": data, "rolloutBatchSize": 16, "nSamplesPerPrompt": 8,
                 "maxPromptLen": 8, "maxResponseLen": 4},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": 64},
        "rollout": {"engine": "reference"},
        "reward": {"type": "exact"},
        "algorithm": {"advantageEstimator": "on_policy_distillation", "lr": lr,
                      "teacherPath": str(teacher / "model")}}
    spec = RLJobSpec.model_validate(body)
    eval_spec = RLJobSpec.model_validate({**body, "data": {**body["data"],
                                                           "rolloutBatchSize": 128}})
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(student / "model"),
         "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"],
        stderr=subprocess.DEVNULL)
    backend = FSDPBackend(spec, rank=0, world_size=1, device="cpu")
    tok = AutoTokenizer.from_pretrained(student / "model")
    out = []
    try:
        async with EngineClient([f"http://127.0.0.1:{port}"]) as client:
            await client.wait_healthy(timeout_s=60)

            async def measure(step: int) -> None:
                fixed = RolloutManager(eval_spec, PromptSource(data, "prompt", "label", seed=123),
                                       client, tok, load_grader(spec.reward), seed=5,
                                       ref_logprobs=backend.ref_logprobs)
                m = (await fixed.generate(0)).metrics
                out.append((step, m["reward_mean"], m["teacher_kl"]))

            train = RolloutManager(spec, PromptSource(data, "prompt", "label", seed=0), client,
                                   tok, load_grader(spec.reward), seed=0,
                                   ref_logprobs=backend.ref_logprobs)
            for step in range(steps):
                if step % every == 0:
                    await measure(step)
                backend.train_step((await train.generate(step)).batch)
                await send_tensors(client, backend.named_tensor_buckets(1 << 26),
                                   weight_version=str(step + 1))
            await measure(steps)
    finally:
        engine.kill()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default="1e-4,2e-4,5e-4")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--every", type=int, default=8)
    a = p.parse_args()
    print(f"{'lr':>8} {'step':>5} {'eval reward':>12} {'reverse KL':>11}")
    for lr in (float(x) for x in a.lrs.split(",")):
        for step, reward, kl in asyncio.run(run(lr, a.steps, a.every)):
            print(f"{lr:>8.0e} {step:>5} {reward:>12.3f} {kl:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
