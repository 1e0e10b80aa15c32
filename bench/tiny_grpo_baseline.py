"""Bare-torch GRPO on the tiny addition job: the reference the full system is measured against.

One process, no Ray, no HTTP, no weight sync: sample `prompts x samples` responses at
temperature 1 with a KV cache, reward exact match, GRPO advantages (group mean / std), PPO-clip
loss on the sampled tokens, one AdamW step per rollout (with the fsdp backend's AdamW settings).
DESIGN.md asks the full system (`kuberl run examples/tiny-grpo.yaml`) to stay within 1.5x this
step time on the same machine.

    .venv/bin/python bench/tiny_grpo_baseline.py --out out/tiny --steps 200

builds (or reuses) the tiny job directory with `kuberl_trainer.tiny`, then prints one row per
step and a summary: reward first-5 vs last-5 mean, greedy eval accuracy before and after, and
the mean seconds per step split into generate and train.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kuberl_trainer.backends.optim import LrMultiplier
from kuberl_trainer.tiny.build import EVAL_FILE, MODEL_DIR, THREADS, TRAIN_FILE, BuildConfig, build
from kuberl_trainer.tiny.data import Problem, read_jsonl
from kuberl_trainer.tiny.evaluate import MAX_NEW_TOKENS, accuracy, prompt_ids
from kuberl_trainer.tiny.sampling import Samples, answers, exact_rewards, sample

MAX_GRAD_NORM = 1.0
WEIGHT_DECAY = 0.01


@dataclass
class StepStats:
    step: int
    reward: float
    generate_s: float
    train_s: float
    clipfrac: float


def grpo_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards[B] (groups contiguous) -> (r - group mean) / (group std + eps), [B].
    Unbiased std, as slime and verl use; an all-equal group gets 0."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor, eps_clip: float) -> tuple[torch.Tensor, float]:
    """Token-mean PPO-clip loss over `mask`; logp/old_logp/mask [B,T], adv [B]. -> (loss,
    clip fraction)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps_clip, 1 + eps_clip) * a)
    m = mask.float()
    loss = -(surrogate * m).sum() / m.sum().clamp(min=1)
    clipped = ((ratio - 1).abs() > eps_clip).float()
    return loss, float((clipped * m).sum() / m.sum().clamp(min=1))


def response_logprobs(model: PreTrainedModel, prompts: torch.Tensor, s: Samples,
                      temperature: float) -> torch.Tensor:
    """Temperature-scaled log-probs [B,T] of the sampled response tokens (with grad)."""
    ids = torch.cat([prompts, s.tokens], 1)
    attention = torch.cat([torch.ones_like(prompts), s.mask], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    p = prompts.shape[1]
    # position p-1+t predicts response token t
    logp = torch.log_softmax(logits[:, p - 1:-1] / temperature, -1)
    return logp.gather(2, s.tokens[:, :, None]).squeeze(2)


class PromptStream:
    """Seeded shuffle per epoch, wrapping (kuberl_trainer.rollout.prompts.PromptSource)."""

    def __init__(self, problems: list[Problem], seed: int) -> None:
        self.problems, self.seed, self.epoch = problems, seed, 0
        self.order: list[int] = []

    def next(self, n: int) -> list[Problem]:
        batch: list[Problem] = []
        while len(batch) < n:
            if not self.order:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self.order = torch.randperm(len(self.problems), generator=g).tolist()
                self.epoch += 1
            batch.append(self.problems[self.order.pop()])
        return batch


def load_problems(path: Path) -> list[Problem]:
    out = []
    for rec in read_jsonl(path):
        a, b = rec["prompt"].rstrip("=").split("+")
        out.append(Problem(int(a), int(b)))
    return out


def grpo_step(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
              optimizer: torch.optim.Optimizer, batch: list[Problem], args: argparse.Namespace,
              generator: torch.Generator) -> StepStats:
    group = [p for p in batch for _ in range(args.samples)]  # groups contiguous
    prompts = prompt_ids(tokenizer, [p.prompt for p in group])
    t0 = time.perf_counter()
    model.train(False)  # eval mode (`eval()` is untyped in transformers)
    s = sample(model, prompts, max_new_tokens=MAX_NEW_TOKENS, temperature=args.temperature,
               eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
               generator=generator)
    rewards = exact_rewards(answers(tokenizer, s), [p.label for p in group])
    t1 = time.perf_counter()
    model.train()
    logp = response_logprobs(model, prompts, s, args.temperature)
    # One optimizer step per rollout: the policy that sampled is the one being trained, so
    # old log-probs are this forward's, detached (ratio = 1; the clip only matters once more
    # than one step reuses a rollout). The full system recomputes them in a separate pass.
    adv = grpo_advantages(rewards, args.samples)
    loss, clipfrac = ppo_clip_loss(logp, logp.detach(), adv, s.mask, args.eps_clip)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    t2 = time.perf_counter()
    return StepStats(0, float(rewards.mean()), t1 - t0, t2 - t1, clipfrac)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("out/tiny"), help="tiny build directory")
    p.add_argument("--sft-steps", type=int, default=BuildConfig.sft_steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=0,
                   help="linear LR warmup steps (the RLJob's algorithm.lrWarmupSteps)")
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--temperature", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(THREADS)
    build(args.out, BuildConfig(seed=args.seed, sft_steps=args.sft_steps))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(args.out / MODEL_DIR))
    tokenizer = AutoTokenizer.from_pretrained(str(args.out / MODEL_DIR))
    stream = PromptStream(load_problems(args.out / TRAIN_FILE), args.seed)
    held_out = load_problems(args.out / EVAL_FILE)
    # The fsdp backend's optimizer (kuberl_trainer/backends/optim.py): AdamW, betas (0.9,
    # 0.999), weight decay 0.01, linear warmup, grad-norm clip 1.0; so the curves compare.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, LrMultiplier(args.warmup, None, 0.0))
    generator = torch.Generator().manual_seed(args.seed)

    greedy_before = accuracy(model, tokenizer, held_out)
    print(f"threads {torch.get_num_threads()}  greedy eval accuracy before: {greedy_before:.3f}")
    print(f"{'step':>5} {'reward':>7} {'gen_s':>7} {'train_s':>7} {'clipfrac':>8}")
    stats = []
    for step in range(args.steps):
        st = grpo_step(model, tokenizer, optimizer, stream.next(args.prompts), args, generator)
        schedule.step()
        st.step = step
        stats.append(st)
        print(f"{step:>5} {st.reward:>7.3f} {st.generate_s:>7.3f} {st.train_s:>7.3f} "
              f"{st.clipfrac:>8.3f}", flush=True)
    model.train(False)
    summarize(stats, greedy_before, accuracy(model, tokenizer, held_out))
    return 0


def summarize(stats: list[StepStats], greedy_before: float, greedy_after: float) -> None:
    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    first = mean([s.reward for s in stats[:5]])
    last = mean([s.reward for s in stats[-5:]])
    gen = mean([s.generate_s for s in stats])
    train = mean([s.train_s for s in stats])
    print(f"\nsteps {len(stats)}: reward first-5 mean {first:.3f} -> last-5 mean {last:.3f} "
          f"({last - first:+.3f})")
    print(f"greedy eval accuracy {greedy_before:.3f} -> {greedy_after:.3f}")
    print(f"s/step {gen + train:.3f} = generate {gen:.3f} + train {train:.3f}; "
          f"total {sum(s.generate_s + s.train_s for s in stats):.1f} s")


if __name__ == "__main__":
    sys.exit(main())
