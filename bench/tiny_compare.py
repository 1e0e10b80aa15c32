"""kuberl vs. bare torch on the tiny GRPO job, side by side in one run, as a ratio.

Runs `bench/tiny_grpo_baseline.py` and `kuberl run examples/tiny-grpo.yaml` (same model, data,
algorithm and step count) one after the other on the same machine, then prints seconds per
step split into generate / train / sync for both, the ratio, and each run's reward climb.
DESIGN.md's goal for the full system is a ratio of at most 1.5.

    .venv/bin/python bench/tiny_compare.py --steps 100
    .venv/bin/python bench/tiny_compare.py --steps 100 --cpus 0,1   # pin both to 2 cores

`--cpus` runs both under `taskset` (every process they start inherits the mask), which turns
a bigger idle machine into a quiet 2-core one. Step 0 (warm-up) is left out of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def run_baseline(steps: int, out: Path, cpus: str | None) -> list[dict[str, float]]:
    cmd = [sys.executable, str(ROOT / "bench/tiny_grpo_baseline.py"), "--out", str(out),
           "--steps", str(steps)]
    text = subprocess.run(pinned(cmd, cpus), check=True, capture_output=True, text=True,
                          cwd=ROOT).stdout
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows.append({"reward": float(m[2]), "generate": float(m[3]),
                         "train": float(m[4]), "sync": 0.0})
    return rows


def run_kuberl(steps: int, out: Path, manifest: Path, cpus: str | None,
               workdir: Path) -> list[dict[str, float]]:
    job = yaml.safe_load(manifest.read_text())
    job["spec"]["schedule"] = {"numRollouts": steps}  # no evals: they would count as step time
    job["spec"]["model"]["path"] = str(out / "model")
    job["spec"]["data"]["prompts"] = str(out / "data/train.jsonl")
    job["spec"]["data"].pop("evalSets", None)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run_dir = workdir / "run"
    cmd = [str(Path(sys.executable).with_name("kuberl")), "run", str(path),
           "--output-dir", str(run_dir)]
    if not Path(cmd[0]).exists():  # no console script (PYTHONPATH checkout): the module
        cmd = [sys.executable, "-c", "import sys; from kuberl_cli.main import main; "
               "sys.exit(main(sys.argv[1:]))", *cmd[1:]]
    done = subprocess.run(pinned(cmd, cpus), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    if done.returncode:
        sys.exit(f"kuberl run failed ({done.returncode}):\n{done.stdout[-3000:]}"
                 f"\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"reward": r["reward_mean"], "generate": r["time_generate_s"],
             "train": r["time_train_s"], "sync": r["time_sync_s"]} for r in records]


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    timed = rows[1:]  # step 0 pays one-time costs (allocator, first HTTP connections)
    out = {k: statistics.fmean(r[k] for r in timed) for k in ("generate", "train", "sync")}
    out["step"] = out["generate"] + out["train"] + out["sync"]
    out["first5"] = statistics.fmean(r["reward"] for r in rows[:5])
    out["last5"] = statistics.fmean(r["reward"] for r in rows[-5:])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=ROOT / "out/tiny", help="tiny build directory")
    p.add_argument("--manifest", type=Path, default=ROOT / "examples/tiny-grpo.yaml")
    p.add_argument("--cpus", default=None, help="taskset CPU list for both runs, e.g. 0,1")
    args = p.parse_args()
    base = summary(run_baseline(args.steps, args.out, args.cpus))  # builds out/ if needed
    with tempfile.TemporaryDirectory() as tmp:
        ours = summary(run_kuberl(args.steps, args.out.resolve(), args.manifest, args.cpus,
                                  Path(tmp)))
    print(f"{args.steps} steps{f', CPUs {args.cpus}' if args.cpus else ''}; "
          "seconds per step (mean of steps 1..)")
    print("| | s/step | generate | train | sync | reward first-5 -> last-5 |")
    print("|---|---|---|---|---|---|")
    for name, s in (("kuberl", ours), ("bare torch", base)):
        print(f"| {name} | {s['step']:.3f} | {s['generate']:.3f} | {s['train']:.3f} | "
              f"{s['sync']:.3f} | {s['first5']:.3f} -> {s['last5']:.3f} |")
    ratio = {k: ours[k] / base[k] for k in ("step", "generate", "train")}
    print(f"| ratio | **{ratio['step']:.2f}x** | {ratio['generate']:.2f}x | "
          f"{ratio['train']:.2f}x | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
