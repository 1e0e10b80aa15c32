"""Weight sync to reference engines at tensor parallel size 2 over NCCL, both paths, vs. TP=1.

The GPU check of TP-aware weight sync (issue 13). Each TP process of an engine joins the update
group (disaggregated) or reads its own entry of the tensor update (colocated), so a wrong rank
layout hangs, fails, or leaves a rank with other weights; the check reads every TP process's
checksums.

- disaggregated: this process is the trainer on GPU 0 with the model's weights; a TP=2 engine
  on GPUs 1-2, the same engine split over two "nodes" (SGLang's --nnodes 2: two processes, one
  GPU each, node 1's rank reaching node 0 over its dist-init address and joining the group
  itself), and a TP=1 engine on GPU 3 (the baseline, same run). `DistributedWeightSender`
  (pause, flush, buckets over NCCL, continue) pushes the weights, negated before every sync so
  the engine must receive every byte; after the last sync every TP process's sha256 of every
  tensor must equal the trainer's, and must have differed from it just before that sync (read
  then: with an even number of syncs the weights are the base model's again).
- colocated: two training ranks (processes on GPUs 0 and 1, one NCCL group) and a TP=2 engine
  on the same two GPUs (then, as the baseline, two TP=1 engines, one per GPU); `push_colocated`
  routes each engine TP rank's entry from the training rank on its GPU. Neither rank holds the
  base model W the engines loaded, and each holds other weights than the other (rank 0 W + 1,
  rank 1 -W), so the check fails unless each engine rank received its own GPU's copy: the
  process on GPU 0 must hold W + 1, the one on GPU 1 -W, each tensor unlike before the syncs.

Prints a table (GB per sync, median seconds of `--repeats`, GB/s, exact) and writes OUT/tp.json.
Needs 4 GPUs (3 for disaggregated), aiohttp. GB = 1e9 bytes. Never part of `make test`:

    PYTHONPATH=operator:trainer_image:rollout_image:wire python3 bench/gpu_tp_sync.py \\
        --shape qwen2.5-0.5b --out /tmp/tp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from gpu_common import ROOT, build_model, card  # bench/ on path
from sync_check import engine_sums, judge

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_engine(model_dir: Path, gpus: str, tp: int, log: Path,
                 *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "KUBERL_ENGINE_SECRET": "bench",
           "PYTHONPATH": os.pathsep.join([str(ROOT / p) for p in (
               "operator", "trainer_image", "rollout_image", "wire")] + [
               os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model_dir),
         "--host", HOST, "--port", str(port), "--device", "cuda", "--dtype", "bfloat16",
         "--tp-size", str(tp), *extra], stdout=log.open("w"), stderr=subprocess.STDOUT,
        env=env)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"engine {url} not healthy: {log.read_text()[-3000:]}")


def load_params(model_dir: Path, device: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def sha(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    from kuberl_wire.codec import tensor_sha256

    return {n: tensor_sha256(t) for n, t in named}


def buckets(named: list[tuple[str, torch.Tensor]], mb: int) -> list[list[tuple[str, Any]]]:
    from kuberl_trainer.weight_sync.sender import bucketize

    return list(bucketize(named, mb << 20))


def disaggregated(model_dir: Path, tp: int, gpus: str, args: argparse.Namespace,
                  out: Path, nodes: int = 1) -> dict[str, Any]:
    """`nodes` > 1: the engine as that many processes (SGLang's --nnodes), each on its own
    slice of `gpus`, as on separate nodes."""
    from kuberl_trainer.engines.client import EngineClient
    from kuberl_trainer.weight_sync.sender import DistributedWeightSender

    name = f"tp{tp}" + (f"-{nodes}nodes" if nodes > 1 else "")
    per_node = gpus.split(",")
    per_node = [",".join(per_node[i::nodes]) for i in range(nodes)]
    flags = ["--nnodes", str(nodes), "--dist-init-addr", f"{HOST}:{free_port()}"]
    others = [start_engine(model_dir, per_node[r], tp, out / f"engine-disagg-{name}-{r}.log",
                           *flags, "--node-rank", str(r))[0] for r in range(1, nodes)]
    proc, url = start_engine(model_dir, per_node[0], tp, out / f"engine-disagg-{name}.log",
                             *([*flags, "--node-rank", "0"] if nodes > 1 else []))
    named = load_params(model_dir, "cuda:0")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    loop = asyncio.new_event_loop()
    client = EngineClient([url], request_timeout_s=900)
    sender = DistributedWeightSender(client, master_address=HOST, master_port=free_port(),
                                     backend="nccl", group_name=f"tp{tp}", timeout_s=300,
                                     tp_sizes=[tp])
    try:
        loop.run_until_complete(sender.connect())
        seconds = []
        before: list[dict[str, str]] = []
        for i in range(args.repeats + 1):  # the first warms up
            for _, t in named:
                t.neg_()
            if i == args.repeats:  # what the engine holds before the checked (last) sync
                before = engine_sums([url])
            torch.cuda.synchronize()
            start = time.perf_counter()
            loop.run_until_complete(sender.send(buckets(named, args.bucket_mb)))
            seconds.append(time.perf_counter() - start)
        verdict = judge(before, engine_sums([url]), sha(named), tp)
        print(f"  {name}: {verdict}", flush=True)
        exact = verdict.ok
        loop.run_until_complete(sender.close())
    finally:
        loop.run_until_complete(client.close())
        for p in (proc, *others):
            p.terminate()
            p.wait(timeout=30)
    median = statistics.median(seconds[1:])
    path = "disaggregated (NCCL)" + (f", engine over {nodes} nodes" if nodes > 1 else "")
    return {"path": path, "tp": tp, "gb": nbytes / 1e9, "seconds": median,
            "gb_per_s": nbytes / 1e9 / median, "exact": exact}


def _colocated_rank(rank: int, world: int, port: int, model_dir: str, urls: list[str],
                    devices: list[list[int]], mb: int, repeats: int, results: Any) -> None:
    from kuberl_trainer.weight_sync.colocated import Poster, push_colocated

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://{HOST}:{port}",
                                         rank=rank, world_size=world)
    named = load_params(Path(model_dir), f"cuda:{rank}")
    # Neither copy is the base model the engines hold (else a sync that delivered nothing
    # would pass), and they differ: only routing by GPU gives each engine rank its own.
    for _, t in named:
        if rank == 0:
            t.add_(1.0)
        else:
            t.neg_()
    seconds = []
    poster = Poster(urls) if rank == 0 else None  # kept across syncs, as a TrainWorker does
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        torch.distributed.barrier()
        start = time.perf_counter()
        push_colocated(buckets(named, mb), rank=rank, world_size=world, gpu=(HOST, rank),
                       engine_urls=urls, engine_devices=devices, weight_version=str(i),
                       poster=poster, dtype=named[0][1].dtype)
        seconds.append(time.perf_counter() - start)
    if poster is not None:
        poster.close()
    results.put((rank, seconds, sha(named)))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def colocated(model_dir: Path, tp: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Two training ranks on GPUs 0-1; one TP=2 engine on both, or two TP=1 engines."""
    devices = [[0, 1]] if tp == 2 else [[0], [1]]
    engines = [start_engine(model_dir, ",".join(map(str, d)), tp,
                            out / f"engine-colocated-tp{tp}-{i}.log")
               for i, d in enumerate(devices)]
    urls = [url for _, url in engines]
    try:
        before = [engine_sums([url]) for url in urls]  # the base model, as each engine loaded it
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_colocated_rank, args=(
            r, 2, port, str(model_dir), urls, devices, args.bucket_mb, args.repeats, results))
            for r in range(2)]
        for p in procs:
            p.start()
        got = {r: (s, w) for r, s, w in (results.get(timeout=900) for _ in procs)}
        for p in procs:
            p.join(timeout=120)
        # engine e's TP rank r must hold what the training rank on GPU devices[e][r] holds,
        # unlike before the syncs
        verdicts = [judge(was[r:r + 1], ranks[r:r + 1], got[gpu][1], 1)
                    for url, devs, was in zip(urls, devices, before, strict=True)
                    for ranks in [engine_sums([url])] for r, gpu in enumerate(devs)]
        for v in verdicts:
            print(f"  colocated tp{tp}: {v}", flush=True)
        exact = [v.ok for v in verdicts]
    finally:
        for proc, _ in engines:
            proc.terminate()
            proc.wait(timeout=30)
    nbytes = sum(t.numel() * t.element_size()
                 for _, t in load_params(model_dir, "cpu"))
    median = statistics.median(got[0][0][1:])
    return {"path": "colocated (CUDA IPC, per-GPU routing)", "tp": tp, "gb": nbytes / 1e9,
            "seconds": median, "gb_per_s": nbytes / 1e9 / median, "exact": all(exact),
            "exact_per_rank": exact}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("/tmp/tp"))
    p.add_argument("--skip-disaggregated", action="store_true")
    p.add_argument("--skip-colocated", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.out / args.shape, args.shape)
    rows = []
    if not args.skip_disaggregated:
        rows.append(disaggregated(model_dir, 2, "1,2", args, args.out))
        rows.append(disaggregated(model_dir, 2, "1,2", args, args.out, nodes=2))
        rows.append(disaggregated(model_dir, 1, "3", args, args.out))
    if not args.skip_colocated:
        rows.append(colocated(model_dir, 2, args, args.out))
        rows.append(colocated(model_dir, 1, args, args.out))
    print(f"\n{card()} x{torch.cuda.device_count()}, torch {torch.__version__}, "
          f"{args.shape}, bucket {args.bucket_mb} MB, median of {args.repeats}")
    print("| path | engine TP | GB/sync | s/sync | GB/s | exact on every TP rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['tp']} | {r['gb']:.3f} | {r['seconds']:.3f} | "
              f"{r['gb_per_s']:.1f} | {'yes' if r['exact'] else 'NO'} |")
    (args.out / "tp.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
