"""`python -m kuberl_trainer.tiny build --out DIR [--variant add|tool] [--seed 0] [--sft-steps N]
[--force]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kuberl_trainer.tiny.build import TOOL_SFT_STEPS, VARIANTS, BuildConfig, build


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kuberl_trainer.tiny",
                                description="Make the tiny local GRPO job's data, tokenizer "
                                "and warm-started model (offline, seeded, cached).")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build DIR (reused when it already holds this build)")
    b.add_argument("--out", required=True, type=Path, help="output directory")
    b.add_argument("--seed", type=int, default=BuildConfig.seed)
    b.add_argument("--sft-steps", type=int, default=None,
                   help=f"SFT warm-start steps of {BuildConfig.sft_batch_size} examples "
                   f"(default {BuildConfig.sft_steps}; tool: {TOOL_SFT_STEPS})")
    b.add_argument("--variant", choices=VARIANTS, default="add",
                   help="add: a+b= (the demo); tool: a+b+c= with a calculator to call "
                   "(examples/tiny-agent.yaml)")
    b.add_argument("--force", action="store_true", help="rebuild even if DIR is up to date")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    steps = args.sft_steps
    if steps is None:
        steps = TOOL_SFT_STEPS if args.variant == "tool" else BuildConfig.sft_steps
    if steps < 0:
        print("--sft-steps must be >= 0", file=sys.stderr)
        return 2
    build(args.out, BuildConfig(seed=args.seed, sft_steps=steps, variant=args.variant),
          force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
