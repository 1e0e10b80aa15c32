"""The training loop on GPUs: throughput and step-time split, plus a weight-sync check.

Runs the same Session as `kuberl run` (Ray, reference engines, fsdp backend, NCCL weight sync)
on a random-weight model of a real shape (Qwen2.5-0.5B by default) with the tiny job's
character tokenizer and addition prompts (the reward stays ~0: this measures speed, not
learning). After the run it checks that a sync delivers: the trainer's weights are negated on
every rank (the reward is ~0, so they never moved and the engines' base model matched them
already), one more sync goes through the run's own path, and every engine TP process must
then hold the trainer's checksums on every tensor, each of which differed before that sync
(sync_check.py).

    python bench/gpu_loop.py --placement disaggregated --steps 6     # 2 GPUs: trainer | engine
    python bench/gpu_loop.py --placement colocate --steps 6          # 1 GPU shared
    python bench/gpu_loop.py --backend megatron --steps 6             # megatron-core trainer
    python bench/gpu_loop.py --engine-tp 2 --engine-nodes 2 --steps 4 # 3 GPUs: an engine of
                                                                      # TP 2 over 2 "nodes"
    python bench/gpu_loop.py --steps 4 --kill-engine-at-sync 2        # 2 GPUs: the engine is
        # SIGKILLed as the weights of version 2 go out; it must be replaced on its GPU and the
        # replacement must hold the trainer's weights. The base model on disk is perturbed
        # after start-up, so a replacement that missed the sync fails the checksum check.
    python bench/gpu_loop.py --turns 4 --steps 6                      # multi-turn: 4 model
        # turns of a quarter of the budget each (less the observations), a 4-token
        # observation between them (bench/agent_turns.py): against the single-turn run
    python bench/gpu_loop.py --backend megatron --turns 2 --rows 2  # 2 rows per sample (one
        # group member, one reward: rollout.maxRowsPerSample), each of 2 turns
    python bench/gpu_loop.py --cpu --steps 2                      # no GPU: the tiny shape,
        # fsdp on CPU, a CPU reference engine; checks the code paths (and the check's)

Prints a table: generated tokens/s, trained tokens/s, seconds per step split into generate /
train / sync, weight-sync GB/s. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from gpu_common import SHAPES, build_model, card  # bench/ is on sys.path when run as a script
from sync_check import SyncCheck, verify_session_sync


def manifest(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": str(out / "model")},
        "data": {"prompts": str(out / "data" / "train.jsonl"),
                 "rolloutBatchSize": args.prompts, "nSamplesPerPrompt": args.samples,
                 "maxPromptLen": 8, "maxResponseLen": args.response_len},
        "reward": {"type": "exact"},
        "algorithm": {"lr": 1e-6},
        "training": {"backend": args.backend, "gpusPerNode": 1,
                     "microBatchSize": args.micro_batch,
                     "fusedKernels": getattr(args, "fused_kernels", "none")},
        # bf16, as SGLang serves this model; both backends send in the engine's dtype
        # (engine_command.engine_dtype), so the checksum check compares identical bytes.
        "rollout": {"engine": "reference", "gpusPerEngine": 1,
                    "engineArgs": {"dtype": "bfloat16"}},
        "placement": args.placement,
        "schedule": {"numRollouts": args.steps},
    }
    spec["rollout"]["gpusPerEngine"] = args.engine_tp
    if args.turns > 1 or args.rows > 1:  # the model's turns, an observation between them
        spec["rollout"] |= {"function": "agent_turns:turns", "maxTurns": args.turns,
                            "maxRowsPerSample": args.rows,
                            "functionArgs": {"turns": str(args.turns), "rows": str(args.rows),
                                             "observation": "+12="}}
    if getattr(args, "cpu", False):  # the dry run: CPU trainer and engine, as `make demo`
        spec["training"]["gpusPerNode"] = 0
        spec["rollout"] |= {"gpus": 0}
        return {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                "metadata": {"name": "gpu-loop"}, "spec": spec}
    if args.placement == "disaggregated":  # (colocated engines take the training pods' GPUs)
        # --engine-nodes K: rollout "nodes" of TP/K GPUs, so the engine spans K of them (one
        # Ray actor and server process each, SGLang's --nnodes; here all on one machine)
        spec["rollout"] |= {"gpus": args.engine_tp,
                            "gpusPerNode": args.engine_tp // args.engine_nodes}
    return {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
            "metadata": {"name": "gpu-loop"}, "spec": spec}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-gpu-loop"))
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--placement", default="disaggregated")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"])
    p.add_argument("--engine-tp", type=int, default=1, help="one engine of this TP size")
    p.add_argument("--fused-kernels", default="none", choices=["none", "liger"],
                   help="training.fusedKernels (fsdp on GPUs)")
    p.add_argument("--engine-nodes", type=int, default=1,
                   help="(disaggregated) the nodes that engine spans")
    p.add_argument("--kill-engine-at-sync", type=int, default=None, metavar="VERSION",
                   help="SIGKILL the engine as this weight version goes out (fleet check)")
    p.add_argument("--turns", type=int, default=1,
                   help="model turns per trajectory (bench/agent_turns.py), sharing "
                   "--response-len")
    p.add_argument("--rows", type=int, default=1,
                   help="trajectories per sample (rollout.maxRowsPerSample), each of --turns")
    p.add_argument("--cpu", action="store_true",
                   help="dry run without a GPU: the tiny shape (unless --shape), small "
                        "batches, fsdp on CPU and a CPU reference engine")
    args = p.parse_args()
    if args.cpu:
        if args.backend != "fsdp" or args.engine_tp != 1 or args.fused_kernels != "none":
            p.error("--cpu runs the fsdp backend without fused kernels and a TP=1 engine only")
        if args.shape == p.get_default("shape"):
            args.shape = "tiny"
        args.prompts, args.samples = 4, 2
        args.response_len = 8 if args.turns == 1 else 32
        args.micro_batch = min(args.micro_batch, 8)
        args.out = args.out.with_name(args.out.name + "-cpu")

    from kuberl_api import parse
    from kuberl_trainer import ray_auth

    ray_auth.enable_for_local_ray()  # the local Ray checks a token, as kuberl run's does
    from kuberl_trainer.options import Options
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    args.out.mkdir(parents=True, exist_ok=True)
    build_model(args.out, args.shape)
    doc = manifest(args.out, args)
    (args.out / "job.yaml").write_text(yaml.safe_dump(doc))
    job = parse(doc)
    run_dir = args.out / f"run-{args.backend}-{args.placement}-{int(time.time())}"
    opts = Options(address=None, in_cluster=False, output_dir=run_dir,
                   checkpoint_dir=run_dir / "ckpt", prometheus_port=0, tensorboard=None, seed=0)
    session = Session(job, opts, check(job.spec))
    try:
        t0 = time.perf_counter()
        session.start()
        print(f"startup {time.perf_counter() - t0:.1f}s", flush=True)
        assert session.engines is not None and session.trainers is not None
        first_urls = list(session.engines.urls)
        if args.kill_engine_at_sync is not None:
            kill_engine_at_sync(session, args.kill_engine_at_sync, args.out / "model")
        session.train(Progress(args.steps))
        urls = session.engines.urls
        # every TP process of every engine, after one more sync of changed weights
        verdict = verify_session_sync(session, args.engine_tp)
        print(verdict, flush=True)
        synced = verdict.ok
        if args.kill_engine_at_sync is not None:
            replaced = urls != first_urls and session.fleet.restarts == 1
            print(f"engine {first_urls} -> {urls}, restarts {session.fleet.restarts}: "
                  f"{'replaced' if replaced else 'NOT REPLACED'}")
            synced = synced and replaced
    finally:
        session.close()
    report(run_dir, args, verdict)
    return 0 if synced else 1


def kill_engine_at_sync(session: Any, version: int, model_dir: Path) -> None:
    """SIGKILL engine 0's server as weight version `version` starts going out; first perturb
    the base model on disk, which a replacement loads: only the sync can make it match."""
    import os
    import signal
    import subprocess

    from safetensors.torch import load_file, save_file

    for f in model_dir.glob("*.safetensors"):
        tensors = {k: v + 0.01 for k, v in load_file(f).items()}
        save_file(tensors, f, metadata={"format": "pt"})
    push, first = session.trainers.push_weights, list(session.engines.urls)

    def push_killing(urls: list[str], weight_version: int, bucket_bytes: int) -> float:
        if weight_version == version and urls == first:
            port = first[0].rsplit(":", 1)[1]
            pids = subprocess.run(["pgrep", "-f", f"kuberl_rollout.reference .*--port {port}"],
                                  capture_output=True, text=True).stdout.split()
            print(f"killing engine {first[0]} (pids {pids}) at version {version}", flush=True)
            for pid in pids:
                os.kill(int(pid), signal.SIGKILL)
        return push(urls, weight_version, bucket_bytes)  # type: ignore[no-any-return]

    session.trainers.push_weights = push_killing


def report(run_dir: Path, args: argparse.Namespace, verdict: SyncCheck) -> None:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows  # step 0 includes CUDA warm-up
    mean = lambda k: statistics.fmean(r[k] for r in steady)  # noqa: E731
    samples = args.prompts * args.samples
    # the model's tokens (a multi-turn trajectory's observations are not generated)
    per_sample = mean("rows_mean") if args.rows > 1 else 1.0  # a sample's real rows
    gen_tokens = mean("response_model_tokens_mean" if args.turns > 1 or args.rows > 1
                      else "response_length_mean") * samples * per_sample
    train_tokens = (mean("response_length_mean") + 6) * samples * per_sample
    print(f"\n{args.shape}, backend {args.backend} (fusedKernels {args.fused_kernels}), "
          f"{args.placement}, engine TP "
          f"{args.engine_tp} over {args.engine_nodes} node(s), "
          f"{args.turns} turn(s) x {args.rows} row(s), "
          f"GPU: {card()}, "
          f"{samples} samples/step, steps {len(rows)} (first excluded)")
    print(f"{'gen tok/s':>10} {'train tok/s':>12} {'gen s':>7} {'train s':>8} {'sync s':>7} "
          f"{'step s':>7} {'weights synced':>15}")
    print(f"{gen_tokens / mean('time_generate_s'):>10.0f} "
          f"{train_tokens / mean('time_train_s'):>12.0f} {mean('time_generate_s'):>7.2f} "
          f"{mean('time_train_s'):>8.2f} {mean('time_sync_s'):>7.2f} "
          f"{mean('time_step_s'):>7.2f} {verdict.ok!s:>15}")
    print(f"weights synced: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
