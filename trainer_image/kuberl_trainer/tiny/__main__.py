"""`python -m kuberl_trainer.tiny build --out DIR [--variant add|tool|moe] [--seed 0]
[--sft-steps N] [--force]`; `python -m kuberl_trainer.tiny reward-model --out DIR
--policy BUILD/model [--seed 0] [--force]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kuberl_trainer.tiny.build import MOE_SFT_STEPS, TOOL_SFT_STEPS, VARIANTS, BuildConfig, build
from kuberl_trainer.tiny.reward_model import RewardConfig, build_reward_model


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
                   f"(default {BuildConfig.sft_steps}; tool: {TOOL_SFT_STEPS}; "
                   f"moe: {MOE_SFT_STEPS})")
    b.add_argument("--variant", choices=VARIANTS, default="add",
                   help="add: a+b= (the demo); tool: a+b+c= with a calculator to call "
                   "(examples/tiny-agent.yaml); moe: a+b= on a Qwen3-MoE model (4 experts, top-2)")
    b.add_argument("--force", action="store_true", help="rebuild even if DIR is up to date")
    r = sub.add_parser("reward-model", help="build DIR: a reward model (a one-label "
                       "Qwen2ForSequenceClassification) on the policy's body, its head fitted "
                       "to score correct sums above wrong ones (reused when up to date)")
    r.add_argument("--out", required=True, type=Path, help="output directory (an HF checkpoint)")
    r.add_argument("--policy", required=True, type=Path,
                   help="the tiny policy's model directory (`build --out B` writes B/model)")
    r.add_argument("--seed", type=int, default=RewardConfig.seed)
    r.add_argument("--force", action="store_true", help="rebuild even if DIR is up to date")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "reward-model":
        if not (args.policy / "config.json").is_file():
            print(f"--policy {args.policy}: no config.json (give the policy's model directory, "
                  "e.g. BUILD/model)", file=sys.stderr)
            return 2
        build_reward_model(args.out, args.policy, RewardConfig(seed=args.seed), force=args.force)
        return 0
    steps = args.sft_steps
    if steps is None:
        steps = {"tool": TOOL_SFT_STEPS, "moe": MOE_SFT_STEPS}.get(args.variant,
                                                                 BuildConfig.sft_steps)
    if steps < 0:
        print("--sft-steps must be >= 0", file=sys.stderr)
        return 2
    build(args.out, BuildConfig(seed=args.seed, sft_steps=steps, variant=args.variant),
          force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
