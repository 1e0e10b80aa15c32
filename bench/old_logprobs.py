"""What `algorithm.oldLogprobs: engine` saves: the trainer's forward pass for pi_old.

With several optimizer steps per rollout (training.globalBatchSize below rolloutBatchSize *
nSamplesPerPrompt) the trainer runs a forward pass over its whole shard before the first step,
so that every step's PPO ratio has the policy that sampled as its denominator. With
`oldLogprobs: engine` the engines' log-probs from sampling stand in and that pass is skipped.
This times the fsdp backend's `train_step` on one rollout in both modes, for each number of
optimizer steps per rollout, on a random-weight model of a real shape (bench/gpu_common.py),
and the forward pass alone (`logprobs` over the same batch):

    python bench/old_logprobs.py                                  # Qwen2.5-1.5B, 1 GPU
    python bench/old_logprobs.py --shape qwen2.5-7b --samples 128 --micro-batch 4
    python bench/old_logprobs.py --cpu                            # the tiny shape on CPU:
                                                                  # checks the code paths

Prints a markdown table: optimizer steps per rollout, seconds per train_step with the
trainer's pi_old and with the engines', the time saved (and its share), the pi_old forward
alone, and the `old_logprobs_recomputed` metric each mode reported (1: the forward ran).
One optimizer step per rollout is the control: neither mode runs the pass there. Never part
of `make test`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_common import SHAPES, build_model, card, random_batch  # bench/ is on sys.path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds of ``repeats`` calls after one warm-up call, the last call's result)."""
    out = fn()
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def backend_for(model_dir: Path, args: argparse.Namespace, steps: int, old: str) -> Any:
    """The fsdp backend of a job whose rollout of ``--samples`` makes ``steps`` optimizer
    steps, pi_old from ``old`` (trainer or engine)."""
    from kuberl_api.spec import RLJobSpec
    from kuberl_trainer.backends.fsdp import FSDPBackend

    longest = args.prompt + args.response[1]
    spec = RLJobSpec.model_validate({
        "model": {"path": str(model_dir)},
        "data": {"prompts": "/unused.jsonl", "rolloutBatchSize": args.samples,
                 "nSamplesPerPrompt": 1, "maxPromptLen": args.prompt,
                 "maxResponseLen": longest - args.prompt},
        "training": {"backend": "fsdp", "gpusPerNode": 0 if args.cpu else 1,
                     "microBatchSize": args.micro_batch,
                     "globalBatchSize": args.samples // steps},
        "rollout": {"engine": "reference"} if args.cpu else {},
        "algorithm": {"lr": 1e-6, "oldLogprobs": old},
    })
    return FSDPBackend(spec, rank=0, world_size=1, device="cpu" if args.cpu else "cuda")


def free(backend: Any) -> None:
    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="model shape (default qwen2.5-1.5b; tiny with --cpu)")
    p.add_argument("--samples", type=int, default=256, help="one rollout's samples")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sample")
    p.add_argument("--response", type=int, nargs=2, default=(128, 1024),
                   metavar=("MIN", "MAX"), help="response lengths, drawn uniformly")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="optimizer steps per rollout (each must divide --samples)")
    p.add_argument("--repeats", type=int, default=3, help="timed train steps per cell")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the tiny shape, a small batch, float32 on CPU")
    p.add_argument("--out", type=Path, default=Path("/tmp/kuberl-bench-old-logprobs"))
    args = p.parse_args()
    if args.cpu:
        args.shape = args.shape or "tiny"
        args.samples, args.micro_batch, args.prompt = 16, 4, 6
        args.response, args.repeats = (3, 40), 1
        args.steps = [s for s in args.steps if s <= 4]
    shape = args.shape or "qwen2.5-1.5b"
    if any(args.samples % s for s in args.steps):
        p.error(f"every --steps value must divide --samples {args.samples}")
    model_dir = build_model(args.out / shape, shape)
    batch = random_batch(args.samples, prompt=args.prompt, response=tuple(args.response),
                         vocab=SHAPES[shape][-1])

    rows = []
    for steps in args.steps:
        cell: dict[str, Any] = {"steps": steps}
        for old in ("trainer", "engine"):
            backend = backend_for(model_dir, args, steps, old)
            cell[old], metrics = timed(lambda b=backend: b.train_step(batch), args.repeats)
            cell[f"{old}_recomputed"] = metrics["old_logprobs_recomputed"]
            if old == "trainer":
                cell["forward"], _ = timed(lambda b=backend: b.logprobs(batch), args.repeats)
            free(backend)
        rows.append(cell)
        print(f"{steps} step(s): trainer {cell['trainer']:.3f} s, engine {cell['engine']:.3f} s",
              file=sys.stderr, flush=True)

    tokens = int(batch.attention_mask.sum())
    print(f"\n{card()}, {shape}, {args.samples} samples ({tokens} tokens) per rollout, "
          f"micro-batch {args.micro_batch}, median of {args.repeats}\n")
    print("| optimizer steps / rollout | trainer pi_old s/step | engine pi_old s/step | saved s "
          "| saved % | pi_old forward s | recomputed (trainer, engine) |")
    print("|---|---|---|---|---|---|---|")
    for c in rows:
        saved = c["trainer"] - c["engine"]
        print(f"| {c['steps']} | {c['trainer']:.3f} | {c['engine']:.3f} | {saved:.3f} | "
              f"{100 * saved / c['trainer']:.1f} | {c['forward']:.3f} | "
              f"{c['trainer_recomputed']:.0f}, {c['engine_recomputed']:.0f} |")
    # The code path checks a dry run can make: the pass runs in trainer mode exactly when
    # the rollout feeds several steps, and never with the engines' log-probs.
    bad = [c["steps"] for c in rows
           if c["engine_recomputed"] != 0 or c["trainer_recomputed"] != (c["steps"] > 1)]
    if bad:
        print(f"old_logprobs_recomputed wrong at {bad} optimizer steps per rollout",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
