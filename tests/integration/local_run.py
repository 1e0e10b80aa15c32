"""`kuberl run` as a user runs it, for the integration tests: the tiny job's model and data
(built once per machine), a manifest around it, the command, and its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERL = [sys.executable, "-m", "kuberl_cli.main"]
SFT_STEPS = 300  # a partly trained policy: room for RL to improve it within a few steps
TEACHER_SFT_STEPS = 800  # the same model trained longer: a teacher for on-policy distillation


def tiny_job(sft_steps: int = SFT_STEPS) -> Path:
    """The tiny job's model and data, built once per machine (the build is seeded and cached
    under the user's cache directory, so later runs and clean clones reuse it)."""
    from kuberl_trainer.tiny.build import BuildConfig, build

    out = _cache() / f"test-tiny-sft{sft_steps}"
    build(out, BuildConfig(sft_steps=sft_steps))
    return out


def tiny_tool_job() -> Path:
    """The tiny agent's model and data (`tiny build --variant tool`), built once per machine
    as tiny_job is."""
    from kuberl_trainer.tiny.build import TOOL_SFT_STEPS, BuildConfig, build

    out = _cache() / f"test-tiny-tool-sft{TOOL_SFT_STEPS}"
    build(out, BuildConfig(sft_steps=TOOL_SFT_STEPS, variant="tool"))
    return out


def tiny_moe_job() -> Path:
    """The tiny job on a Qwen3-MoE policy (`tiny build --variant moe`: the add variant's data,
    4 experts, top-2), built once per machine as tiny_job is."""
    from kuberl_trainer.tiny.build import MOE_SFT_STEPS, BuildConfig, build

    out = _cache() / f"test-tiny-moe-sft{MOE_SFT_STEPS}"
    build(out, BuildConfig(sft_steps=MOE_SFT_STEPS, variant="moe"))
    return out


def tiny_reward_model(tiny: Path) -> Path:
    """The tiny reward model (`tiny reward-model`: the tiny policy's body, a score head fitted
    to prefer right answers), built once per machine from the tiny job's policy `tiny`."""
    from kuberl_trainer.tiny.reward_model import build_reward_model

    out = _cache() / f"test-{tiny.name}-reward-model"
    build_reward_model(out, tiny / "model")
    return out


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kuberl"


def manifest(tiny: Path, tmp: Path, name: str, **spec: Any) -> Path:
    body: dict[str, Any] = {
        "model": {"path": str(tiny / "model")},
        "data": {"prompts": str(tiny / "data" / "train.jsonl"), "rolloutBatchSize": 16,
                 "nSamplesPerPrompt": 8, "maxPromptLen": 8, "maxResponseLen": 4},
        "reward": {"type": "exact"},
        "algorithm": {"lr": 5e-4, "temperature": 1.0},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": 64},
        "rollout": {"engine": "reference"},
        "schedule": {"numRollouts": 4},
    }
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                                    "metadata": {"name": name}, "spec": body}))
    return path


def example_on_cpu(tiny: Path, tmp: Path, example: str, steps: int = 2) -> Path:
    """examples/<example> as a CPU runs it: its placement, engine layout (gpusPerEngine),
    memory settings (offload, memoryFraction), algorithm and schedule kinds as written; the
    model, data and reward the tiny job's; what needs a cluster (PVCs, node pools, resources)
    or CUDA (Megatron, SGLang, GPU counts) swapped for the local equivalent."""
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = doc["spec"]
    spec["model"] = {"path": str(tiny / "model")}
    spec["data"] = {"prompts": str(tiny / "data" / "train.jsonl"), "inputKey": "prompt",
                    "labelKey": "label", "rolloutBatchSize": 16,
                    "nSamplesPerPrompt": spec["data"]["nSamplesPerPrompt"], "maxPromptLen": 8,
                    "maxResponseLen": 4,
                    "evalSets": [{"name": "addition", "path": str(tiny / "data" / "eval.jsonl")}]}
    spec["reward"] = {"type": "exact"}
    spec["algorithm"] = {**spec["algorithm"], "lr": 5e-4}
    training = spec["training"]
    for cluster_only in ("nodePool", "resources", "parallelism"):  # parallelism: Megatron's
        training.pop(cluster_only, None)
    training.update(backend="fsdp", nodes=1, gpusPerNode=0, microBatchSize=64)
    spec["rollout"] = {**spec["rollout"], "engine": "reference", "gpus": 0}
    # every step evaluated (the engines generate again after the sync); saveInterval as
    # written, so the run's end saves (the engines release for it)
    spec["schedule"] = {**spec["schedule"], "numRollouts": steps, "evalInterval": 1}
    spec["checkpoint"] = {"path": "/checkpoints"}
    path = tmp / example
    path.write_text(yaml.safe_dump(doc))
    return path


# so `tests.integration.toy_rewards` imports (an existing path kept: a machine without the
# package installed, e.g. a GPU box running the benches from source, has it there)
def run_env() -> dict[str, str]:
    """This process's environment as it is now (bench/learning_margins.py sets numerics
    variables around each run), with the repository on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


ENV = run_env()  # as the test session started


# The Ray this test process's local runs join (conftest.shared_ray): set while it runs.
SHARED_RAY = "KUBERL_TEST_RAY"


def ray_host_script(cpus: int = 8, units: int = 16) -> str:
    """The shared Ray's host (conftest.shared_ray; bench/async_correction.py's runs side by
    side): a process of its own, so that the process that starts it can still start (and shut
    down) Sessions that join it, printing its address, up until its stdin closes. Custom
    resources: `units` of each kind, enough for any test job's actors."""
    return f"""
import sys, ray
ctx = ray.init(address="local", num_cpus={cpus}, include_dashboard=False, logging_level="ERROR",
               resources={{"kuberl_train": {units}, "kuberl_rollout": {units},
                          "kuberl_critic": {units}, "kuberl_reward": {units}}})
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the starting process closes it
ray.shutdown()
"""


def kuberl_run(job: Path, out: Path, *extra: str, timeout: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kuberl run job --output-dir out`, joining the test process's shared Ray when there is
    one (a Ray on this machine only: the run behaves as a local one, options.Options);
    `env`: variables set for this run on top of the test process's."""
    ray = ["--address", os.environ[SHARED_RAY]] if os.environ.get(SHARED_RAY) else []
    return subprocess.run([*KUBERL, "run", str(job), "--output-dir", str(out), *ray, *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=job.parent,
                          env={**run_env(), **(env or {})})


def failed(res: subprocess.CompletedProcess[str]) -> str:
    """What a failed `kuberl run` said: its exit status and the ends of its output."""
    return (f"exit {res.returncode}\n--- stderr ---\n{res.stderr[-3000:]}\n"
            f"--- stdout ---\n{res.stdout[-2000:]}")


def session_options(tmp: Path) -> Any:
    """options.Options for a Session a test drives in its own process (the shared Ray, if any)."""
    from kuberl_trainer.options import Options

    return Options(address=os.environ.get(SHARED_RAY), in_cluster=False,
                   output_dir=tmp / "out", checkpoint_dir=tmp / "ckpt", prometheus_port=0,
                   tensorboard=None, seed=0)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


LEARNABLE = {"type": "custom", "function": "tests.integration.toy_rewards:leading_one"}

