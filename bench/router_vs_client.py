"""Rollouts through SGLang's router (rollout.router: sglang) vs the client's own balancer.

Starts N reference engines and one sglang-router in front of them, then generates the same
rollout-shaped batch (G GRPO groups of S samples, a seed per sample) over and over, the two
ways taking turns: the client's balancer (one batched /generate per engine, whole groups) and
the router (one request per sample, a routing key per group). Prints seconds per rollout for
each, their ratio, how each spread the groups over the engines, and the prefix-cache hits the
engines report (`cached_tokens`; the reference engine keeps no prefix cache, so 0 there).

    .venv/bin/python bench/router_vs_client.py --engines 2 --groups 32 --samples 8
    python bench/router_vs_client.py --device cuda --model out/m --engines 2   # (a GPU box)

Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kuberl_trainer.engines.client import EngineClient, GenerateResult  # noqa: E402
from kuberl_trainer.engines.router import Router  # noqa: E402
from tests.integration.test_router import delta, served  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engines(model: Path, n: int, device: str, logs: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(n):
        port = free_port()
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(i)} if device == "cuda" else {})}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model),
             "--port", str(port), "--device", device, "--enable-metrics",
             *(["--torch-threads", "1"] if device == "cpu" else [])],
            stdout=(logs / f"engine{i}.log").open("w"), stderr=subprocess.STDOUT, env=env,
            start_new_session=True))
        procs[-1].url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return procs


async def rollout(client: EngineClient, args: argparse.Namespace, seed: int
                  ) -> tuple[float, list[GenerateResult], dict[str, int]]:
    # (distinct prompts within the tiny model's 14-token vocabulary)
    prompts = [[3 + g % 10, 3 + g // 10 % 10, 5] for g in range(args.groups)
               for _ in range(args.samples)]
    params = [{"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
               "sampling_seed": seed * 100000 + i} for i in range(len(prompts))]
    before = await served(client)
    started = time.perf_counter()
    results = await client.generate_spread(prompts, params, group=args.samples)
    seconds = time.perf_counter() - started
    return seconds, results, await delta(client, before)


async def main_async(args: argparse.Namespace, urls: list[str], logs: Path) -> None:
    client = EngineClient(urls, request_timeout_s=600)
    await client.wait_healthy(timeout_s=300)
    router = Router(client, log=logs / "router.log")
    await router.start()
    times: dict[str, list[float]] = {"client": [], "router": []}
    spread: dict[str, dict[str, int]] = {}
    cached: dict[str, int] = {"client": 0, "router": 0}
    try:
        for r in range(args.rounds + 1):  # round 0 warms both paths up, unmeasured
            for way in ("client", "router"):
                client.router_url = router.url if way == "router" else None
                seconds, results, counts = await rollout(client, args, seed=r)
                if r == 0:
                    continue
                times[way].append(seconds)
                spread[way] = counts
                cached[way] += sum(int(x.meta_info.get("cached_tokens", 0)) for x in results)
    finally:
        router.stop()
        await client.close()
    base = statistics.fmean(times["client"])
    print(f"\n{args.engines} engines ({args.device}), {args.groups} groups x {args.samples} "
          f"samples x {args.max_new_tokens} tokens, {args.rounds} rounds each, taking turns")
    print("| way | s per rollout (mean) | min | max | vs client | requests per engine "
          "(last round) | cached tokens |")
    print("|---|---|---|---|---|---|---|")
    for way, values in times.items():
        mean = statistics.fmean(values)
        print(f"| {way} | {mean:.3f} | {min(values):.3f} | {max(values):.3f} | "
              f"{base / mean:.2f}x | {' / '.join(str(c) for c in spread[way].values())} | "
              f"{cached[way]} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="an HF model directory (default: the tiny job's, built if missing)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.model is None:
        from tests.integration.local_run import tiny_job
        args.model = tiny_job() / "model"
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        logs = Path(tmp)
        procs = start_engines(args.model, args.engines, args.device, logs)
        try:
            asyncio.run(main_async(args, [p.url for p in procs],  # type: ignore[attr-defined]
                                   logs))
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
