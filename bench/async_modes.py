"""sync vs one-step-off vs fully asynchronous training, side by side on one job.

Runs `kuberl run` on the same disaggregated job (same prompts, samples and steps) once per
mode and prints steps per hour with each mode's ratio to sync, the overlap, the staleness, and
the reward curve. Two setups:

    python bench/async_modes.py --out out/async-cpu                 # the tiny job, CPU only
    python bench/async_modes.py --out out/async-gpu --shape qwen2.5-1.5b --steps 10 \\
        --prompts 64 --samples 8 --response-len 64 --engine-dtype bfloat16 \\
        --engine-batch 512                    # 2 GPUs: trainer | engine (a balanced shape)
    python bench/async_modes.py --report out/async-gpu/async_modes.json   # its table again

On CPU the engines and the trainer share the machine's cores, so overlapping them buys little:
the CPU run shows the mechanism (staleness, the reward curve), the GPU run the speed. The GPU
model has random weights (reward ~0: speed only). Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES: dict[str, dict[str, Any]] = {
    "sync": {"mode": "sync"},
    "one-step-off": {"mode": "async", "async": {"maxStaleness": 1}},
    "async-4": {"mode": "async", "async": {"maxStaleness": 4}},
    "async-4-partial": {"mode": "async", "async": {"maxStaleness": 4, "partialRollout": True}},
    # the engines always as far ahead as the bound allows (async.runAhead's default, adaptive,
    # runs them only as far ahead as keeps the trainers fed)
    "async-4-bound": {"mode": "async", "async": {"maxStaleness": 4, "runAhead": "bound"}},
}


def tiny_spec(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kuberl_trainer.tiny.build import BuildConfig, build

    tiny = out / "tiny"
    build(tiny, BuildConfig(sft_steps=300))
    return {"model": {"path": str(tiny / "model")},
            "data": {"prompts": str(tiny / "data" / "train.jsonl"), "rolloutBatchSize": 16,
                     "nSamplesPerPrompt": 8, "maxPromptLen": 8, "maxResponseLen": 4},
            "reward": {"type": "exact"}, "algorithm": {"lr": 2e-4, "temperature": 1.0},
            "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": 128},
            "rollout": {"engine": "reference", "gpus": 0}, "placement": "disaggregated",
            "schedule": {"numRollouts": args.steps}}


def gpu_spec(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_common import build_model
    from gpu_loop import manifest

    build_model(out, args.shape)
    loop = argparse.Namespace(prompts=args.prompts, samples=args.samples,
                              response_len=args.response_len, micro_batch=args.micro_batch,
                              backend="fsdp", placement="disaggregated", steps=args.steps,
                              engine_tp=1, engine_nodes=1, turns=1, rows=1)
    spec: dict[str, Any] = manifest(out, loop)["spec"]
    # The reference engine decodes with HF eager, one forward per token: far slower per token
    # than SGLang, so a GPU shape is balanced by a wide batch (its --max-batch-size, SGLang's
    # --max-running-requests) and bf16, the dtype SGLang serves in (the trainer sends its
    # weights in the engine's dtype). With --batching continuous (the engine's default, as
    # SGLang schedules) a rollout's requests join the running batch at its next decode step,
    # up to --max-prefill-tokens of prompt per step: sized so that a whole rollout is taken in
    # at once. --batching batch is the engine's old scheduling (a batch runs to completion and
    # takes the requests that arrive within --batch-wait-ms of the first), for comparison.
    spec["rollout"]["engineArgs"] = {"dtype": args.engine_dtype,
                                     "max-batch-size": str(args.engine_batch),
                                     "batching": args.batching}
    if args.batching == "batch":
        spec["rollout"]["engineArgs"]["batch-wait-ms"] = "1000"
    else:
        spec["rollout"]["engineArgs"]["max-prefill-tokens"] = str(args.engine_batch * 512)
    return spec


def run(out: Path, name: str, spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    job = out / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                                   "metadata": {"name": name}, "spec": spec}))
    run_dir = out / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # (a run dir with checkpoints would resume)
    started = time.perf_counter()
    log = out / f"run-{name}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kuberl_cli.main", "run", str(job),
                                 "--output-dir", str(run_dir)], stdout=sink,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # keep the steps it finished: they are measured
            code = "timed out"
            os.killpg(proc.pid, signal.SIGTERM)  # the CLI's own shutdown stops its Ray
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    metrics = run_dir / "metrics.jsonl"
    rows = ([json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists() else [])
    print(f"{name}: {len(rows)} steps in {time.perf_counter() - started:.0f} s"
          f"{'' if code == 0 else f' ({code}; log: {log})'}", flush=True)
    if code != 0:
        print(log.read_text()[-3000:], file=sys.stderr)
    return rows


def steady_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps a long run is made of. Not the first: it pays start-up costs, and in async
    mode it also waits for the next rollout before it can send its weights. Not the last in
    async mode: its rollout was generated during the step before, and nothing generates
    beside it (the pipeline drains), so it takes only train + sync."""
    return rows[1:-1] if len(rows) > 3 else rows[1:]


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    """The table: steady steps' means per mode, each mode's speed as a ratio to sync's."""
    table = []
    for name, rows in results.items():
        steady = steady_steps(rows)
        if not steady:
            continue
        step = statistics.fmean(r["time_step_s"] for r in steady)
        table.append((name, step, rows))
    sync_step = next((s for n, s, _ in table if n == "sync"), None)
    if sync_step:  # what overlapping could give at best: the sum over the longer side
        sync = steady_steps(results["sync"])
        gen = statistics.fmean(r["time_generate_s"] for r in sync)
        rest = statistics.fmean(r["time_train_s"] + r["time_sync_s"] for r in sync)
        print(f"\nsync: generate {gen:.2f} s, train + sync {rest:.2f} s: overlap can give at "
              f"most {(gen + rest) / max(gen, rest):.2f}x")
    print("\n| mode | steps/hour | vs sync | step s | generate s | train s | sync s | "
          "overlap efficiency | staleness mean | max | reward per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, step, rows in table:
        steady = steady_steps(rows)

        def mean(key: str, steady: list[dict[str, Any]] = steady) -> float:
            return statistics.fmean(r.get(key, float("nan")) for r in steady)
        ratio = f"{sync_step / step:.2f}x" if sync_step else ""
        eff = f"{mean('overlap_efficiency'):.2f}" if "overlap_efficiency" in steady[0] else ""
        stale = max((r.get("staleness_max", 0) for r in rows), default=0)
        rewards = " ".join(f"{r['reward_mean']:.2f}" for r in rows)
        print(f"| {name} | {3600 / step:.0f} | {ratio} | {step:.2f} | "
              f"{mean('time_generate_s'):.2f} | {mean('time_train_s'):.2f} | "
              f"{mean('time_sync_s'):.2f} | {eff} | {mean('staleness_mean'):.2f} | "
              f"{stale:.0f} | {rewards} |")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("out/async-modes"))
    p.add_argument("--shape", default=None, help="a GPU model shape (bench/gpu_common.py); "
                   "default: the tiny job on CPU")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--engine-dtype", default="float32",
                   choices=["float32", "bfloat16"], help="(GPU) the reference engine's dtype")
    p.add_argument("--engine-batch", type=int, default=256,
                   help="(GPU) the most requests the reference engine decodes at once")
    p.add_argument("--batching", default="continuous", choices=["continuous", "batch"],
                   help="the reference engine's scheduling (GPU shapes)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--report", type=Path, default=None,
                   help="print the table of a saved async_modes.json and stop")
    args = p.parse_args()
    if args.report:
        report(json.loads(args.report.read_text()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.shape:
        import torch
        print(f"device: {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}")
    base = gpu_spec(args.out, args) if args.shape else tiny_spec(args.out, args)
    results = {}
    for name in args.modes:
        results[name] = run(args.out, name, base | MODES[name], args.timeout)
    report(results)
    (args.out / "async_modes.json").write_text(json.dumps(
        {n: rows for n, rows in results.items() if rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
