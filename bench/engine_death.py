"""An engine SIGKILLed in the middle of a weight update's broadcast: the seconds from its death
to the next step (issue 36).

A sync-mode run of the tiny job on CPU (gloo weight sync, fsdp) with `--engines` reference
engines of TP `--tp` (default 2 engines of TP 2: gloo's broadcast tree has engine 0's first rank
relay each bucket to engine 1's first rank, so engine 1 is left in the bucket's receive when
engine 0 dies). As the weights of version `--at` go out, engine 0 is armed with the reference
engine's fault switch (kuberl_rollout/reference/fault.py, SIGUSR1: its server process dies
when that sync's first bucket is announced, the trainer's broadcast then in flight, and its
weight-sync connections stay open and silent, as a vanished node's). Per run: the seconds from
its death (its process seen gone) to the end of that sync, where the next step starts; the
engines replaced; whether the run finished (if not, the seconds from the death to its failure);
the other syncs' median seconds (undisturbed, same run). The group's timeout is left at its
default (300 s). `--baseline REF` runs the same with commit REF's code side by side (a git
worktree first on PYTHONPATH, as bench/startup.py does); REF must have the fault switch
(kuberl_rollout/reference/fault.py): 6a99d47 is the code before the abort, with it.

    .venv/bin/python bench/engine_death.py --runs 1
    .venv/bin/python bench/engine_death.py --runs 2 --baseline 6a99d47

Each run starts its own local Ray and engines. Timings on a shared machine are noisy: compare
only numbers taken side by side.
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
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("operator", "trainer_image", "rollout_image", "wire", "env_image")
RESULT = "RESULT "  # a child's last line: RESULT {json}


@dataclass
class Result:
    who: str
    death_to_next_step_s: float | None  # None: the sync of --at never succeeded
    restarts: int
    finished: bool
    undisturbed_sync_s: float | None
    error: str = ""
    death_to_failure_s: float | None = None  # a run that failed: when, after the death


def engine_pids(url: str) -> list[int]:
    """The reference engine processes started for `url` (its server, TP rank 0; after the
    fault switch, the child that holds its connections)."""
    port = url.rsplit(":", 1)[1]
    return [int(p) for p in subprocess.run(
        ["pgrep", "-f", f"kuberl_rollout.reference .*--port {port}( |$)"],
        capture_output=True, text=True).stdout.split()]


def engine_pid(url: str) -> int:
    pids = engine_pids(url)
    if len(pids) != 1:
        raise RuntimeError(f"expected one engine process for {url}, found {pids}")
    return pids[0]


def gone(pid: int) -> bool:
    """The process has exited (a zombie until its parent, the engine's actor, reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def watch_death(pid: int) -> dict[str, float]:
    """When `pid` exits (monotonic), filled in by a thread polling every 5 ms."""
    seen: dict[str, float] = {}

    def poll() -> None:
        while not gone(pid):
            time.sleep(0.005)
        seen["at"] = time.monotonic()

    threading.Thread(target=poll, daemon=True, name="watch-death").start()
    return seen


def child(args: argparse.Namespace) -> int:
    """One run in this process (the code on PYTHONPATH); prints RESULT {json} last."""
    sys.path.insert(0, str(ROOT))  # tests.integration's job helpers (this checkout's)
    from kuberl_trainer import ray_auth

    ray_auth.enable_for_local_ray()
    from kuberl_api import load
    from kuberl_trainer.options import Options
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session
    from tests.integration.local_run import manifest, metrics, tiny_job

    tmp = Path(args.out)
    job = manifest(tiny_job(), tmp, "engine-death", placement="disaggregated",
                   rollout={"gpus": 0, "engines": args.engines, "gpusPerEngine": args.tp,
                            "maxEngineRestarts": args.budget},
                   schedule={"numRollouts": args.steps})
    spec = load(job)
    opts = Options(address=None, in_cluster=False, output_dir=tmp / "out",
                   checkpoint_dir=tmp / "ckpt", prometheus_port=0, tensorboard=None, seed=0)
    session = Session(spec, opts, check(spec.spec))
    watched: list[dict[str, float]] = []  # the armed engine's death (watch_death)
    synced_at: dict[str, float] = {}
    error = ""
    finished = False
    failed_at: float | None = None
    first: list[str] = []
    try:
        session.start()
        assert session.engines is not None and session.trainers is not None
        trainers, first = session.trainers, list(session.engines.urls)
        push = trainers.push_weights

        def push_and_kill(urls: list[str], version: int, bucket_bytes: int) -> float:
            if version == args.at and urls == first:
                pid = engine_pid(first[0])
                watched.append(watch_death(pid))
                os.kill(pid, signal.SIGUSR1)  # dies as this sync's first bucket is announced
                print(f"engine {first[0]} (pid {pid}) armed to die at version {version}",
                      flush=True)
            seconds = push(urls, version, bucket_bytes)
            if version == args.at:
                synced_at["at"] = time.monotonic()
            return seconds

        trainers.push_weights = push_and_kill  # type: ignore[method-assign]
        session.train(Progress(args.steps))
        finished = True
    except Exception as exc:  # (reported: a run that failed is a result too)
        error = f"{type(exc).__name__}: {exc}"[:500]
        failed_at = time.monotonic()
    finally:
        fleet = getattr(session, "fleet", None)  # (set once the session started)
        restarts = fleet.restarts if fleet is not None else 0
        session.close()
        if watched:  # the fault switch's child, still holding the connections
            for pid in engine_pids(first[0]):
                os.kill(pid, signal.SIGKILL)
    rows = metrics(tmp / "out") if (tmp / "out" / "metrics.jsonl").exists() else []
    others = [r["time_sync_s"] for r in rows if r["weight_version"] != args.at]
    died = watched[0].get("at") if watched else None
    done = synced_at.get("at")
    result = {"death_to_next_step_s": None if died is None or done is None else done - died,
              "death_to_failure_s": None if died is None or failed_at is None
              else failed_at - died,
              "restarts": restarts, "finished": finished, "error": error,
              "undisturbed_sync_s": statistics.median(others) if others else None}
    print(RESULT + json.dumps(result), flush=True)
    return 0


def run_once(who: str, args: argparse.Namespace, pythonpath: str | None, out: Path) -> Result:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out),
           "--engines", str(args.engines), "--tp", str(args.tp), "--steps", str(args.steps),
           "--at", str(args.at), "--budget", str(args.budget)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return Result(who, None, 0, False, None, f"no result (exit {proc.returncode}): {tail}")
    r = json.loads(lines[-1][len(RESULT):])
    return Result(who, r["death_to_next_step_s"], r["restarts"], r["finished"],
                  r["undisturbed_sync_s"], r["error"], r["death_to_failure_s"])


