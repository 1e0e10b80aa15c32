"""A training rank's actor, created before colocated engines start (issue 33's start-up order),
must hold no GPU memory until its `setup`: SGLang sizes its static pool from the memory free
when it starts, so a CUDA context of the trainer's at that moment would shrink every engine's
KV cache for the whole run.

On one GPU: the card's memory in use (nvidia-smi, this process holds no context) before, while
a process runs what `TrainWorker.__init__` runs (torch, the fsdp backend's
imports and the model's classes: `preload_backend`), and after that process creates a CUDA
context (the control: the check can see one). Prints a table; exits 1 when the actor's early
life took memory or the control showed none.

    PYTHONPATH=<ray, pydantic wheels>:operator:trainer_image:rollout_image:wire:bench \\
        python3 bench/gpu_early_actor.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_common

# What TrainWorker.__init__ does before `setup`, in a process of its own; then, on a line
# from the parent, the control: a CUDA context.
CHILD = r"""
import sys, torch
from kuberl_trainer.actors import TrainWorker
worker = TrainWorker(sys.argv[1], rank=0, world_size=1)
print("init", flush=True)
sys.stdin.readline()
torch.zeros(1, device="cuda")
print("context", flush=True)
sys.stdin.readline()
"""


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                          "nounits", "-i", "0"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def settle() -> int:
    time.sleep(2)  # nvidia-smi's reading trails a context's creation
    return used_mib()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="early-actor-") as tmp:
        # (built in a process of its own: building on the GPU opens a context in this one)
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from gpu_common import build_model; "
                        "build_model(Path(sys.argv[1]), 'qwen2.5-0.5b')", tmp], check=True,
                       cwd=Path(gpu_common.__file__).parent)
        model = Path(tmp) / "model"
        spec = {"model": {"path": str(model)}, "data": {"prompts": "/dev/null"},
                "training": {"backend": "fsdp", "gpusPerNode": 1},
                "rollout": {"engine": "reference"}}
        from kuberl_api.spec import RLJobSpec

        spec_json = RLJobSpec.model_validate(spec).model_dump_json(by_alias=True)
        before = settle()
        child = subprocess.Popen([sys.executable, "-c", CHILD, spec_json], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        child.stdout.readline()
        early = settle()
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()
        context = settle()
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
    rows = [("before", before), ("actor initialised", early),
            ("the actor's CUDA context (control)", context)]
    print(f"{'phase':<40}{'GPU memory used MiB':>22}{'vs before':>12}")
    for name, mib in rows:
        print(f"{name:<40}{mib:>22}{mib - before:>+12}")
    ok = early == before and context - before >= 100
    print(json.dumps({"early_mib": early - before, "context_mib": context - before, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
