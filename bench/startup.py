"""Start-up of `kuberl run examples/tiny-grpo.yaml`: from the command to the first step (issue 33).

Runs the example (two steps of it, from the repository root, as `make demo` runs it) N times and
reports, per run, the start-up line the run prints (`start-up 8.7 s: checks 0.6, ray 2.5, ...`:
the command's start to the first step's start), the wall time until the first step's row, and
the medians. With `--baseline REF` each run of this checkout alternates with a run of commit
REF's code (a git worktree, put first on PYTHONPATH; same venv, same manifest), and the table
ends with the ratio of the medians: machines are shared and noisy, so only numbers taken side
by side compare. A baseline without the start-up line is timed to its first row only.

    .venv/bin/python bench/startup.py --runs 5
    .venv/bin/python bench/startup.py --runs 5 --baseline 05ee5e5
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
LINE = re.compile(r"^start-up ([0-9.]+) s: (.*)$")
SOURCES = ("operator", "trainer_image", "rollout_image", "wire")


@dataclass
class Run:
    who: str
    startup_s: float | None  # the run's own start-up line (None: a baseline without one)
    phases: str
    first_row_s: float  # spawn -> the first step's row on stdout
    exit_s: float


def manifest(tmp: Path, steps: int) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["schedule"]["numRollouts"] = steps
    path = tmp / "tiny-grpo.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_once(who: str, job: Path, out: Path, pythonpath: str | None) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kuberl_cli.main", "run", str(job),
                             "--output-dir", str(out)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=600)
    exit_s = time.monotonic() - started
    reader.join(timeout=10)
    if proc.returncode != 0:
        raise SystemExit(f"{who}: exit {proc.returncode}\n" + "\n".join(t for _, t in lines))
    first_row = next(t for t, text in lines if re.match(r"^\s+0\s", text))
    found = next((LINE.match(text) for _, text in lines if LINE.match(text)), None)
    return Run(who, float(found.group(1)) if found else None,
               found.group(2) if found else "", first_row, exit_s)


def worktree(ref: str, tmp: Path) -> str:
    """A checkout of `ref` and the PYTHONPATH that imports its packages first."""
    path = tmp / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)
    return os.pathsep.join(str(path / s) for s in SOURCES)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--baseline", default=None, help="a commit to compare with, side by side")
    args = p.parse_args()
    subprocess.run([sys.executable, "-m", "kuberl_trainer.tiny", "build", "--out", "out/tiny"],
                   cwd=ROOT, check=True, capture_output=True)
    tmp = Path(tempfile.mkdtemp(prefix="kuberl-startup-"))
    runs: list[Run] = []
    try:
        job = manifest(tmp, args.steps)
        base = worktree(args.baseline, tmp) if args.baseline else None
        for i in range(args.runs):
            who = [("ours", None)] + ([(f"baseline {args.baseline}", base)] if base else [])
            for name, path in (who if i % 2 == 0 else who[::-1]):  # alternate who goes first
                r = run_once(name, job, tmp / "out", path)
                runs.append(r)
                print(f"run {i + 1} {r.who:<20} start-up "
                      f"{'-' if r.startup_s is None else f'{r.startup_s:5.1f} s'}  first row "
                      f"{r.first_row_s:5.1f} s  exit {r.exit_s:5.1f} s  {r.phases}", flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tmp / "baseline")], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'':<22}{'start-up (median)':>18}{'first row (median)':>20}")
    medians = {}
    for who in dict.fromkeys(r.who for r in runs):
        mine = [r for r in runs if r.who == who]
        ups = [r.startup_s for r in mine if r.startup_s is not None]
        up = statistics.median(ups) if ups else None
        row = statistics.median(r.first_row_s for r in mine)
        medians[who] = row
        print(f"{who:<22}{'-' if up is None else f'{up:.1f} s':>18}{row:>18.1f} s")
    if len(medians) == 2:
        ours, theirs = medians.values()
        print(f"{'ours / baseline':<22}{'':>18}{ours / theirs:>18.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
