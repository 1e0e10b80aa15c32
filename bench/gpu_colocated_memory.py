"""Colocated memory handoff on GPUs: a job whose trainer and engine pool do not fit together.

Runs the same Session as `kuberl run` (local Ray, fsdp trainer, reference engine with a static
GPU pool of `--fraction` of each card, colocated) on a random-weight model of a real shape,
twice side by side:

- `off`: no handoff (the engines keep their pool while training runs, the trainers keep
  everything while the engines generate): expected to fail with CUDA out of memory;
- `on`: the handoff of kuberl_trainer/memory_handoff.py (engines release after sampling,
  trainers offload optimizer state and weights around the sync).

Every sync is checked (sync_check.py): before it, the engines' checksums are read and, where
the trainer's weights match them on any tensor (the reward is ~0, so the weights never move),
the trainer's are negated on every rank; after it, every TP process must hold the trainer's
checksum of every tensor, each of which differed before. Prints a table: steps done, step
seconds, offload/onload seconds and their share of the step, the trainers' peak GPU memory
while training and what they hold while the engines generate, the bytes offloaded, weights
exact; plus the device's peak memory in use (nvidia-smi, sampled).

    PYTHONPATH=<ray, pydantic, aiohttp>:operator:trainer_image:rollout_image:wire:bench \\
        python3 bench/gpu_colocated_memory.py --shape qwen2.5-3b --gpus 1 --modes off on
    ... --gpus 2 --engine-tp 2 --modes on     # TP=2 engine over two trainer ranks (FSDP2)
    python3 bench/gpu_colocated_memory.py --cpu --modes on   # no GPU: the tiny shape on CPU,
                                                             # the code paths and the checks

Exits 1 when a run that finished has a sync not shown delivered.

Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpu_common import build_model, card, gpu_memory_used_gib
from gpu_loop import manifest
from sync_check import engine_sums, judge, trainer_differs


def fed_from_own_gpu(engine_urls: list[str], version: str, tp: int) -> bool:
    """Whether, in weight version `version`'s sync, every TP rank of every engine read only
    tensors on its own GPU (the engine's event log names each rank's device and where its
    tensors were): what the colocated sync's routing promises."""
    ok = True
    for url in engine_urls:
        with urllib.request.urlopen(f"{url}/get_event_log", timeout=60) as answer:
            events = json.loads(answer.read())["events"]
        updates = [e for e in events
                   if e["op"] == "update_from_tensor" and e.get("weight_version") == version]
        ok = ok and bool(updates) and all(
            len(e["ranks"]) == tp and all(r["from"] == [r["device"]] for r in e["ranks"])
            for e in updates)
    return ok


