"""Accuracy of the tiny model on addition problems, greedy or sampled."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kuberl_trainer.tiny.data import Problem
from kuberl_trainer.tiny.sampling import answers, exact_rewards, sample

MAX_NEW_TOKENS = 4  # up to 3 answer digits + eos


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> torch.Tensor:
    """[B, P] ids of equal-length prompts (the sampler relies on there being no padding)."""
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    if len({len(r) for r in rows}) > 1:
        raise ValueError("prompts must tokenize to equal lengths")
    return torch.tensor(rows, dtype=torch.long)


def accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
             problems: list[Problem], *, temperature: float = 0.0, n_samples: int = 1,
             seed: int = 0, batch_prompts: int = 256) -> float:
    """Mean exact-match reward over `n_samples` responses per problem (temperature 0: greedy)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos, int) and isinstance(pad, int)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for start in range(0, len(problems), batch_prompts):
        chunk = [p for p in problems[start:start + batch_prompts] for _ in range(n_samples)]
        samples = sample(model, prompt_ids(tokenizer, [p.prompt for p in chunk]),
                         max_new_tokens=MAX_NEW_TOKENS, temperature=temperature,
                         eos_id=eos, pad_id=pad, generator=generator)
        rewards = exact_rewards(answers(tokenizer, samples), [p.label for p in chunk])
        total += float(rewards.sum())
    return total / (len(problems) * n_samples)
