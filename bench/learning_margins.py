"""The margins of the integration tier's learning tests, measured over seeds and CPU numerics.

Every test that asserts "it learns" (tests/integration/test_algorithms.py, the colocated run
of test_local_run.py) judges it by an exact measure (tests/integration/learning.py: the
expected reward of the saved policy, computed without sampling, against the model it started
from). What varies from machine to machine is the training run itself: another CPU sums floats
in another order, and once one sampled token differs the runs part ways. A different seed
(`kuberl run --seed`) changes every prompt and draw, so runs over several seeds show the spread
a test must tolerate; numerics variables (thread counts, ATen's and oneDNN's CPU kernel paths)
show whether the machine's own float paths matter on top of that.

    .venv/bin/python bench/learning_margins.py --seeds 0 1 2 3 4 5 6 7
    .venv/bin/python bench/learning_margins.py --scenarios grpo rloo --seeds 0 1 \\
        --env ATEN_CPU_CAPABILITY=default --env KUBERL_TORCH_THREADS=1

With --gpu the same scenarios run on the machine's GPUs: the trainer on one, and where the
scenario is disaggregated the engine on another (weights over NCCL); the async scenarios
against `sync-disaggregated` are issue 15's "async trains on GPU":

    python bench/learning_margins.py --gpu --seeds 0 1 2 --scenarios sync-disaggregated \
        async-one-step-off async-staleness-4 async-staleness-4-partial

Prints one row per run (with its largest staleness and mean step time), then per scenario and
measure: mean, standard deviation and worst
value over the runs, the test's threshold, and how many standard deviations the mean lies on
the passing side of it.
Results go to bench/RESULTS.md ("Learning-test margins").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kuberl_trainer.startup import environment  # noqa: E402
from tests.integration import learning  # noqa: E402


def parse_env(pairs: list[str]) -> list[dict[str, str]]:
    """Each --env is one configuration: KEY=VALUE[,KEY=VALUE...]; '' is the plain one."""
    configs = []
    for text in pairs or [""]:
        config = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            config[key] = value
        configs.append(config)
    return configs


def label(config: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "plain"


def on_gpus(scenario: learning.Scenario) -> learning.Scenario:
    """The scenario with its trainer on a GPU and, where disaggregated, its engine on
    another (a dedicated critic stays where the scenario puts it)."""
    gpus: dict[str, Any] = {"training": {"gpusPerNode": 1}}
    if scenario.spec.get("placement") == "disaggregated":
        gpus["rollout"] = {"gpus": 1}
    return dataclasses.replace(scenario, spec=learning.merge(scenario.spec, gpus))


def run_once(scenario: learning.Scenario, seed: int, config: dict[str, str] | None = None
             ) -> tuple[learning.Outcome, float]:
    """One run of `scenario` at `seed` under the numerics variables `config`, in a
    directory of its own: its outcome and wall seconds (the run and its exact measures; the
    tiny build, made once per machine, is not counted)."""
    tiny = learning.tiny_for(scenario.task)
    with environment({**(config or {}), "KUBERL_TEST_SEED": str(seed)}), \
            tempfile.TemporaryDirectory(prefix="margins-") as tmp:
        started = time.monotonic()
        outcome = scenario.run(tiny, Path(tmp))
        return outcome, time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="*", default=list(learning.SCENARIOS),
                    choices=list(learning.SCENARIOS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--env", action="append", default=[],
                    help="a numerics configuration, KEY=VALUE[,KEY=VALUE]; repeatable")
    ap.add_argument("--gpu", action="store_true", help="trainer and engine on GPUs")
    args = ap.parse_args()
    results: dict[tuple[str, str], list[float]] = {}
    print(f"{'scenario':<34} {'config':<28} {'seed':>4} {'measure':<22} {'before':>8} "
          f"{'after':>8} {'value':>8} {'s':>5} {'stale':>5} {'step s':>6}")
    for config in parse_env(args.env):
        for seed in args.seeds:
            for name in args.scenarios:
                scenario = learning.SCENARIOS[name]
                scenario = on_gpus(scenario) if args.gpu else scenario
                outcome, seconds = run_once(scenario, seed, config)
                stale = max(r.get("staleness_max", 0) for r in outcome.rows)
                step = statistics.fmean(r["time_step_s"] for r in outcome.rows[1:])
                for m in outcome.measures.values():
                    results.setdefault((name, m.name), []).append(m.value)
                    print(f"{name:<34} {label(config):<28} {seed:>4} {m.name:<22} "
                          f"{m.before:>8.4f} {m.after:>8.4f} {m.value:>8.4f} {seconds:>5.0f} "
                          f"{stale:>5.0f} {step:>6.2f}", flush=True)
    print()
    print(f"{'scenario':<34} {'measure':<22} {'runs':>4} {'mean':>8} {'sd':>7} {'worst':>8} "
          f"{'threshold':>9} {'margin/sd':>9}")
    for (name, measure), values in results.items():
        scenario = learning.SCENARIOS[name]
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        if measure not in {*scenario.thresholds, *scenario.ceilings}:  # reported, not judged
            print(f"{name:<34} {measure:<22} {len(values):>4} {mean:>8.4f} {sd:>7.4f} "
                  f"{'':>8} {'-':>9} {'-':>9}")
            continue
        threshold, below = scenario.line(measure), scenario.below(measure)
        worst = max(values) if below else min(values)
        margin = (threshold - mean if below else mean - threshold) / sd
        print(f"{name:<34} {measure:<22} {len(values):>4} {mean:>8.4f} {sd:>7.4f} "
              f"{worst:>8.4f} {threshold:>9.3f} {margin:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
