"""The reference engine's batching under staggered arrivals: continuous (token-level, SGLang's:
a request joins the running batch at the next decode step) vs batch-level (a batch runs to
completion before the next starts: the engine's scheduling before issue 37, with today's
step code), side by side in one run.

`--requests` requests (default 64) arrive as a Poisson process over about `--spread` seconds,
each its own POST /generate (as SGLang's router sends them), with random prompts of 4-32
tokens and random max_new_tokens in [16, 128] (ignore_eos, sampled with a seed per request:
the same workload for both modes). The same engine (`--batching continuous` or `batch`) runs
the workload in turn, `--rounds` times alternating. Per mode: the seconds from the first
arrival to the last answer, per-request latency (arrival to answer) p50 / p99 / mean, and the
tokens generated per second; and whether every request got the same tokens in both modes
(each request's draws come from its own seed: batching may change float rounding, not, as a
rule, tokens).

    .venv/bin/python bench/engine_batching.py
    .venv/bin/python bench/engine_batching.py --hidden 256 --layers 4 --rounds 2
    .venv/bin/python bench/engine_batching.py --rounds 3 --baseline e5c9c87

The model is a random Qwen2 (the tests' character tokenizer) of `--hidden` x `--layers`, on
the CPU with `--torch-threads` threads. Timings on a shared machine are noisy: compare only
numbers taken in the same run, and say how busy the machine was.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Request:
    at: float  # seconds after the start
    prompt: list[int]
    new_tokens: int
    seed: int


@dataclass
class Outcome:
    mode: str
    total_s: float
    latencies: list[float]
    tokens: int
    outputs: list[list[int]]


def workload(n: int, spread_s: float, seed: int, max_new: int) -> list[Request]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        out.append(Request(at, [rng.randrange(3, 40) for _ in range(rng.randint(4, 32))],
                           rng.randint(16, max_new), seed * 1000 + i))
        at += rng.expovariate(n / spread_s)
    return out


def build_model(path: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.integration.tiny_model import build_tokenizer, tiny_config

    heads = max(4, hidden // 64)
    fields = {k: v for k, v in tiny_config().to_dict().items() if k != "layer_types"}
    config = Qwen2Config(**{**fields, "hidden_size": hidden, "intermediate_size": 4 * hidden,
                            "num_hidden_layers": layers, "num_attention_heads": heads,
                            "num_key_value_heads": max(1, heads // 2),
                            "max_position_embeddings": 1024})
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def checkout(ref: str, tmp: Path) -> str:
    """`ref`'s engine packages (git archive, no worktree) and the PYTHONPATH that imports
    them first."""
    path = tmp / "baseline"
    path.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "rollout_image", "wire"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return os.pathsep.join([str(path / "rollout_image"), str(path / "wire"),
                            os.environ.get("PYTHONPATH", "")])


def start_engine(model: Path, mode: str, args: argparse.Namespace, log: Path,
                 baseline_path: str | None) -> tuple[Any, str]:
    port = free_port()
    env = dict(os.environ)
    flags = ["--batching", mode]
    if mode.startswith("parent"):  # the engine of --baseline, with its own batching
        env["PYTHONPATH"], flags = baseline_path or "", []
    proc = subprocess.Popen(
        [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model),
         "--port", str(port), "--torch-threads", str(args.torch_threads), *flags,
         "--device", args.device, "--dtype", args.dtype,
         "--max-batch-size", str(args.max_batch_size)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, proc: Any, log: Path) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited:\n{log.read_text()[-2000:]}")
            try:
                async with session.get(f"{url}/get_model_info") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("engine not ready")


async def run(url: str, mode: str, reqs: list[Request]) -> Outcome:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        # warm-up: one request, so the first measured step pays no lazy initialisation
        async with session.post(f"{url}/generate", json={
                "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}) as answer:
            await answer.json()
        start = time.monotonic()

        async def one(req: Request) -> tuple[float, list[int]]:
            await asyncio.sleep(max(0.0, start + req.at - time.monotonic()))
            sent = time.monotonic()
            async with session.post(f"{url}/generate", json={
                    "input_ids": req.prompt, "sampling_params": {
                        "max_new_tokens": req.new_tokens, "ignore_eos": True,
                        "temperature": 1.0, "sampling_seed": req.seed}}) as answer:
                body = await answer.json()
            return time.monotonic() - sent, body["output_ids"]

        done = await asyncio.gather(*(one(r) for r in reqs))
        total = time.monotonic() - start
    return Outcome(mode, total, [d[0] for d in done], sum(len(d[1]) for d in done),
                   [d[1] for d in done])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--spread", type=float, default=4.0,
                   help="seconds over which the requests arrive (Poisson)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="(more than one thrashes on a busy machine)")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, alternating")
    p.add_argument("--baseline", default=None,
                   help="a commit whose engine runs the workload too, with its own batching "
                        "(e5c9c87: batch-level, each batch one job on the worker thread)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-new", type=int, default=128,
                   help="max_new_tokens is drawn from [16, this]")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    reqs = workload(args.requests, args.spread, args.seed, args.max_new)
    outcomes: dict[str, list[Outcome]] = {"continuous": [], "batch": []}
    if args.baseline:
        outcomes[f"parent {args.baseline}"] = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline_path = checkout(args.baseline, Path(tmp)) if args.baseline else None
        model = build_model(Path(tmp) / "model", args.hidden, args.layers)
        for _ in range(args.rounds):
            for mode in outcomes:
                log = Path(tmp) / f"{mode}.log"
                proc, url = start_engine(model, mode, args, log, baseline_path)
                try:
                    asyncio.run(wait_ready(url, proc, log))
                    outcomes[mode].append(asyncio.run(run(url, mode, reqs)))
                finally:
                    proc.terminate()
                    proc.wait(30)
    print(f"{args.requests} requests over ~{args.spread:g} s (Poisson), prompts 4-32 tokens, "
          f"16-{args.max_new} new tokens; Qwen2 hidden {args.hidden} x {args.layers} layers, "
          f"{args.device} {args.dtype}, {args.torch_threads} torch thread(s); {args.rounds} "
          f"round(s) per mode")
    print(f"{'batching':<15} {'total s':>8} {'p50 s':>7} {'p99 s':>7} {'mean s':>7} "
          f"{'tok/s':>7}")
    for mode, runs in outcomes.items():
        for o in runs:
            print(f"{mode:<15} {o.total_s:8.2f} {pct(o.latencies, 0.5):7.2f} "
                  f"{pct(o.latencies, 0.99):7.2f} {statistics.fmean(o.latencies):7.2f} "
                  f"{o.tokens / o.total_s:7.0f}")
    cont = outcomes["continuous"]
    for mode, runs in outcomes.items():
        if mode == "continuous":
            continue

        def ratio(of: Any, runs: list[Outcome] = runs) -> float:
            return statistics.median(map(of, cont)) / statistics.median(map(of, runs))

        same = sum(a == b for a, b in zip(cont[0].outputs, runs[0].outputs, strict=True))
        print(f"continuous / {mode} (medians): total {ratio(lambda o: o.total_s):.2f}x, "
              f"p50 {ratio(lambda o: pct(o.latencies, 0.5)):.2f}x, "
              f"p99 {ratio(lambda o: pct(o.latencies, 0.99)):.2f}x; "
              f"requests with the same tokens: {same} / {len(reqs)}")

if __name__ == "__main__":
    main()
