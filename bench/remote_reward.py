"""What grading through a reward service costs (issue 38): the tiny job with reward.type exact
vs the same job with reward.type remote against a reward service on loopback doing the same
exact match (tests/reward_server.py, aiohttp, in a thread of this process), side by side in one
invocation, each a `kuberl run` of N steps.

    python bench/remote_reward.py --steps 10 --out out/remote-reward
    python bench/remote_reward.py --steps 10 --batch-size 8 --concurrency 2   # more requests
    python bench/remote_reward.py --steps 10 --model     # a served reward model (below)

With --model the two arms are the tiny reward model (`tiny reward-model`) called in-process by
a reward.batch function (tests/integration/toy_rewards.py) and the same model served by a
reference engine, reward.type model: what serving costs a step. Their rewards agree to float
rounding at step 0; after it the two policies differ in their last bits and sample apart.

Prints each step's reward_s (wall seconds grading it) and time_step_s for both, the means over
the steps after the first (it pays start-up costs), the ratios remote / exact, and whether
the two runs' rewards agree step by step (they must: the same policy, the same samples, the
same grade). Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.local_run import (  # noqa: E402
    manifest,
    run_env,
    tiny_job,
    tiny_reward_model,
)
from tests.integration.toy_rewards import REWARD_MODEL_ENV  # noqa: E402
from tests.reward_server import RewardServer  # noqa: E402


def run(out: Path, name: str, reward: dict[str, Any], steps: int,
        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    tiny = tiny_job()
    job = manifest(tiny, out, name, reward=reward, schedule={"numRollouts": steps})
    run_dir = out / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # (a run dir with checkpoints would resume)
    started = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kuberl_cli.main", "run", str(job),
                          "--output-dir", str(run_dir)], capture_output=True, text=True,
                         cwd=ROOT, env={**run_env(), **(env or {})})
    (out / f"run-{name}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        sys.exit(f"{name}: exit {res.returncode}\n{res.stderr[-3000:]}")
    print(f"{name}: {steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="reward.batchSize")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="reward.maxConcurrentRequests")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "remote-reward")
    parser.add_argument("--model", action="store_true",
                        help="a served reward model vs the same model in-process")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calls = {"batchSize": args.batch_size, "maxConcurrentRequests": args.concurrency}

    if args.model:
        rm = tiny_reward_model(tiny_job())
        names = ("in-process", "served")
        exact = run(args.out, names[0], {
            "type": "custom", "batch": True,
            "function": "tests.integration.toy_rewards:tiny_reward_model"}, args.steps,
            env={REWARD_MODEL_ENV: str(rm)})
        remote = run(args.out, names[1], {"type": "model", **calls, "model": {
            "path": str(rm), "engine": "reference", "gpusPerReplica": 0}}, args.steps)
        served = "one reference engine"
    else:
        names = ("exact", "remote")
        exact = run(args.out, names[0], {"type": "exact"}, args.steps)
        server = RewardServer()
        with server.in_thread() as url:
            remote = run(args.out, names[1], {"type": "remote", "url": url, **calls},
                         args.steps)
        served = f"{len(server.requests)} requests served"

    print(f"\n{platform.node()}: {platform.processor() or platform.machine()}, "
          f"{_cores()} cores; tiny job: 16 prompts x 8 samples a step; reward.batchSize "
          f"{args.batch_size}, maxConcurrentRequests {args.concurrency}; {served}\n")
    a_, b_ = names
    print(f"| step | {a_} reward_s | {b_} reward_s | {a_} step s | {b_} step s | "
          "reward_mean (both) |")
    print("|---:|---:|---:|---:|---:|---|")
    agree = True
    for a, b in zip(exact, remote, strict=True):
        same = (a["reward_mean"] == b["reward_mean"] if not args.model
                else abs(a["reward_mean"] - b["reward_mean"]) <= 1e-5 * abs(a["reward_mean"]))
        if not args.model or a["step"] == 0:  # (see the docstring)
            agree &= same
        mean = f"{a['reward_mean']:.4f}" + ("" if same else f" / {b['reward_mean']:.4f} (!)")
        print(f"| {a['step']} | {a['reward_s'] * 1e3:.1f} ms | {b['reward_s'] * 1e3:.1f} ms | "
              f"{a['time_step_s']:.2f} | {b['time_step_s']:.2f} | {mean} |")
    steady = slice(1, None)

    def avg(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in rows[steady])

    ra, rb = avg(exact, "reward_s"), avg(remote, "reward_s")
    sa, sb = avg(exact, "time_step_s"), avg(remote, "time_step_s")
    print(f"| mean (steps 1-{args.steps - 1}) | {ra * 1e3:.1f} ms | {rb * 1e3:.1f} ms | "
          f"{sa:.2f} | {sb:.2f} | |")
    print(f"\n{b_} / {a_}: grading {rb / ra:.1f}x ({(rb - ra) * 1e3:.1f} ms more a step), "
          f"step time {sb / sa:.3f}x; grading is {rb / sb:.1%} of a {b_} step")
    print(("rewards agree at step 0 (then the runs sample apart)" if args.model
           else "rewards agree step by step") if agree else "REWARDS DIFFER (see the (!) rows)")


def _cores() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
