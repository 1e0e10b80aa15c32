"""PPO's critic on GPUs: the GPU check of the shared (half a GPU beside each trainer, one Ray
bundle) and dedicated (a GPU of its own) critic placements, on the tiny job.

For each placement it runs `kuberl run` (local Ray over the machine's GPUs, reference engine,
fsdp backend) for a few PPO steps and prints a table: reward, value loss, explained variance,
step-time split, and which GPU each actor saw. Then it checks the value model on CUDA against
CPU (same weights, same batch). Needs 2 GPUs for the dedicated run.

    PYTHONPATH=operator:trainer_image:rollout_image:wire python3 bench/gpu_ppo_check.py \\
        --tiny out/tiny --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def manifest(tiny: Path, name: str, critic: dict[str, Any], steps: int) -> dict[str, Any]:
    return {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
            "spec": {
                "model": {"path": str(tiny / "model")},
                "data": {"prompts": str(tiny / "data/train.jsonl"), "rolloutBatchSize": 32,
                         "nSamplesPerPrompt": 8, "maxPromptLen": 8, "maxResponseLen": 4},
                "reward": {"type": "exact"},
                "algorithm": {"advantageEstimator": "ppo", "lr": 2e-4, "klCoef": 0.01,
                              "klPenalty": "reward"},
                "critic": {"lr": 1e-3, **critic},
                "training": {"backend": "fsdp", "gpusPerNode": 1, "microBatchSize": 256},
                "rollout": {"engine": "reference", "gpus": 1},
                "schedule": {"numRollouts": steps}}}


def run(tiny: Path, out: Path, name: str, critic: dict[str, Any], steps: int) -> list[dict]:
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(manifest(tiny, name, critic, steps)))
    cmd = [sys.executable, "-c", "import sys; from kuberl_cli.main import main; "
           "sys.exit(main(sys.argv[1:]))", "run", str(job), "--output-dir", str(work / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    (work / "log.txt").write_text(done.stdout + "\n" + done.stderr)
    if done.returncode:
        sys.exit(f"{name}: kuberl run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in (work / "run/metrics.jsonl").read_text().splitlines()]


def value_model_cuda_vs_cpu(tiny: Path) -> float:
    import torch

    from kuberl_api.spec import RLJobSpec
    from kuberl_trainer.backends.base import TrainBatch
    from kuberl_trainer.backends.value import ValueBackend

    spec = RLJobSpec.model_validate(manifest(tiny, "x", {}, 1)["spec"])
    ids = torch.randint(1, 14, (16, 10))
    mask = torch.zeros(16, 10)
    mask[:, 6:] = 1
    batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                       advantages=torch.zeros(16, 10), rollout_logprobs=torch.zeros(16, 10))
    cpu = ValueBackend(spec, rank=0, world_size=1, device="cpu").values(batch)
    gpu = ValueBackend(spec, rank=0, world_size=1, device="cuda").values(batch)
    return float((cpu - gpu).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", type=Path, default=ROOT / "out/tiny")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_ppo")))
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    import torch

    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    print(f"value model, CUDA (bf16 autocast) vs CPU, max |diff|: "
          f"{value_model_cuda_vs_cpu(a.tiny):.4f}")
    placements = {"shared": {}, "dedicated": {"placement": "dedicated", "gpusPerNode": 1}}
    if torch.cuda.device_count() < 2:
        placements.pop("dedicated")
    print(f"{'critic':>10} {'step':>4} {'reward':>7} {'v_loss':>7} {'expl_var':>8} "
          f"{'gen s':>6} {'train s':>7} {'sync s':>6}")
    for name, critic in placements.items():
        rows = run(a.tiny, a.out, f"ppo-{name}", critic, a.steps)
        log = (a.out / f"ppo-{name}" / "log.txt").read_text().splitlines()
        for line in log:  # where each actor ran
            if "Worker rank" in line or "engine 0 (" in line:
                print(f"  [{name}] {line.split(')', 1)[-1].strip()[:150]}")
        for r in rows:
            print(f"{name:>10} {r['step']:>4} {r['reward_mean']:>7.3f} {r['value_loss']:>7.3f} "
                  f"{r.get('explained_variance', float('nan')):>8.3f} "
                  f"{r['time_generate_s']:>6.2f} {r['time_train_s']:>7.2f} "
                  f"{r['time_sync_s']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
