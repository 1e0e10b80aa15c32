"""The `lora` learning scenario's learning rate, chosen by a sweep over rates and seeds.

tests/integration/learning.py's `lora` scenario trains a rank-8 adapter (training.lora) on
the tiny job's leading_one reward for 8 steps and is judged, like every learning test, by the
exact expected-reward gain of its saved (merged) policy against MIN_REWARD_GAIN. This runs
that scenario at each learning rate under each seed (bench/learning_margins.py's runs: same
seed variable, same exact measure), and in the same invocation the same job without the
adapter at the manifest's own full-weight learning rate, as the baseline.

    nice -n 10 .venv/bin/python bench/lora_lr_sweep.py --lrs 1e-3 2e-3 5e-3 1e-2 2e-2 --seeds 0 1

Prints one row per run (gain, wall seconds), then one per learning rate: the gain per seed,
their mean and minimum, and the minimum's margin above the line. The largest possible gain is
1 - the tiny model's expected reward (0.405). Results go to bench/RESULTS.md ("LoRA
learning-rate sweep (tiny task, rank 8)").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from learning_margins import run_once  # noqa: E402  (bench/ is on sys.path as a script)

from tests.integration import learning  # noqa: E402

GAIN = "reward_gain"


def at_lr(scenario: learning.Scenario, lr: float) -> learning.Scenario:
    return dataclasses.replace(
        scenario, spec=learning.merge(scenario.spec, {"algorithm": {"lr": lr}}))


def full_weight(scenario: learning.Scenario) -> learning.Scenario:
    """The same job without the adapter, at the full-weight learning rate every other
    learning scenario uses (the manifest's)."""
    spec = dict(scenario.spec)
    spec["algorithm"] = {k: v for k, v in spec["algorithm"].items() if k != "lr"}
    training = {k: v for k, v in spec.get("training", {}).items() if k != "lora"}
    spec.pop("training", None)
    if training:
        spec["training"] = training
    return dataclasses.replace(scenario, spec=spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", nargs="*", type=float, default=[1e-3, 2e-3, 5e-3, 1e-2, 2e-2])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--baseline-lr", type=float, default=5e-4,
                    help="the full-weight arm's lr (the manifest's, as the other scenarios')")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the full-weight runs (they are the comparison: keep them)")
    args = ap.parse_args()
    lora = learning.SCENARIOS["lora"]
    line = lora.line(GAIN)
    arms: list[tuple[str, learning.Scenario]] = [
        (f"lora {lr:g}", at_lr(lora, lr)) for lr in args.lrs]
    if not args.no_baseline:
        arms.insert(0, (f"full-weight {args.baseline_lr:g}",
                        at_lr(full_weight(lora), args.baseline_lr)))
    gains: dict[str, list[float]] = {}
    seconds: list[float] = []
    print(f"{'arm':<26} {'seed':>4} {'before':>8} {'after':>8} {'gain':>8} {'s':>5}")
    for name, scenario in arms:
        for seed in args.seeds:
            outcome, took = run_once(scenario, seed)
            m = outcome.measures[GAIN]
            gains.setdefault(name, []).append(m.value)
            seconds.append(took)
            print(f"{name:<26} {seed:>4} {m.before:>8.4f} {m.after:>8.4f} {m.value:>8.4f} "
                  f"{took:>5.0f}", flush=True)
    print()
    seeds = " ".join(f"{'seed ' + str(s):>8}" for s in args.seeds)
    print(f"{'arm':<26} {seeds} {'mean':>8} {'min':>8} {'min-line':>8}")
    for name, values in gains.items():
        per_seed = " ".join(f"{v:>8.4f}" for v in values)
        print(f"{name:<26} {per_seed} {statistics.fmean(values):>8.4f} {min(values):>8.4f} "
              f"{min(values) - line:>+8.4f}")
    print(f"\nline (MIN_REWARD_GAIN) {line}; {len(seconds)} runs, "
          f"{statistics.fmean(seconds):.0f} s per run on average "
          f"({min(seconds):.0f}-{max(seconds):.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