def job(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    loop_args = argparse.Namespace(
        prompts=args.prompts, samples=args.samples, response_len=args.response_len,
        micro_batch=args.micro_batch, backend=args.backend, placement="colocate",
        steps=args.steps,
        engine_tp=args.engine_tp, engine_nodes=1, cpu=args.cpu)
    doc = manifest(out, loop_args)
    spec = doc["spec"]
    spec["training"]["gpusPerNode"] = 0 if args.cpu else args.gpus
    spec["rollout"]["memoryFraction"] = args.fraction
    return doc


class DeviceMemory:
    """The most memory in use on any GPU (nvidia-smi), sampled while a run goes on."""

    def __init__(self) -> None:
        self.peak_gib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        if not shutil.which("nvidia-smi"):  # (--cpu)
            return
        while not self._stop.wait(0.25):
            self.peak_gib = max([self.peak_gib, *gpu_memory_used_gib()])

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_gib


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from kuberl_api import parse
    from kuberl_trainer import ray_auth

    ray_auth.enable_for_local_ray()  # the local Ray checks a token, as kuberl run's does
    from kuberl_trainer import session as session_mod
    from kuberl_trainer.memory_handoff import MemoryHandoff
    from kuberl_trainer.options import Options
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    rlj = parse(job(args.out, args))
    if mode == "off":  # the counterfactual: no handoff at all
        session_mod.MemoryHandoff = (  # type: ignore[misc]
            lambda client, aio, ranks, offload: MemoryHandoff(client, aio, ranks, None))
    else:
        session_mod.MemoryHandoff = MemoryHandoff  # type: ignore[misc]
    run_dir = args.out / f"run-{mode}-{int(time.time())}"
    opts = Options(address=None, in_cluster=False, output_dir=run_dir,
                   checkpoint_dir=run_dir / "ckpt", prometheus_port=0, tensorboard=None, seed=0)
    session = Session(rlj, opts, check(rlj.spec))
    exact: list[bool] = []
    own_gpu: list[bool] = []  # every TP rank read its tensors on its own GPU, every sync
    check_s: list[float] = []  # the checks' own seconds, taken out of the step times
    error = trace = ""
    memory = DeviceMemory()
    try:
        session.start()
        assert session.trainers is not None and session.engines is not None
        trainers, push = session.trainers, session.trainers.push_weights

        def push_and_check(engine_urls: list[str], version: int, bucket_bytes: int) -> float:
            started = time.perf_counter()
            # What the engines hold now (handoff on: the zeros a resume maps, as SGLang's;
            # off: the last sync's weights), hashed while the trainers hash theirs.
            before: list[dict[str, str]] = []
            engines = threading.Thread(target=lambda: before.extend(engine_sums(engine_urls)))
            engines.start()
            mine = trainers.checksums()
            engines.join()
            want = trainer_differs(trainers, before, mine)
            checking = time.perf_counter() - started
            seconds = push(engine_urls, version, bucket_bytes)
            started = time.perf_counter()
            verdict = judge(before, engine_sums(engine_urls), want,
                            len(engine_urls) * args.engine_tp)
            if not verdict.ok:
                print(f"sync of version {version}: {verdict}", flush=True)
            exact.append(verdict.ok)
            own_gpu.append(fed_from_own_gpu(engine_urls, str(version), args.engine_tp))
            check_s.append(checking + time.perf_counter() - started)
            return seconds

        trainers.push_weights = push_and_check  # type: ignore[method-assign]
        session.train(Progress(args.steps))
    except Exception as exc:  # the off run is expected to fail: show how
        text = str(exc)
        trace = text
        # a Ray error's first line names the actor call; the cause is the last "...Error:" line
        lines = [line.strip() for line in text.splitlines()]
        error = next((line for line in lines if "out of memory" in line),
                     next((line for line in reversed(lines) if "Error" in line),
                          lines[0] if lines else type(exc).__name__))[:200]
    finally:
        session.close()
        peak = memory.stop()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    steady = rows[1:] or rows
    mean = (lambda k: statistics.fmean(r.get(k, 0.0) for r in steady)) if steady else (
        lambda k: float("nan"))
    # the step as a job without the bench's checks would take it
    checking = statistics.fmean(check_s[1:] or check_s) if check_s else 0.0
    step = mean("time_step_s") - checking
    handoff = mean("time_offload_s") + mean("time_onload_s")
    return {"mode": mode, "steps": len(rows), "error": error, "trace": trace[-4000:],
            "step_s": step,
            "offload_s": mean("time_offload_s"), "onload_s": mean("time_onload_s"),
            "share": handoff / step if steady else float("nan"),
            "train_peak_gib": max((r.get("gpu_train_peak_gib_max", 0) for r in rows),
                                  default=float("nan")),
            "resident_gib": max((r.get("gpu_resident_gib_max", 0) for r in rows),
                                default=float("nan")),
            "offload_gib": mean("offload_gib"), "device_peak_gib": peak,
            "exact": bool(exact) and all(exact), "syncs": len(exact),
            "own_gpu": bool(own_gpu) and all(own_gpu),
            "gen_s": mean("time_generate_s"), "train_s": mean("time_train_s"),
            "sync_s": mean("time_sync_s") - checking, "check_s": checking}


def settle(limit_s: float = 90.0) -> None:
    """Wait until the cards are (nearly) empty again: a run's processes exit after it."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and shutil.which("nvidia-smi"):
        if all(used < 2 for used in gpu_memory_used_gib()):
            return
        time.sleep(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-colocated"))
    p.add_argument("--shape", default="qwen2.5-3b")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--engine-tp", type=int, default=1)
    p.add_argument("--fraction", type=float, default=0.7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"])
    p.add_argument("--modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--cpu", action="store_true",
                   help="dry run without a GPU: the tiny shape (unless --shape), small "
                        "batches, fsdp and the reference engine on CPU")
    args = p.parse_args()
    if args.cpu:
        if args.backend != "fsdp" or args.engine_tp != 1:
            p.error("--cpu runs the fsdp backend and a TP=1 engine only")
        if args.shape == p.get_default("shape"):
            args.shape = "tiny"
        args.gpus, args.prompts, args.samples, args.response_len = 0, 4, 2, 8
        args.out = args.out.with_name(args.out.name + "-cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    build_model(args.out, args.shape)
    rows = []
    for mode in args.modes:
        rows.append(run(mode, args))
        r = rows[-1]  # printed at once: a run cut off by a time limit still shows the others
        done = f"{r['steps']}" + (f" ({r['error']})" if r["error"] else "")
        print(f"ROW | {r['mode']} | {done} | {r['step_s']:.2f} | {r['gen_s']:.2f} | "
              f"{r['train_s']:.2f} | {r['sync_s']:.2f} | {r['offload_s']:.2f} | "
              f"{r['onload_s']:.2f} | {r['share']:.1%} | {r['train_peak_gib']:.1f} | "
              f"{r['resident_gib']:.1f} | {r['offload_gib']:.1f} | {r['device_peak_gib']:.1f} "
              f"| {'yes' if r['exact'] else 'no'} ({r['syncs']} syncs) "
              f"| {'yes' if r['own_gpu'] else 'no'} |", flush=True)
        (args.out / "colocated.json").write_text(json.dumps(rows, indent=2))
        settle()  # the next run starts on empty cards
    trainer = "fsdp fp32" if args.backend == "fsdp" else "megatron bf16 (fp32 master, Adam)"
    print(f"\n{args.shape}, {card()} x{args.gpus}, engine TP "
          f"{args.engine_tp}, memoryFraction {args.fraction}, {trainer} trainer, "
          f"{args.prompts * args.samples} samples/step, means of steps 2+; columns: handoff | "
          "steps done | step s | generate s | train s | sync s (without the checks) | offload s | "
          "onload s | share of step | trainer peak GiB "
          "(train) | trainer GiB while engines generate | offloaded GiB | device peak GiB | "
          "weights exact after every sync | every engine TP rank read its tensors on its own GPU")
    # (a run that failed, as `off` is expected to, has no syncs to speak for)
    return 0 if all(r["exact"] for r in rows if not r["error"]) else 1


if __name__ == "__main__":
    sys.exit(main())