def worktree(ref: str, tmp: Path) -> str:
    """A checkout of `ref` and the PYTHONPATH that imports its packages first."""
    path = tmp / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)
    return os.pathsep.join(str(path / s) for s in SOURCES)


def ours() -> str:
    return os.pathsep.join(str(ROOT / s) for s in SOURCES)


def fmt(x: float | None, unit: str = " s", digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--at", type=int, default=2, help="the weight version whose sync it dies in")
    p.add_argument("--budget", type=int, default=3, help="rollout.maxEngineRestarts")
    p.add_argument("--baseline", default=None, help="a commit to compare with, side by side")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    tmp = Path(tempfile.mkdtemp(prefix="kuberl-engine-death-"))
    results: list[Result] = []
    try:
        base = worktree(args.baseline, tmp) if args.baseline else None
        for i in range(args.runs):
            who = [("ours", ours())] + ([(f"baseline {args.baseline}", base)] if base else [])
            for name, path in (who if i % 2 == 0 else who[::-1]):  # alternate who goes first
                r = run_once(name, args, path, tmp / "run")
                results.append(r)
                failed = (f"  failed {fmt(r.death_to_failure_s)} after the death: {r.error}"
                          if r.error else "")
                print(f"run {i + 1} {r.who:<20} death -> next step "
                      f"{fmt(r.death_to_next_step_s):>8}  replaced {r.restarts}  "
                      f"finished {r.finished}  undisturbed sync "
                      f"{fmt(r.undisturbed_sync_s, ' s', 2)}{failed}", flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tmp / "baseline")], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.engines} engines of TP {args.tp}, engine 0 killed in the sync of version "
          f"{args.at}, group timeout 300 s")
    print(f"{'':<22}{'death -> next step':>20}{'death -> failure':>18}"
          f"{'engines replaced':>18}{'finished':>10}{'undisturbed sync':>18}")
    medians: dict[str, float] = {}
    for who in dict.fromkeys(r.who for r in results):
        mine = [r for r in results if r.who == who]
        times = [r.death_to_next_step_s for r in mine if r.death_to_next_step_s is not None]
        fails = [r.death_to_failure_s for r in mine if r.death_to_failure_s is not None]
        syncs = [r.undisturbed_sync_s for r in mine if r.undisturbed_sync_s is not None]
        t = statistics.median(times) if times else None
        if t is not None:
            medians[who] = t
        print(f"{who:<22}{fmt(t):>20}{fmt(statistics.median(fails) if fails else None):>18}"
              f"{statistics.median(r.restarts for r in mine):>18.0f}"
              f"{sum(r.finished for r in mine):>7}/{len(mine)}"
              f"{fmt(statistics.median(syncs) if syncs else None, ' s', 2):>18}")
    if len(medians) == 2:
        a, b = medians.values()
        print(f"{'ours / baseline':<22}{a / b:>19.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
