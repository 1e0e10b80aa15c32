"""Which off-policy correction lets async training learn the addition task at its bound?

Runs the demo job (examples/tiny-grpo.yaml: 2-digit addition, exact reward, lr 2e-4, one CPU
engine) disaggregated, in sync mode and in async modes with several corrections, under several
seeds, and judges each run exactly: the expected exact reward of the saved policy on the 500
held-out problems (tests/integration/learning.expected_exact_reward), against the model it
started from. Each async arm's gain is then compared with sync's over the same steps and
seeds, as a ratio.

Runs go side by side on one shared Ray (`--parallel` at once, each trainer and engine on one
thread), so a many-core machine measures the whole matrix in one go:

    python bench/async_correction.py --out /tmp/ac --steps 150 --seeds 0 1 2 --parallel 7

Results: bench/RESULTS.md ("Async off-policy correction").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kuberl_trainer import ray_auth  # noqa: E402
from tests.integration import learning  # noqa: E402
from tests.integration.local_run import (  # noqa: E402
    SHARED_RAY,
    failed,
    kuberl_run,
    manifest,
    ray_host_script,
    run_env,
    tiny_job,
)

ASYNC4 = {"mode": "async", "async": {"maxStaleness": 4}}
ASYNC4P = {"mode": "async", "async": {"maxStaleness": 4, "partialRollout": True}}
ASYNC1 = {"mode": "async", "async": {"maxStaleness": 1}}
# The engines always as far ahead as the bound allows (async.runAhead bound; before it existed,
# the only behaviour): every sample 4 versions old on CPU. The corrections were compared so,
# and their arms keep it, to reproduce bench/RESULTS.md.
BOUND4 = learning.merge(ASYNC4, {"async": {"runAhead": "bound"}})
BOUND4P = learning.merge(ASYNC4P, {"async": {"runAhead": "bound"}})
# The arms: (mode and async sections, algorithm keys). "default" arms take what the release
# does by default (since issue 37: TIS at 2, runAhead adaptive); "none" turns the correction
# off; the others set it explicitly.
ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync": ({"mode": "sync"}, {}),
    "async1-default": (ASYNC1, {}),
    "async4-default": (ASYNC4, {}),
    "async4p-default": (ASYNC4P, {}),
    "async4-bound": (BOUND4, {}),
    "async4p-bound": (BOUND4P, {}),
    "async4-none": (learning.merge(BOUND4, {"async": {"offPolicyCorrection": "none"}}), {}),
    "async4p-none": (learning.merge(BOUND4P, {"async": {"offPolicyCorrection": "none"}}), {}),
    "async4-tis2": (BOUND4, {"tisCap": 2.0}),
    "async4-tis5": (BOUND4, {"tisCap": 5.0}),
    "async4p-tis2": (BOUND4P, {"tisCap": 2.0}),
    # AReaL's decoupled PPO: weight pi_prox / pi_behav, tokens above the cap dropped
    "async4-decoupled5": (BOUND4, {"tisCap": 5.0, "importanceMask": {"low": 1e-6,
                                                                      "high": 5.0}}),
    "async4p-decoupled5": (BOUND4P, {"tisCap": 5.0, "importanceMask": {"low": 1e-6,
                                                                        "high": 5.0}}),
    # masked IS alone: tokens outside [0.5, 2] dropped, the others unweighted
    "async4-mis": (BOUND4, {"importanceMask": {"low": 0.5, "high": 2.0}}),
    "async4-mis-seq": (BOUND4, {"importanceMask": {"level": "sequence", "low": 0.5,
                                                    "high": 2.0}}),
    "async4-tis2-mis": (BOUND4, {"tisCap": 2.0, "importanceMask": {"low": 0.5, "high": 2.0}}),
}


def arm_spec(arm: str, steps: int) -> dict[str, Any]:
    mode, algorithm = ARMS[arm]
    spec = learning.merge(learning.demo_job(), {**mode, "algorithm": algorithm,
                                        "schedule": {"numRollouts": steps}})
    return spec


def run(arm: str, seed: int, steps: int, tiny: Path, root: Path,
        env: dict[str, str]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"{arm}-{seed}-", dir=root))
    started = time.monotonic()
    job = manifest(tiny, tmp, "job", **arm_spec(arm, steps))
    res = kuberl_run(job, tmp / "out", "--seed", str(seed), env=env, timeout=900)
    if res.returncode != 0:
        return {"arm": arm, "seed": seed, "error": failed(res)[-2000:]}
    rows = learning.metrics(tmp / "out")
    after = learning.expected_exact_reward(learning.final_model(tmp / "out"), tiny)
    return {"arm": arm, "seed": seed, "after": after, "seconds": time.monotonic() - started,
            "staleness_mean": statistics.fmean(r.get("staleness_mean", 0) for r in rows),
            "reward_last20": statistics.fmean(r["reward_mean"] for r in rows[-20:]),
            "step_s": statistics.fmean(r["time_step_s"] for r in rows[1:])}


def start_ray(cpus: int) -> subprocess.Popen[str]:
    """A Ray the runs join, as the integration tests' shared one (tests/integration/
    conftest.py) with `cpus` CPUs; its address is the process's first line."""
    ray_auth.enable_for_local_ray()  # one token, in the environment every run copies
    return subprocess.Popen([sys.executable, "-c", ray_host_script(cpus, 256)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=run_env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once on one shared Ray (each on one thread)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tiny = tiny_job()
    before = learning.expected_exact_reward(tiny / "model", tiny)
    env = {"KUBERL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    host = start_ray(2 * args.parallel + 2)
    assert host.stdout is not None and host.stdin is not None
    os.environ[SHARED_RAY] = host.stdout.readline().strip()
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    results = []
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run, arm, seed, args.steps, tiny, args.out, env)
                   for arm, seed in jobs]
        for future in as_completed(futures):
            r = future.result()
            results.append(r)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
            print(json.dumps(r) if "error" in r else
                  f"{r['arm']:<20} seed {r['seed']} gain {r['after'] - before:+.4f} "
                  f"stale {r['staleness_mean']:.2f} step {r['step_s']:.2f}s "
                  f"({r['seconds']:.0f} s)", flush=True)
    host.stdin.close()
    host.wait(timeout=120)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    ok = [r for r in results if "error" not in r]
    sync = {r["seed"]: r["after"] - before for r in ok if r["arm"] == "sync"}
    print(f"\nstart: expected exact reward {before:.4f}; {args.steps} steps; seeds {args.seeds}")
    print(f"{'arm':<20} {'runs':>4} {'gain mean':>9} {'sd':>7} {'min':>7} "
          f"{'/sync mean':>10} {'/sync min':>9} {'stale':>6} {'step s':>6}")
    for arm in args.arms:
        rs = [r for r in ok if r["arm"] == arm]
        if not rs:
            continue
        gains = [r["after"] - before for r in rs]
        ratios = [g / sync[r["seed"]] for g, r in zip(gains, rs, strict=True)
                  if sync.get(r["seed"])]
        sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        print(f"{arm:<20} {len(rs):>4} {statistics.fmean(gains):>+9.4f} {sd:>7.4f} "
              f"{min(gains):>+7.4f} "
              f"{statistics.fmean(ratios) if ratios else float('nan'):>10.2f} "
              f"{min(ratios) if ratios else float('nan'):>9.2f} "
              f"{statistics.fmean(r['staleness_mean'] for r in rs):>6.2f} "
              f"{statistics.fmean(r['step_s'] for r in rs):>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
