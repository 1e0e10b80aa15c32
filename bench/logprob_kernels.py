"""Log-prob + entropy over a 152k vocabulary: GPU time and memory of one train step's worth.

Side by side in one run, on the same bf16 logits ``[tokens, vocab]`` (benchmark 1's batch:
24.6k tokens, Qwen's 151,936 columns), forward + backward of ``(logp, entropy)`` with a loss
that uses both:

- ``float32 copy``: what both backends did before issue 17 - ``logits.float() / T`` kept for
  backward, the softmax sums over it (the old ``megatron/vocab_parallel.py``);
- ``chunked eager``: ``backends/vocab_logprobs.py`` with compiling off (the CPU path);
- ``chunked compiled``: the same with its chunk functions compiled (the CUDA path).

Also checks each against a float64 computation on a slice of rows: values and gradients.

    python bench/logprob_kernels.py [--tokens 24576] [--vocab 151936] [--repeats 5]

Prints a table: ms of GPU time (CUDA events, median), peak extra memory, largest errors.
Never part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch

from kuberl_trainer.backends import vocab_logprobs

Fn = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
W_LOGP, W_ENT = 0.7, -0.01


def float32_copy(logits: torch.Tensor, targets: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-issue-17 computation: a float32 copy of the scaled logits, kept for backward."""
    x = logits.float() / temperature
    shifted = x - x.detach().amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    log_total = total.log()
    logp = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_total
    entropy = log_total - (exp * shifted).sum(dim=-1) / total
    return logp, entropy


def chunked(logits: torch.Tensor, targets: torch.Tensor,
            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return vocab_logprobs.token_logprobs_and_entropy(logits, targets, temperature=temperature)


def compiling(on: bool) -> None:
    """Switch the trainer's kernels between compiled and eager (its own environment knob)."""
    os.environ[vocab_logprobs.COMPILE_ENV] = "1" if on else "0"
    vocab_logprobs._compiled.cache_clear()


def step(fn: Fn, logits: torch.Tensor, targets: torch.Tensor,
         temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = logits.detach().requires_grad_()
    logp, entropy = fn(leaf, targets, temperature)
    (logp * W_LOGP + entropy * W_ENT).sum().backward()
    assert leaf.grad is not None
    return logp.detach(), entropy.detach(), leaf.grad


def reference(logits: torch.Tensor, targets: torch.Tensor,
              temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(leaf / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    (logp * W_LOGP + entropy * W_ENT).sum().backward()
    assert leaf.grad is not None
    return logp.detach(), entropy.detach(), leaf.grad


def measure(fn: Fn, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
            repeats: int) -> tuple[float, float]:
    """(median ms of GPU time, peak GiB allocated beyond the inputs)."""
    step(fn, logits, targets, temperature)  # warm-up (compiles)
    times = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(fn, logits, targets, temperature)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=24576)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=256)
    parser.add_argument("--ways", default="float32 copy,chunked eager,chunked compiled",
                        help="comma-separated subset (the float32 copy needs ~10x the "
                             "logits' size: leave it out past ~10k tokens on 80 GB)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, device="cuda", generator=gen) * 3
              ).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    rows = slice(0, args.check_rows)
    want = reference(logits[rows], targets[rows], args.temperature)
    ways: list[tuple[str, Fn, bool]] = [("float32 copy", float32_copy, False),
                                        ("chunked eager", chunked, False),
                                        ("chunked compiled", chunked, True)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens x "
          f"{args.vocab} vocabulary, bf16 logits ({logits.numel() * 2 / 2**30:.2f} GiB), "
          f"T={args.temperature}; errors vs float64 on {args.check_rows} rows")
    print("| way | ms fwd+bwd | peak extra GiB | max logp err | max entropy err | "
          "max grad err (bf16 ulp-scale) | vs first row |")
    print("|---|---|---|---|---|---|---|")
    first = None
    chosen = args.ways.split(",")
    for name, fn, compiled in [w for w in ways if w[0] in chosen]:
        compiling(compiled)
        got = step(fn, logits[rows], targets[rows], args.temperature)
        errs = [float((g.double() - w).abs().max()) for g, w in zip(got, want, strict=True)]
        ms, gib = measure(fn, logits, targets, args.temperature, args.repeats)
        first = first or ms
        print(f"| {name} | {ms:.1f} | {gib:.2f} | {errs[0]:.2e} | {errs[1]:.2e} | "
              f"{errs[2]:.2e} | {first / ms:.2f}x |")


if __name__ == "__main__":
    main()
